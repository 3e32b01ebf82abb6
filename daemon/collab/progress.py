"""Progress reports: what each peer of a run publishes about where it is and what it has done.

Each peer publishes a `PeerProgress` under the run's progress key, with its own peer id as the
sub-key (the DHT lets only that peer write it): its epoch and lineage (the head of its state),
the samples it has accumulated toward the epoch's target, its throughput and totals. Readers
decode the sub-keys with `PeerProgress.from_bytes` (or `reports_from_sub_keys`), which checks
every field against its bounds, and fold them into the run's estimate with
`estimate.estimate_global`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .lineage import is_lineage

__all__ = [
    "MAX_EPOCH",
    "MAX_REPORT_BYTES",
    "MAX_SAMPLES",
    "MAX_SAMPLES_PER_SECOND",
    "InvalidProgress",
    "PeerProgress",
    "Role",
    "reports_from_sub_keys",
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
    lineage: str | None = None  # the history of the peer's state (lineage.py); None: an older peer
    planned: int | None = None  # the most it will have accumulated by its next report (None: no bound)
    # it came to its head by stepping in the round that made it (not by a download or a restart):
    # the run's next grid round gives its cells to these (grid.py), a list every reader agrees on
    stepped: bool = False
    # state downloads this peer has served in the run: newcomers prefer the less loaded of two
    # donors (donors.py); a lie costs no one more than being asked twice as often
    served: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise InvalidProgress("peer_id", "expected a non-empty string")
        if len(self.peer_id) > MAX_PEER_ID_CHARS:
            raise InvalidProgress("peer_id", f"longer than {MAX_PEER_ID_CHARS} characters")
        _check_int("epoch", self.epoch, MAX_EPOCH)
        _check_int("samples_accumulated", self.samples_accumulated, MAX_SAMPLES)
        _check_int("total_samples", self.total_samples, MAX_SAMPLES)
        _check_int("served", self.served, MAX_SAMPLES)
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
        if not isinstance(self.stepped, bool):
            raise InvalidProgress("stepped", f"expected a boolean, got {type(self.stepped).__name__}")
        if self.step_overhead is not None:
            object.__setattr__(self, "step_overhead",
                               _check_float("step_overhead", self.step_overhead, MAX_OVERHEAD))
        if self.started_at is not None:
            object.__setattr__(self, "started_at",
                               _check_float("started_at", self.started_at, MAX_TIME))
            if self.started_at > self.time:
                raise InvalidProgress("started_at", f"{self.started_at} is after the report's "
                                                    f"time {self.time}")
        if self.planned is not None:
            _check_int("planned", self.planned, MAX_SAMPLES)
        if self.lineage is not None and not is_lineage(self.lineage):
            raise InvalidProgress("lineage", "expected 32 lowercase hex digits")

    @property
    def fresh(self) -> bool:
        """A peer that has done nothing in the run yet (at epoch 0, no samples at all): a
        newcomer, or a peer of a run that has not started. Its epoch is no evidence of where the
        run is."""
        return self.epoch == 0 and self.total_samples == 0 and self.samples_accumulated == 0

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
            "lineage": self.lineage,
            "planned": self.planned,
            "stepped": self.stepped,
            "served": self.served,
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
                   started_at=payload.get("started_at"),
                   lineage=payload.get("lineage"),
                   planned=payload.get("planned"),
                   stepped=payload.get("stepped", False),
                   served=payload.get("served", 0))


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


