"""Collaborative progress: what each peer publishes about its accumulation, and what the run as a
whole has accumulated toward the target batch size. Pure: no I/O, time is passed in.

Each peer publishes a `PeerProgress` under the run's progress key, with its own peer id as the
sub-key (the DHT lets only that peer write it). Readers decode the sub-keys with
`PeerProgress.from_bytes` (or `reports_from_sub_keys`) and fold them with `estimate_global`.

Rules of `estimate_global`:
- Liveness. A report is dropped when expired (`expiration <= now`), older than `stale_after`
  seconds, or dated more than `stale_after` seconds in the future (a skewed or lying clock would
  otherwise stay fresh forever). Per peer the latest report wins (by `time`, then `expiration`).
  `own`, the local peer's freshest state, replaces whatever the DHT holds for that peer and is
  never dropped as stale (it is not hearsay). A peer whose latest report is its farewell
  (`left`) is not live.
- The run's epoch is the highest epoch that at least `min(2, live trainers)` live trainers have
  reached: the second-highest trainer epoch when two or more trainers are live, the only one's
  otherwise. One lying or buggy peer therefore cannot move the run ahead (a real step moves every
  peer of the round, so two peers normally confirm a new epoch); it can only delay confirmation
  while it is alone ahead. With no live trainer, the same rule over the aux peers, else 0.
  `highest_epoch` is the highest any live trainer reports, confirmed or not: a peer that comes
  back (new, restarted, resumed, or after a failed round) catches up to it (PeerSync), since with
  two trainers the run's epoch is the lower one's and the peer behind would otherwise train alone
  from its stale state while the other waits.
- Samples. Only trainers at exactly the run's epoch count; peers behind are out of date (they
  will resynchronise) and peers ahead are unconfirmed. A counted trainer contributes its reported
  samples plus `samples_per_second * elapsed`, where `elapsed = now - time` is clamped to
  [0, stale_after], and the contribution is capped at `target_batch_size` (no single peer can
  claim more than a whole batch). Aux peers never count toward samples.
- Throughput is the sum over the counted trainers, so `eta_seconds` (remaining / throughput) is
  consistent with the samples; it is 0 when the target is reached and None with no throughput.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = [
    "MAX_EPOCH",
    "MAX_REPORT_BYTES",
    "MAX_SAMPLES",
    "MAX_SAMPLES_PER_SECOND",
    "GlobalProgress",
    "InvalidProgress",
    "PeerProgress",
    "Role",
    "estimate_global",
    "next_report_delay",
    "reports_from_sub_keys",
    "should_average",
]

Role = Literal["trainer", "aux"]
ROLES: tuple[str, ...] = ("trainer", "aux")

MAX_REPORT_BYTES = 4096
MAX_PEER_ID_CHARS = 512  # as the DHT's sub-key limit
MAX_EPOCH = 10**12
MAX_SAMPLES = 10**15
MAX_SAMPLES_PER_SECOND = 1e9
MAX_TIME = 1e11  # unix seconds: year ~5138; anything later is a broken clock
MAX_OVERHEAD = 86400.0


class InvalidProgress(ValueError):
    """A progress report that is malformed or out of range; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_int(name: str, value: object, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidProgress(name, f"expected an integer, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise InvalidProgress(name, f"{value} is outside [0, {maximum}]")
    return value


def _check_float(name: str, value: object, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidProgress(name, f"expected a number, got {type(value).__name__}")
    number = float(value)
    if not 0.0 <= number <= maximum:  # also refuses NaN
        raise InvalidProgress(name, f"{value} is outside [0, {maximum}]")
    return number


@dataclass(frozen=True)
class PeerProgress:
    """One peer's report. `samples_accumulated` counts toward the current epoch's target;
    `total_samples` is everything the peer has contributed to the run. `time` is when the report
    was made and `expiration` when it stops being believed (unix seconds). Validated on
    construction: `InvalidProgress` (a ValueError) names the offending field."""

    peer_id: str
    epoch: int
    samples_accumulated: int
    samples_per_second: float
    time: float
    expiration: float
    role: Role = "trainer"
    total_samples: int = 0
    step_overhead: float | None = None  # seconds from the run's target to this peer's last step
    left: bool = False  # the peer's farewell: it stopped (its earlier reports no longer count)
    started_at: float | None = None  # when the peer started (or restarted) taking part in the run

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise InvalidProgress("peer_id", "expected a non-empty string")
        if len(self.peer_id) > MAX_PEER_ID_CHARS:
            raise InvalidProgress("peer_id", f"longer than {MAX_PEER_ID_CHARS} characters")
        _check_int("epoch", self.epoch, MAX_EPOCH)
        _check_int("samples_accumulated", self.samples_accumulated, MAX_SAMPLES)
        _check_int("total_samples", self.total_samples, MAX_SAMPLES)
        # floats are normalised so that 3 and 3.0 compare and encode alike
        object.__setattr__(self, "samples_per_second",
                           _check_float("samples_per_second", self.samples_per_second,
                                        MAX_SAMPLES_PER_SECOND))
        object.__setattr__(self, "time", _check_float("time", self.time, MAX_TIME))
        object.__setattr__(self, "expiration",
                           _check_float("expiration", self.expiration, MAX_TIME))
        if self.expiration < self.time:
            raise InvalidProgress("expiration", f"{self.expiration} is before the report's time "
                                                f"{self.time}")
        if self.role not in ROLES:
            raise InvalidProgress("role", f"{self.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(self.left, bool):
            raise InvalidProgress("left", f"expected a boolean, got {type(self.left).__name__}")
        if self.step_overhead is not None:
            object.__setattr__(self, "step_overhead",
                               _check_float("step_overhead", self.step_overhead, MAX_OVERHEAD))
        if self.started_at is not None:
            object.__setattr__(self, "started_at",
                               _check_float("started_at", self.started_at, MAX_TIME))
            if self.started_at > self.time:
                raise InvalidProgress("started_at", f"{self.started_at} is after the report's "
                                                    f"time {self.time}")

    def to_bytes(self) -> bytes:
        return orjson.dumps({
            "peer_id": self.peer_id,
            "epoch": self.epoch,
            "samples_accumulated": self.samples_accumulated,
            "samples_per_second": self.samples_per_second,
            "time": self.time,
            "expiration": self.expiration,
            "role": self.role,
            "total_samples": self.total_samples,
            "step_overhead": self.step_overhead,
            "left": self.left,
            "started_at": self.started_at,
        })

    @classmethod
    def from_bytes(cls, data: bytes, peer_id: str) -> PeerProgress:
        """Decode a report read from the DHT sub-key `peer_id`. Unknown fields are ignored (a newer
        peer may add some); missing, mistyped or out-of-range ones raise `InvalidProgress`, as does
        a report that names another peer than the sub-key it was stored under."""
        if len(data) > MAX_REPORT_BYTES:
            raise InvalidProgress("report", f"{len(data)} bytes is over {MAX_REPORT_BYTES}")
        try:
            payload: Any = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InvalidProgress("report", f"not JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise InvalidProgress("report", f"expected an object, got {type(payload).__name__}")
        names = ("peer_id", "epoch", "samples_accumulated", "samples_per_second", "time",
                 "expiration", "role", "total_samples")
        for name in names:
            if name not in payload:
                raise InvalidProgress(name, "missing")
        if payload["peer_id"] != peer_id:
            raise InvalidProgress("peer_id", f"report names {payload['peer_id']!r} but was stored "
                                             f"under {peer_id!r}")
        return cls(**{name: payload[name] for name in names},  # the optional fields: older peers
                   step_overhead=payload.get("step_overhead"),  # omit them
                   left=payload.get("left", False),
                   started_at=payload.get("started_at"))


def reports_from_sub_keys(values: Mapping[str, bytes]) -> tuple[list[PeerProgress], dict[str, str]]:
    """Decode the sub-key values of the progress key (e.g. `{k: e.value for k, e in
    record.sub_keys.items()}`). Returns the valid reports and, per rejected sub-key, why."""
    reports: list[PeerProgress] = []
    rejected: dict[str, str] = {}
    for sub_key, value in values.items():
        try:
            reports.append(PeerProgress.from_bytes(value, sub_key))
        except InvalidProgress as exc:
            rejected[sub_key] = str(exc)
    return reports, rejected


@dataclass(frozen=True)
class GlobalProgress:
    """The run's progress as one peer estimates it at `now` (see the module's rules).
    `contributions` maps every live peer to its `total_samples`, for status displays, and
    `live_peers` describes each live peer (role, epoch, throughput, samples, since when it takes
    part, when it last reported), for the dashboard's tables."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    live_trainers: int
    live_aux: int
    samples_per_second: float
    eta_seconds: float | None
    ready: bool
    now: float
    contributions: dict[str, int] = field(default_factory=dict)
    trainers_at_epoch: int = 0  # live trainers at exactly `epoch`: the ones that average now
    step_overhead: float | None = None  # the worst `step_overhead` reported at the run's epoch
    live_peers: list[dict[str, Any]] = field(default_factory=list)
    highest_epoch: int = 0  # the highest epoch a live trainer reports (confirmed or not)

    @property
    def remaining(self) -> int:
        return max(0, self.target_batch_size - self.samples_accumulated)


def _newer(a: PeerProgress, b: PeerProgress) -> bool:
    return (a.time, a.expiration) > (b.time, b.expiration)


def _robust_epoch(epochs: list[int]) -> int:
    """The highest epoch reached by at least min(2, len(epochs)) peers; 0 if none."""
    if not epochs:
        return 0
    ranked = sorted(epochs, reverse=True)
    return ranked[min(2, len(ranked)) - 1]


def estimate_global(reports: Iterable[PeerProgress], *, target_batch_size: int, now: float,
                    own: PeerProgress | None = None, stale_after: float) -> GlobalProgress:
    """Fold the peers' reports into the run's progress at `now` (rules in the module docstring)."""
    if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int) \
            or target_batch_size < 1:
        raise ValueError(f"target_batch_size must be a positive integer, got {target_batch_size!r}")
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")
    if not stale_after > 0 or not math.isfinite(stale_after):
        raise ValueError(f"stale_after must be positive and finite, got {stale_after!r}")

    latest: dict[str, PeerProgress] = {}
    for report in reports:
        if report.expiration <= now or abs(now - report.time) > stale_after:
            continue
        if own is not None and report.peer_id == own.peer_id:
            continue
        held = latest.get(report.peer_id)
        if held is None or _newer(report, held):
            latest[report.peer_id] = report
    if own is not None:
        latest[own.peer_id] = own
    latest = {peer_id: r for peer_id, r in latest.items() if not r.left}

    trainers = [r for r in latest.values() if r.role == "trainer"]
    aux = [r for r in latest.values() if r.role == "aux"]
    epoch = _robust_epoch([r.epoch for r in trainers] or [r.epoch for r in aux])

    samples = 0.0
    rate = 0.0
    at_epoch = 0
    overheads = [r.step_overhead for r in trainers
                 if r.step_overhead is not None and r.epoch == epoch]
    for report in trainers:
        if report.epoch != epoch:
            continue
        at_epoch += 1
        elapsed = min(max(now - report.time, 0.0), stale_after)
        estimate = report.samples_accumulated + report.samples_per_second * elapsed
        samples += min(estimate, float(target_batch_size))
        rate += report.samples_per_second
    accumulated = math.floor(samples)
    remaining = max(0, target_batch_size - accumulated)
    if remaining == 0:
        eta: float | None = 0.0
    elif rate > 0:
        eta = remaining / rate
    else:
        eta = None
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=accumulated,
        target_batch_size=target_batch_size,
        live_trainers=len(trainers),
        live_aux=len(aux),
        samples_per_second=rate,
        eta_seconds=eta,
        ready=accumulated >= target_batch_size,
        now=now,
        contributions={peer_id: r.total_samples for peer_id, r in sorted(latest.items())},
        trainers_at_epoch=at_epoch,
        highest_epoch=max((r.epoch for r in trainers), default=epoch),
        step_overhead=max(overheads) if overheads else None,
        live_peers=[{"peer_id": peer_id, "role": r.role, "epoch": r.epoch,
                     "samples_per_second": r.samples_per_second, "total_samples": r.total_samples,
                     "started_at": r.started_at, "reported_at": r.time}
                    for peer_id, r in sorted(latest.items())],
    )


#: `next_report_delay` waits this fraction of the estimated time to the target.
REPORT_FRACTION = 0.5


def next_report_delay(global_progress: GlobalProgress, own_samples_per_second: float, *,
                      min_delay: float, max_delay: float) -> float:
    """Seconds until this peer should publish its progress and re-read the run's again.

    Rule: `REPORT_FRACTION` (one half) of the estimated time to the target, clamped to
    [min_delay, max_delay]. The rate is the larger of the run's and this peer's own throughput
    (this peer's may not be counted yet, e.g. while it resynchronises). Halving the remaining time
    at each read converges on the target geometrically, so the round starts at most about
    `min_delay` after the target is reached, while a run far from its target is read rarely.
    Ready: `min_delay`. No throughput at all: `max_delay`.
    """
    if not 0 <= min_delay <= max_delay or not math.isfinite(max_delay):
        raise ValueError(f"need 0 <= min_delay <= max_delay < inf, got {min_delay!r}, {max_delay!r}")
    if global_progress.ready:
        return min_delay
    rate = max(global_progress.samples_per_second, own_samples_per_second)
    if not rate > 0 or not math.isfinite(rate):  # NaN and inf too
        return max_delay
    eta = global_progress.remaining / rate
    return min(max(REPORT_FRACTION * eta, min_delay), max_delay)


def should_average(global_progress: GlobalProgress, own_epoch: int) -> bool:
    """True when this peer should join the averaging round now: the run has reached its target
    and is at this peer's epoch. A peer behind must resynchronise instead; a peer ahead waits for
    the run to confirm its epoch."""
    return global_progress.ready and own_epoch == global_progress.epoch
