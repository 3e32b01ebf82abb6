"""Bandwidth estimates from observed transfers: this peer's own (`BandwidthEstimator`, what it
claims as `Member.upload/download`) and the rates it measured of the others (`PeerRates`, the
evidence a leader bounds their claims with, claims.py).

Each direction keeps an exponentially weighted moving average of observed rates (bytes / seconds),
starting from the configured guess: after k accepted samples of a constant rate x the estimate is
x + (guess − x)·2^(−k / half_life_samples). Transfers smaller than `min_bytes` or quicker than
`min_seconds` are ignored: their duration is mostly latency and set-up, not bandwidth.
"""

from __future__ import annotations

import collections
import collections.abc
import math

from .group import Group
from .report import AllReduceReport

__all__ = ["BandwidthEstimator", "PeerRates", "measured_rates"]

MIN_BYTES = 256 * 1024
MIN_SECONDS = 0.01
MAX_PEERS = 4096  # remote peers whose rates are remembered (the least recently measured go first)


def _positive(name: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, not {value!r}")
    return float(value)


class BandwidthEstimator:
    """Upload and download rates of this peer (bytes/s), learned from its transfers. Pure and
    deterministic; not thread-safe."""

    def __init__(self, initial_upload: float, initial_download: float, *, half_life_samples: float = 5.0,
                 min_bytes: int = MIN_BYTES, min_seconds: float = MIN_SECONDS) -> None:
        self._upload = _positive("initial_upload", initial_upload)
        self._download = _positive("initial_download", initial_download)
        self._alpha = 1.0 - 0.5 ** (1.0 / _positive("half_life_samples", half_life_samples))
        if min_bytes < 0 or not math.isfinite(min_seconds) or min_seconds < 0:
            raise ValueError("min_bytes and min_seconds must be non-negative")
        self._min_bytes = min_bytes
        self._min_seconds = min_seconds
        self._upload_samples = 0
        self._download_samples = 0

    @property
    def upload(self) -> float:
        """Estimated upload rate in bytes/s."""
        return self._upload

    @property
    def download(self) -> float:
        """Estimated download rate in bytes/s."""
        return self._download

    @property
    def samples(self) -> int:
        """Accepted observations so far, both directions together."""
        return self._upload_samples + self._download_samples

    @property
    def upload_samples(self) -> int:
        return self._upload_samples

    @property
    def download_samples(self) -> int:
        return self._download_samples

    def observe_upload(self, size: float, seconds: float) -> bool:
        """Record that `size` bytes went out in `seconds`; True when the sample was used."""
        rate = self._rate(size, seconds)
        if rate is None:
            return False
        self._upload += self._alpha * (rate - self._upload)
        self._upload_samples += 1
        return True

    def observe_download(self, size: float, seconds: float) -> bool:
        """Record that `size` bytes came in within `seconds`; True when the sample was used."""
        rate = self._rate(size, seconds)
        if rate is None:
            return False
        self._download += self._alpha * (rate - self._download)
        self._download_samples += 1
        return True

    def _rate(self, size: float, seconds: float) -> float | None:
        if not (math.isfinite(size) and math.isfinite(seconds)) or size < 0 or seconds < 0:
            raise ValueError(f"a transfer needs a finite non-negative size and duration, not "
                             f"{size!r} bytes in {seconds!r} s")
        if size < self._min_bytes or seconds < self._min_seconds or seconds == 0 or size == 0:
            return None
        return size / seconds


def measured_rates(group: Group, index: int, report: AllReduceReport) -> dict[str, float]:
    """What member `index` measured of each other member in one round, in bytes/s per direction:
    the member's load in the round (the load balancer's model: s·(1 − w)·B + w·B·R, its sending
    and its reducing, in the bytes this round's codec used per element) over the time this
    member's own transfers with it took, first byte to last; the whole round for a member that
    failed it (a reducer whose part did not come back, a sender left out). Exchanges under
    MIN_BYTES or MIN_SECONDS measure latency, not bandwidth, and are left out.

    The time includes waiting for the slowest member of the round, so the rate is what the member
    did in this round, not all it could do; every member is measured alike, and a member's own
    claim (BandwidthEstimator: its bytes over its round's time) waits the same, so figures
    bounded by it stay comparable (claims.py)."""
    members = group.members
    if len(members) < 2 or group.size <= 0:
        return {}
    senders = sum(1 for m in members if m.sends)
    fractions = [(end - start) / group.size for start, end in group.part_bounds]

    def load(i: int) -> float:  # in elements, each way
        s = 1.0 if members[i].sends else 0.0
        return (s * (1.0 - fractions[i]) + fractions[i] * (senders - s)) * group.size

    own = load(index)
    moved = report.bytes_sent + report.bytes_received
    if own <= 0 or moved <= 0:
        return {}
    bytes_per_element = moved / (2 * own)
    failed = {f.reducer for f in report.failures} | set(report.senders_excluded)
    rates: dict[str, float] = {}
    for i, member in enumerate(members):
        transfer = report.transfers.get(member.peer_id)
        if i == index or transfer is None:
            continue
        seconds = report.seconds if member.peer_id in failed else transfer.seconds
        if transfer.bytes_sent + transfer.bytes_received < MIN_BYTES or seconds < MIN_SECONDS:
            continue
        rates[member.peer_id] = load(i) * bytes_per_element / seconds
    return rates


class PeerRates:
    """The rates (bytes/s) this peer measured of others in past rounds, one moving average per
    peer (the first sample taken as it is, then halfway to each new one after
    `half_life_samples`), for at most MAX_PEERS peers. Written on the event loop; reading from the
    load balancer's thread is safe (dict lookups; one racing an update of the same peer reads it
    as never measured, the conservative side)."""

    def __init__(self, *, half_life_samples: float = 2.0, max_peers: int = MAX_PEERS) -> None:
        self._alpha = 1.0 - 0.5 ** (1.0 / _positive("half_life_samples", half_life_samples))
        self._max_peers = max_peers
        self._rates: collections.OrderedDict[str, float] = collections.OrderedDict()

    def observe(self, peer_id: str, rate: float) -> float:
        """Record a measured rate of `peer_id`; its new estimate."""
        rate = _positive("rate", rate)
        previous = self._rates.pop(peer_id, None)
        estimate = rate if previous is None else previous + self._alpha * (rate - previous)
        self._rates[peer_id] = estimate
        while len(self._rates) > self._max_peers:
            self._rates.popitem(last=False)
        return estimate

    def get(self, peer_id: str) -> float | None:
        return self._rates.get(peer_id)

    def __len__(self) -> int:
        return len(self._rates)

    def snapshot(self, peer_ids: collections.abc.Iterable[str]) -> dict[str, float]:
        """The estimates of these peers (those measured)."""
        return {p: r for p in peer_ids if (r := self._rates.get(p)) is not None}
