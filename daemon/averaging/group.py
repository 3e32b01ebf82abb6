"""What every member of an averaging round agrees on: the group, its order, and who reduces what.

Matchmaking produces a `Group` (the leader assembles it and sends the same one to every member);
load balancing fills `part_bounds`; the all-reduce reads it. Pure data, JSON-able both ways.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .aggregation import Aggregation, check_aggregation

Role = Literal["trainer", "aux", "client"]
ROLES: tuple[Role, ...] = ("trainer", "aux", "client")
MAX_REPRESENTS = 1 << 16  # trainers one member's vector may stand for (a grid round's stage)
# the longest group id a leader may send (ours: 64 hex digits; followers remember thousands)
MAX_GROUP_ID = 128


@dataclass(frozen=True)
class Member:
    """One member of a round, as it announced itself.

    role: "trainer" sends its vector and may reduce; "aux" reduces but sends nothing (weight 0);
    "client" sends but never reduces (nobody can dial it). Bandwidths are bytes per second,
    measured from past transfers (or the configured guess). `represents`: how many trainers'
    contributions the member's vector already averages (1, but more in the later stages of a
    grid round, collab/grid.py); at most `MAX_REPRESENTS`.
    """

    peer_id: str
    role: Role
    weight: float
    upload: float
    download: float
    reachable: bool = True
    represents: int = 1

    @property
    def sends(self) -> bool:
        return self.role != "aux" and self.weight > 0

    @property
    def can_reduce(self) -> bool:
        return self.role != "client" and self.reachable

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Member:
        role = data["role"]
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        weight, upload, download = float(data["weight"]), float(data["upload"]), float(data["download"])
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"a member's weight must be finite and not negative, not {weight}")
        if not (math.isfinite(upload) and math.isfinite(download) and upload > 0 and download > 0):
            raise ValueError("a member's bandwidths must be finite and positive")
        represents = data.get("represents", 1)
        if not isinstance(represents, int) or isinstance(represents, bool) \
                or not 0 <= represents <= MAX_REPRESENTS:
            raise ValueError(f"a member represents 0 to {MAX_REPRESENTS} trainers, not {represents!r}")
        return cls(str(data["peer_id"]), role, weight, upload, download,
                   bool(data.get("reachable", True)), represents)


@dataclass(frozen=True)
class Group:
    """One averaging round's group. `part_bounds[i]` is the half-open element range that member i
    reduces (empty when it reduces nothing); the ranges tile [0, size) in member order and are
    multiples of `chunk_elements` except at the end of the vector. `aggregation`: how its
    reducers combine a chunk's contributions (aggregation.py), which its members check."""

    group_id: str
    key: str
    members: tuple[Member, ...]
    size: int
    part_bounds: tuple[tuple[int, int], ...]
    chunk_elements: int
    compression: str
    deadline: float  # unix time by which the round is over, success or not
    aggregation: Aggregation = "mean"
    # who sent it and its signature of the group (signatures.sign_group), which every chunk and
    # answer of ours carries: proof, should the leader sign another group under this id. Not
    # part of the group's JSON (the signature travels beside it) nor of its round's name.
    leader: str = ""
    leader_signature: str = ""

    def index_of(self, peer_id: str) -> int:
        for index, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return index
        raise KeyError(f"{peer_id} is not a member of group {self.group_id}")

    def bounded_weights(self, budget: float | None, max_represents: int = 1) -> tuple[float, ...]:
        """The weight each member's vector is averaged with: its claim, but a sender at most its
        share of `budget` by the trainers it stands for (`Member.represents`, counted at most
        `max_represents`: what the round allows, alike for its members; a member's own count is
        its word) among those the group's senders stand for. A run's gradient rounds give
        WEIGHT_BUDGET epochs' samples (its manifest's: the same on every peer), so every member
        computes the same from the group, whatever it believes of the run: an identity claiming
        samples it never computed weighs at most budget / (n + 1) beside n honest senders of a
        flat round, and an honest sender that did more than its share is leaned on less, never
        refused. None: each as claimed."""
        if budget is None:
            return tuple(m.weight for m in self.members)
        counts = [max(1, min(m.represents, max_represents)) for m in self.members]
        stand_for = sum(c for m, c in zip(self.members, counts, strict=True) if m.sends)
        return tuple(min(m.weight, budget * c / stand_for) if m.sends else m.weight
                     for m, c in zip(self.members, counts, strict=True))

    def averaged(self, excluded: Collection[str] = (), max_represents: int = 1,
                 weights: Sequence[float] | None = None) -> tuple[float, int]:
        """The total weight (`weights`: the members' claims unless given) of the senders whose
        vectors were averaged (all but `excluded`) and how many trainers they stand for, each
        member's claim (`Member.represents`) counted at most `max_represents` (what the caller
        knows a member of this round can stand for)."""
        weights = [m.weight for m in self.members] if weights is None else weights
        averaged = [(m, w) for m, w in zip(self.members, weights, strict=True)
                    if m.sends and m.peer_id not in excluded]
        return (float(sum(w for _, w in averaged)),
                sum(min(m.represents, max_represents) for m, _ in averaged))

    def to_json(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "key": self.key,
                "members": [m.to_json() for m in self.members], "size": self.size,
                "part_bounds": [list(b) for b in self.part_bounds],
                "chunk_elements": self.chunk_elements, "compression": self.compression,
                "deadline": self.deadline, "aggregation": self.aggregation}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Group:
        members = tuple(Member.from_json(m) for m in data["members"])
        bounds = tuple((int(a), int(b)) for a, b in data["part_bounds"])
        group_id = data["group_id"]
        if not isinstance(group_id, str) or not 0 < len(group_id) <= MAX_GROUP_ID:
            raise ValueError(f"a group id is a string of 1 to {MAX_GROUP_ID} characters")
        group = cls(group_id, str(data["key"]), members, int(data["size"]), bounds,
                    int(data["chunk_elements"]), str(data["compression"]), float(data["deadline"]),
                    # (a leader of an earlier version names none: it averages by the mean)
                    check_aggregation(data.get("aggregation", "mean")))
        group.check()
        return group

    def check(self) -> None:
        """ValueError unless the bounds tile the vector, one range per member, and only members
        that can reduce have a part (a group of one keeps the whole vector: nothing moves)."""
        if len(self.part_bounds) != len(self.members):
            raise ValueError("one part range per member is required")
        position = 0
        for (start, end), member in zip(self.part_bounds, self.members, strict=True):
            if start != position or end < start:
                raise ValueError(f"part ranges must tile [0, {self.size}) in member order")
            if end > start and not member.can_reduce and len(self.members) > 1:
                raise ValueError(f"{member.peer_id} cannot reduce but was given a part")
            position = end
        if position != self.size:
            raise ValueError(f"part ranges cover {position} of {self.size} elements")
        if self.chunk_elements <= 0:
            raise ValueError("chunk_elements must be positive")
