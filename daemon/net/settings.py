"""The peer network's settings: the `[net]` section (listening, bootstrap, NAT traversal, caps on
traffic) and the `[relay]` section of the daemon's configuration. Values are checked when the
settings are made; `transport_limits()` and `relay_limits()` say what they mean for the transport
and the relay service (whose limits hold more than a user sets).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..settings import documented
from .link import LinkLimits
from .ratelimit import check_rate
from .relay import RelayLimits
from .transport import TransportLimits


@dataclass(frozen=True)
class NetSettings:
    listen: list[str] = documented(
        "Addresses to listen on for peers, like /ip4/0.0.0.0/tcp/4100. Port 0 picks a free port; "
        "a peer that others bootstrap from, or whose port is forwarded, wants a fixed one.",
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = documented(
        "Addresses to tell other peers instead of the listening ones (e.g. a forwarded public "
        "address). Empty: the listening addresses.", default_factory=list)
    bootstrap: list[str] = documented(
        "Peers to join through, like /ip4/203.0.113.5/tcp/4100/p2p/<peer-id> (repeat "
        "--net.bootstrap or give a comma-separated list). Unreachable ones are retried in the "
        "background; start-up never fails because of them.", default_factory=list)
    handshake_timeout: float = documented("Seconds a peer may take for the TLS and identity handshake.",
                                          default=10.0)
    limit_loopback: bool = documented(
        "Count connections from 127.0.0.1 (and ::1) against the handshake slots' per-address "
        "limit too. Off by default, since a host's own peers all come from there; turn it on "
        "where strangers reach this daemon through a local tunnel or proxy (SSH -R, Tor, "
        "stunnel), which makes them all arrive from loopback.", default=False)
    call_timeout: float = documented("Default deadline of one peer-to-peer call, in seconds.", default=10.0)
    max_frame_bytes: int = documented("Largest frame payload a peer may send.", default=16 << 20)
    max_streams_per_peer: int = documented("Most concurrent calls and streams one peer may open.",
                                           default=256)
    idle_timeout: float = documented("Seconds an unused link to a peer stays open.", default=600.0)
    stun: bool = documented(
        "Answer STUN binding requests on a UDP port so that peers behind NATs learn their public "
        "address from this daemon (no outside STUN server is ever used).", default=True)
    ice_servers: list[str] = documented(
        "Extra STUN/TURN servers for WebRTC, e.g. stun:host:3478 or "
        "turn:user:password@host:3478?transport=udp (a coturn the run's owner operates). The "
        "daemon never uses a server that is not listed here or a peer of the run.",
        default_factory=list)
    webrtc: bool = documented("Try WebRTC (ICE hole punching) when a peer is only reachable through a "
                              "relay.", default=True)
    holepunch: bool = documented("Try TCP hole punching (before WebRTC) when a peer is only reachable "
                                 "through a relay.", default=True)
    stun_port: int = documented(
        "UDP port for STUN; 0: the same number as the TCP listen port if free, else any free port.",
        default=0)
    upload_bytes_per_second: float = documented(
        "Cap on the bytes per second this daemon sends to all its peers together (every link and "
        "path; frame bytes, not counting TLS/TCP overhead). 0: no cap; else at least 16384. "
        "`dedloc bandwidth` changes it at run time (until the daemon restarts); averaging "
        "advertises at most this upload to its groups.", default=0.0)
    download_bytes_per_second: float = documented(
        "Cap on the bytes per second this daemon reads from all its peers together (reading slows, "
        "so senders back off). 0: no cap; else at least 16384.", default=0.0)

    def __post_init__(self) -> None:
        for name in ("upload_bytes_per_second", "download_bytes_per_second"):
            try:
                check_rate(name, getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"net.{name}", str(exc)) from None
    def transport_limits(self) -> TransportLimits:
        return TransportLimits(
            handshake_timeout=self.handshake_timeout, limit_loopback=self.limit_loopback,
            link=LinkLimits(max_payload=self.max_frame_bytes, max_streams=self.max_streams_per_peer,
                            idle_timeout=self.idle_timeout))


@dataclass(frozen=True)
class RelaySettings:
    serve: bool = documented("Relay links for peers that nobody can dial, when this node is reachable "
                             "(bounded by the limits below).", default=True)
    reserve: int = documented("When nobody can dial this node: on how many reachable peers it keeps a "
                              "relay slot (its circuit addresses).", default=2)
    max_reservations: int = documented("Most peers that may hold a slot on this relay.", default=128)
    max_circuits_per_peer: int = documented("Most relayed links at once per relayed peer.", default=8)
    bytes_per_second_per_peer: float = documented(
        "Bytes per second this relay carries for one relayed peer (all its circuits together).",
        default=4 * 1024 * 1024)
    max_circuit_seconds: float = documented("Longest life of one relayed link, in seconds.", default=3600.0)
    members_only: bool = documented("Relay only for members of the closed runs this node takes part in "
                                    "(they present their tokens); false: for any peer.", default=False)
    def relay_limits(self) -> RelayLimits:
        """What the relay service serves (`serve` and the caps; the burst is two seconds' worth,
        at least 1 MiB)."""
        return RelayLimits(
            enabled=self.serve, max_reservations=self.max_reservations,
            max_circuits_per_peer=self.max_circuits_per_peer,
            bytes_per_second_per_peer=self.bytes_per_second_per_peer,
            burst_bytes=int(max(self.bytes_per_second_per_peer * 2, 1 << 20)),
            max_circuit_seconds=self.max_circuit_seconds)
