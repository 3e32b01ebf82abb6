"""What an all-reduce round tells its caller: what was averaged, what failed and why, the traffic."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import timebase


@dataclass(frozen=True)
class PeerTransfer:
    """Payload bytes exchanged with one peer, and the seconds from the first to the last of them
    (for bandwidth estimation)."""

    bytes_sent: int
    bytes_received: int
    seconds: float


@dataclass(frozen=True)
class PartFailure:
    """Elements [start, end) of the part that `reducer` reduces were not averaged here: they keep
    this member's local values."""

    start: int
    end: int
    reducer: str
    reason: str


@dataclass(frozen=True)
class AllReduceReport:
    """One member's view of one round. `parts_reduced` and `failed_parts` are merged element
    ranges of this member's vector (an aux member only counts its own part; every other member
    counts the whole vector); `failures` says, per reducer, which ranges failed and why;
    `senders_excluded` maps the peer id of every sender this member's reducer left out (from the
    chunks it had not delivered) to the reason; `senders_rejected` maps those of them whose
    contribution was rejected (an offence, screening.py) to the kind of offence;
    `contributions_clipped`: the contributions this member's reducer scaled down (aggregation.py:
    one per sender and chunk)."""

    group_id: str
    seconds: float
    bytes_sent: int
    bytes_received: int
    transfers: dict[str, PeerTransfer]
    parts_reduced: tuple[tuple[int, int], ...]
    failed_parts: tuple[tuple[int, int], ...]
    failures: tuple[PartFailure, ...]
    senders_excluded: dict[str, str]
    senders_rejected: dict[str, str] = field(default_factory=dict)
    contributions_clipped: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed_parts

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id, "seconds": round(self.seconds, 6),
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "transfers": {peer: {"bytes_sent": t.bytes_sent, "bytes_received": t.bytes_received,
                                 "seconds": round(t.seconds, 6)} for peer, t in self.transfers.items()},
            "parts_reduced": [list(r) for r in self.parts_reduced],
            "failed_parts": [list(r) for r in self.failed_parts],
            "failures": [{"start": f.start, "end": f.end, "reducer": f.reducer, "reason": f.reason}
                         for f in self.failures],
            "senders_excluded": dict(self.senders_excluded),
            "senders_rejected": dict(self.senders_rejected),
            "contributions_clipped": self.contributions_clipped,
        }


@dataclass(frozen=True)
class AveragingReport:
    """One round as `Averager.average` reports it to its caller: the group (`members` in order,
    `shares` of the vector each reduces), how many members are `trainers` (every role but aux:
    the members that step on a gradient round) and `senders` (members that sent a vector), this
    peer's `part`, the timings, the traffic, and what failed (`failed_parts`: element ranges left
    at the local value; `senders_excluded` and `senders_rejected`: peer id -> why). `weight` is
    the total weight of the senders whose vectors were averaged, `represented` the trainers they
    stand for (`Member.represents`); a grid round's report (collab/grid.py) sums its `stages`."""

    key: str
    group_id: str
    members: tuple[str, ...]
    trainers: int
    senders: int
    part: tuple[int, int]
    shares: tuple[int, ...]
    seconds: float
    matchmaking_seconds: float
    allreduce_seconds: float
    bytes_sent: int
    bytes_received: int
    failed_parts: tuple[tuple[int, int], ...]
    senders_excluded: dict[str, str]
    senders_rejected: dict[str, str]
    finished_at: float
    weight: float = 0.0
    represented: int = 0
    stages: int = 1
    # how this peer's own vector went out (error feedback recomputes what the codec conveyed):
    # the parts and the chunk size of its all-reduce; chunk_elements 0: it was sent to nobody
    part_bounds: tuple[tuple[int, int], ...] = ()
    chunk_elements: int = 0
    compression: str = "none"  # ... and the codec it went out in
    aggregation: str = "mean"  # the group's rule (aggregation.py; a reducer's centered clipping aside)
    contributions_clipped: int = 0  # by this peer's reducer (AllReduceReport)

    @property
    def group_size(self) -> int:
        return len(self.members)

    @property
    def ok(self) -> bool:
        return not self.failed_parts

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key, "group_id": self.group_id, "group_size": self.group_size,
            "trainers": self.trainers, "senders": self.senders, "members": list(self.members),
            "part": list(self.part), "shares": list(self.shares), "seconds": self.seconds,
            "matchmaking_seconds": self.matchmaking_seconds,
            "allreduce_seconds": self.allreduce_seconds, "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "failed_parts": [list(p) for p in self.failed_parts],
            "senders_excluded": dict(self.senders_excluded),
            "senders_rejected": dict(self.senders_rejected), "finished_at": self.finished_at,
            "weight": self.weight, "represented": self.represented, "stages": self.stages,
            "aggregation": self.aggregation, "contributions_clipped": self.contributions_clipped,
        }


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, non-empty, adjacent or overlapping ranges joined."""
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((a, b) for a, b in merged)


@dataclass
class _Traffic:
    sent: int = 0
    received: int = 0
    first: float | None = None
    last: float = 0.0


@dataclass
class TransferLog:
    """Counts payload bytes per peer as they go (event loop only)."""

    peers: dict[str, _Traffic] = field(default_factory=dict)

    def _touch(self, peer_id: str) -> _Traffic:
        traffic = self.peers.setdefault(peer_id, _Traffic())
        now = timebase.monotonic()
        if traffic.first is None:
            traffic.first = now
        traffic.last = now
        return traffic

    def start(self, peer_id: str) -> None:
        self._touch(peer_id)

    def sent(self, peer_id: str, count: int) -> None:
        self._touch(peer_id).sent += count

    def received(self, peer_id: str, count: int) -> None:
        self._touch(peer_id).received += count

    def summary(self) -> dict[str, PeerTransfer]:
        return {peer: PeerTransfer(t.sent, t.received, t.last - (t.first or t.last))
                for peer, t in self.peers.items()}


def build_report(group_id: str, seconds: float,
                 outcomes: dict[str, list[tuple[tuple[int, int], bool, str]]], traffic: TransferLog,
                 excluded: dict[str, str], rejected: Mapping[str, str] | None = None,
                 clipped: int = 0) -> AllReduceReport:
    """The report from each reducer's chunks: (element range, averaged?, why not) in order."""
    reduced: list[tuple[int, int]] = []
    failures: list[PartFailure] = []
    for reducer, chunks in outcomes.items():
        for (start, end), ok, reason in chunks:
            if ok:
                reduced.append((start, end))
            elif failures and failures[-1].reducer == reducer and failures[-1].reason == reason \
                    and failures[-1].end == start:
                failures[-1] = PartFailure(failures[-1].start, end, reducer, reason)
            else:
                failures.append(PartFailure(start, end, reducer, reason))
    transfers = traffic.summary()
    return AllReduceReport(
        group_id=group_id, seconds=seconds,
        bytes_sent=sum(t.bytes_sent for t in transfers.values()),
        bytes_received=sum(t.bytes_received for t in transfers.values()),
        transfers=transfers, parts_reduced=merge_ranges(reduced),
        failed_parts=merge_ranges((f.start, f.end) for f in failures), failures=tuple(failures),
        senders_excluded=excluded, senders_rejected=dict(rejected or {}),
        contributions_clipped=clipped)
