"""Control-API methods of the volunteer's bandwidth caps: show them, change them at run time.

The caps start from the config (net.upload_bytes_per_second, net.download_bytes_per_second) and a
change lasts until the daemon restarts. They bound all peer traffic of the daemon together
(daemon/net/ratelimit.py) and what its averaging advertises to the load balancer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, TypedDict

from dedloc.rpc import InvalidParams, rpc_method

from .net.ratelimit import check_rate

if TYPE_CHECKING:
    from .network import PeerNetwork

Rate = Annotated[float | None, "Bytes per second; 0: no cap; null: leave it as it is.",
                 {"minimum": 0}]


class BandwidthStatus(TypedDict):
    upload_bytes_per_second: Annotated[float, "Cap on what this daemon sends to all peers (0: none)."]
    download_bytes_per_second: Annotated[float, "Cap on what it reads from all peers (0: none)."]
    throttled_seconds_up: Annotated[float, "Time links waited for the upload cap, in all."]
    throttled_seconds_down: Annotated[float, "Time links waited for the download cap, in all."]
    throttled_bytes_up: Annotated[int, "Bytes that had to wait for the upload cap."]
    throttled_bytes_down: Annotated[int, "Bytes that had to wait for the download cap."]


class BandwidthApi:
    def __init__(self, network: PeerNetwork) -> None:
        self._network = network

    @rpc_method("node.bandwidth")
    async def bandwidth(self) -> BandwidthStatus:
        """The bandwidth caps and how much they held traffic back."""
        return self._status()

    @rpc_method("node.set_bandwidth")
    async def set_bandwidth(
        self,
        upload_bytes_per_second: Rate = None,
        download_bytes_per_second: Rate = None,
    ) -> BandwidthStatus:
        """Cap this daemon's upload and/or download (all peers together), at once and until the
        daemon restarts (the config sets the lasting value). A cap is 0 (none) or at least
        16384 bytes/s; averaging then advertises at most the caps to its groups."""
        for name, value in (("upload_bytes_per_second", upload_bytes_per_second),
                            ("download_bytes_per_second", download_bytes_per_second)):
            if value is not None:
                try:
                    check_rate(name, value)
                except ValueError as exc:
                    raise InvalidParams(name, str(exc)) from None
        self._network.bandwidth.set(upload_bytes_per_second, download_bytes_per_second)
        return self._status()

    def _status(self) -> BandwidthStatus:
        bandwidth = self._network.bandwidth
        return {
            "upload_bytes_per_second": bandwidth.upload,
            "download_bytes_per_second": bandwidth.download,
            "throttled_seconds_up": round(bandwidth.waited["up"], 3),
            "throttled_seconds_down": round(bandwidth.waited["down"], 3),
            "throttled_bytes_up": bandwidth.throttled_bytes["up"],
            "throttled_bytes_down": bandwidth.throttled_bytes["down"],
        }
