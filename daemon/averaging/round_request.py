"""What one peer asks of a round (`RoundRequest`), and what it checks of the group a leader
sends for it (`group_refusal`): the round's terms that matchmaking (matchmaking.py) negotiates.

Also the pure rules both sides of matchmaking compute alike: the order in which peers are asked
to lead a key (`ranked`), how long a round may gather and settle (`ack_seconds`, `grace`,
`latest_after`), and how an announcement read from the DHT becomes a candidate (`member_from`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from ..net import PeerAddress
from .accounts import MAX_ACCOUNT_SENDERS
from .aggregation import Aggregation
from .claims import share_refusal
from .group import Group, Member

__all__ = [
    "EXTEND_WINDOWS",
    "JOIN_ACK_SECONDS",
    "MAX_ADDRESSES",
    "MAX_GROUP_MEMBERS",
    "RoundRequest",
    "ack_seconds",
    "grace",
    "group_refusal",
    "latest_after",
    "member_from",
    "ranked",
]

# the most members a group may list: as many as an answer's account (accounts.py) can name in
# the header a frame carries (a leader set larger gathers no more)
MAX_GROUP_MEMBERS = MAX_ACCOUNT_SENDERS
JOIN_ACK_SECONDS = 3.0  # at most this long for a leader to acknowledge a join, else it is skipped
MAX_ADDRESSES = 8  # addresses an announcement gives, at most
MAX_ADDRESS_CHARS = 512
EXTEND_WINDOWS = 4  # gathering lasts at most this many windows while too few trainers are seen


@dataclass(frozen=True)
class RoundRequest:
    """One peer's wish to average under `key`."""

    key: str
    member: Member
    size: int  # float32 elements
    chunk_elements: int
    compression: str
    window: float  # seconds to gather peers
    deadline: float  # unix time by which the whole round ends
    expected: int | None = None  # stop gathering once this many peers (with us) are seen
    max_group_size: int = 64
    # Fewer trainers than this make a useless round: gathering goes on past the window for them
    # (up to `EXTEND_WINDOWS` windows, within the deadline) instead of forming a group that
    # will not be stepped on (a peer that is late on a loaded machine still makes it).
    min_trainers: int = 1
    # The peers the caller expects in the round (a run's engine knows them from the progress
    # board): with them, matchmaking needs no DHT at all (see the module docstring).
    peers: tuple[str, ...] = ()
    # Who may lead, in the caller's words: the members of the round that made the run's head
    # (they all know the same list, while views of who is at the head differ a little); the
    # others of `peers` come after them.
    leaders: tuple[str, ...] = ()
    # The most weight any member may claim (None: no bound): what an honest peer of the round
    # can have (a run's target batch). A leader refuses a joiner that claims more, a follower a
    # group that lists one (weight 1e15 with a normal vector made the average that vector).
    max_weight: float | None = None
    # A stage of a grid round (with `peers`): members may be on their way from an earlier stage,
    # and the leader asks the missing ones whether they come (see the module docstring); other
    # direct rounds close at their window as before.
    staged: bool = False
    # How the group's reducers combine contributions (aggregation.py); the members check it. A
    # peer of an earlier version states none: it averages by the mean.
    aggregation: Aggregation = "mean"

    def compatible(self, other: dict[str, Any]) -> bool:
        return (other.get("size") == self.size and other.get("compression") == self.compression
                and other.get("chunk_elements") == self.chunk_elements
                and other.get("aggregation", "mean") == self.aggregation)



def ranked(key: str, peers: Iterable[str]) -> list[str]:
    """Peers in the order they are asked to lead a round of `key`: by a hash of the key and the
    peer id, so that every peer that sees the same candidates picks the same leader, and no peer
    can choose an id that makes it lead (the key holds the run's lineage, unknown in advance)."""
    return sorted(set(peers), key=lambda peer: hashlib.sha256(f"{key}\0{peer}".encode()).digest())


def ack_seconds(request: RoundRequest) -> float:
    return min(JOIN_ACK_SECONDS, max(0.5, 0.5 * request.window))


def group_refusal(group: Group, request: RoundRequest, now: float) -> str | None:
    """Why a follower refuses the group its leader sent (None: it takes it). A leader is just
    another peer: its group must be the round the follower asked for (vector, chunking,
    compression, and aggregation: the rule the answers are checked against), hold the follower
    as it joined (its weight, role and links unchanged: a leader that rewrote them would get
    honest members banned for a stream that does not match), name each member once, fit the
    size asked for, and end no later than twice the time the follower was prepared to give the
    round (a deadline of 1e308 would freeze it), and give no member more of the vector than the
    public rule on bandwidth claims allows (claims.py: at most SHARE_MULTIPLE equal shares, one
    chunk more for rounding), which every honest leader's split keeps by construction."""
    if (group.size, group.chunk_elements, group.compression, group.aggregation) != (
            request.size, request.chunk_elements, request.compression, request.aggregation):
        return (f"it averages {group.size} elements in chunks of {group.chunk_elements} with "
                f"{group.compression!r} by {group.aggregation!r}, not what was asked")
    ids = [m.peer_id for m in group.members]
    if len(set(ids)) != len(ids):
        return "it names a member twice"
    if len(ids) > MAX_GROUP_MEMBERS:  # (not our own max_group_size: leaders may be set larger)
        return f"{len(ids)} members, more than any group holds ({MAX_GROUP_MEMBERS})"
    heaviest = max(m.weight for m in group.members)
    if request.max_weight is not None and heaviest > request.max_weight:
        return f"a member claims a weight of {heaviest:g}, more than the round's {request.max_weight:g}"
    mine = next(m for m in group.members if m.peer_id == request.member.peer_id)
    if mine != request.member:
        return "it changed this peer's own entry (weight, role or bandwidth)"
    if not now < group.deadline <= request.deadline + max(0.0, request.deadline - now):
        return f"its deadline is {group.deadline - now:.3g} s away, out of bounds"
    return share_refusal(group)


def latest_after(request: RoundRequest) -> float:
    """How long after its start a direct round may gather at most (for peers on their way)."""
    return EXTEND_WINDOWS * request.window + grace(request)


def grace(request: RoundRequest) -> float:
    """How long after the window settling may take: room to skip two silent leaders."""
    return max(0.5, 0.25 * request.window) + 2 * ack_seconds(request)


def member_from(value: bytes, sub_key: str, request: RoundRequest
                 ) -> tuple[Member, list[PeerAddress]] | None:
    """An announcement's member and the addresses it gives (at most MAX_ADDRESSES, each one
    parsed; malformed ones are left out)."""
    try:
        info = orjson.loads(value)
        member = Member.from_json(info)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if member.peer_id != sub_key or not request.compatible(info):
        return None
    addresses: list[PeerAddress] = []
    raw = info.get("addresses")
    for text in raw[:MAX_ADDRESSES] if isinstance(raw, list) else ():
        if isinstance(text, str) and len(text) <= MAX_ADDRESS_CHARS:
            try:
                address = PeerAddress.parse(text)
            except ValueError:
                continue
            if address.target in (None, sub_key):
                addresses.append(address)
    return member, addresses
