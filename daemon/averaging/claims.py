"""Bandwidth claims, bounded: what the load balancer and the stall allowances may believe.

A member's `upload`/`download` in a group is its own claim; nothing in the protocol proves it.
Believed as is, a claim of 1e12 B/s won most of the vector to reduce (the LP gives a peer
(n − 1) times faster than the others all of it), and one of 1 B/s made a reducer wait hours for
that sender (`stall_allowance`). So every figure goes through two rules.

The public rule (every member computes it from the group alone, so a follower can check a
leader's group against it, `share_refusal`):
- a member's figure is its narrower link, clamped to [MIN_BANDWIDTH, MAX_BANDWIDTH] and then to
  [median / SPREAD, median · SPREAD], the median over the group's figures (`bounded_figures`):
  a minority cannot move it far;
- no member reduces more than SHARE_MULTIPLE equal shares: min(1, SHARE_MULTIPLE / r) of the
  vector with r members that can reduce (`share_caps`); the load balancer's LP takes these caps
  as bounds, so an honest leader's split keeps them by construction, and a follower allows one
  chunk more for the rounding to whole chunks.

The leader's rule (`leader_plan`), on top, from what it measured itself (bandwidth.PeerRates).
Each member has a typical figure: the median of the other members' figures (its own claim does
not move it), what its peers claim for themselves.
- a member it has never measured counts for at most its typical figure and reduces at most one
  equal share;
- a member it has measured counts for at most that rate (what its all-reduce transfers showed:
  the member's modelled load over the time they took), put on the scale of the claims
  (`_evidence_scale`: honest claims read lower than a leader's measurements, and a liar must win
  nothing over an honest member measured alike), but never for less than its typical figure:
  evidence backs a claim above the typical figure, it does not cut one below it. A rate is
  measured over a round whose time includes waiting for its slowest member, so in a round that
  latency or a busy CPU paces it reads the load the leader gave the member, not its link. Cut
  below the typical figure by such rates, honest members lost their parts: the leader, counted
  for its own claim, took the two equal shares its cap allows, and the others split the rest by
  the parts they had been given (a smaller part read slower and got a smaller part, down to
  none: a member that reduces nothing screens nothing). A member slower than its peers still
  gets a smaller part from its own claim, which is its own measurement;
- its own figure is its own measurement (what it claims).
Followers cannot check the leader's evidence; they check the public caps, which the leader's rule
never exceeds (it only lowers figures and caps).

Stall allowances (`stall_allowance`) use the public figure, and never less than
ALLOWANCE_FLOOR_RATE (32 KiB/s, the floor state downloads have), so a claimed 1 B/s buys at
most what a member SPREAD times slower than the group's median would get.

None of this changes what is averaged: the parts only decide who adds which elements.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from .group import Group, Member

__all__ = [
    "ALLOWANCE_FLOOR_RATE",
    "MAX_BANDWIDTH",
    "MIN_BANDWIDTH",
    "OVERCLAIM_FACTOR",
    "SHARE_MULTIPLE",
    "SPREAD",
    "LeaderPlan",
    "bounded_figures",
    "leader_plan",
    "narrower_link",
    "share_caps",
    "share_refusal",
    "stall_allowance",
]

MIN_BANDWIDTH = 1e3  # bytes/s; what a zero, negative or unknown bandwidth counts as
MAX_BANDWIDTH = 1e12  # bytes/s; what an infinite or absurd bandwidth counts as
SPREAD = 8.0  # a figure counts for at most this many times the group's median, at least 1/SPREAD
SHARE_MULTIPLE = 2.0  # no member reduces more than this many equal shares
OVERCLAIM_FACTOR = 8.0  # a claim this many times over the measured rate is counted (an overclaim)
ALLOWANCE_FLOOR_RATE = 32 * 1024.0  # bytes/s: the slowest rate a stall allowance is computed from
SOCKET_QUEUE_BYTES = 4 << 20  # what kernel socket buffers may hold ahead of a chunk
_SHARE_ROUNDING = 1e-9  # relative slack of a share against its cap (float sums)


def narrower_link(member: Member) -> float:
    """The member's narrower link, clamped to [MIN_BANDWIDTH, MAX_BANDWIDTH]."""
    links = []
    for value in (member.upload, member.download):
        if math.isnan(value) or value <= 0:
            value = MIN_BANDWIDTH
        links.append(min(max(value, MIN_BANDWIDTH), MAX_BANDWIDTH))
    return min(links)


def bounded_figures(members: Sequence[Member]) -> tuple[float, ...]:
    """Each member's figure in bytes/s under the public rule: its narrower link, clamped to the
    absolute bounds and to [median / SPREAD, median · SPREAD] of the group's links."""
    links = [narrower_link(m) for m in members]
    if not links:
        return ()
    median = statistics.median(links)
    return tuple(min(max(link, median / SPREAD), median * SPREAD) for link in links)


def share_caps(members: Sequence[Member]) -> tuple[float, ...]:
    """The most of the vector each member may reduce under the public rule: SHARE_MULTIPLE equal
    shares (at most all of it), 0 for those that cannot reduce."""
    reducers = sum(1 for m in members if m.can_reduce)
    cap = min(1.0, SHARE_MULTIPLE / reducers) if reducers else 0.0
    return tuple(cap if m.can_reduce else 0.0 for m in members)


def share_refusal(group: Group) -> str | None:
    """Why a group's parts break the public rule (None: they keep it): a part longer than its
    member's cap of the vector's chunks, plus one chunk for the rounding to whole chunks (the
    last chunk may be short, so the cap counts chunks, not elements)."""
    if len(group.members) < 2:
        return None
    chunks = math.ceil(group.size / group.chunk_elements)
    for member, cap, (start, end) in zip(group.members, share_caps(group.members),
                                         group.part_bounds, strict=True):
        allowed = (cap * chunks * (1.0 + _SHARE_ROUNDING) + 1) * group.chunk_elements
        if end - start > allowed:
            return (f"{member.peer_id[:12]} reduces {end - start} of {group.size} elements, more "
                    f"than {cap:.3g} of the vector (at most {SHARE_MULTIPLE:g} equal shares)")
    return None


def stall_allowance(group: Group, sender: int, stall_timeout: float) -> float:
    """How long a reducer waits for sender `sender`'s next chunk: the stall timeout, or more for
    a slow link (a sender feeds every reducer through one upload, and the chunks queued in its
    socket buffers drain at that rate), at the sender's bounded figure and never below
    ALLOWANCE_FLOOR_RATE."""
    rate = max(bounded_figures(group.members)[sender], ALLOWANCE_FLOOR_RATE)
    reducers = sum(1 for start, end in group.part_bounds if end > start)
    expected = (group.chunk_elements * 4 * reducers + SOCKET_QUEUE_BYTES) / rate
    return max(stall_timeout, 4 * expected)


@dataclasses.dataclass(frozen=True)
class LeaderPlan:
    """What the leader's load balancer is given: the members with their figures in place of
    their claims (upload = download = figure), each member's cap on its share, and counts of
    what was bounded (for the averager's counters)."""

    members: tuple[Member, ...]
    caps: tuple[float, ...]
    claims_bounded: int  # claims outside the public rule's range
    claims_cut: int  # figures lowered by this leader's evidence (or the lack of it)


def leader_plan(members: Sequence[Member], me: str, rates: Mapping[str, float]) -> LeaderPlan:
    """The leader's rule (module docstring): `rates` are the measured rates (bytes/s) this peer
    has of the others (bandwidth.PeerRates); `me` is the leader itself."""
    figures = bounded_figures(members)
    caps = share_caps(members)
    reducers = sum(1 for m in members if m.can_reduce)
    scale = _evidence_scale(members, figures, me, rates)
    planned: list[Member] = []
    planned_caps: list[float] = []
    bounded = cut = 0
    for index, (member, figure, cap) in enumerate(zip(members, figures, caps, strict=True)):
        if figure != min(member.upload, member.download):
            bounded += 1
        if member.peer_id != me:
            typical = _typical_figure(figures, index)
            measured = rates.get(member.peer_id)
            if measured is None:  # never measured: a typical member, at most an equal share
                limit = typical
                cap = min(cap, 1.0 / reducers) if member.can_reduce else cap
            else:  # evidence backs a figure above the typical one, never cuts below it
                limit = max(scale * measured, typical)
            if limit < figure:
                figure = max(limit, MIN_BANDWIDTH)
                cut += 1
        planned.append(dataclasses.replace(member, upload=figure, download=figure))
        planned_caps.append(cap)
    return LeaderPlan(tuple(planned), tuple(planned_caps), bounded, cut)


def _typical_figure(figures: Sequence[float], index: int) -> float:
    """The median of the figures of the members other than `index` (its own figure when it is
    alone): what its peers claim, which its own claim cannot move."""
    others = [*figures[:index], *figures[index + 1:]]
    return statistics.median(others) if others else figures[index]


def _evidence_scale(members: Sequence[Member], figures: Sequence[float], me: str,
                    rates: Mapping[str, float]) -> float:
    """What a measured rate counts for on the scale of the claims: the median over the measured
    members of figure / measured, at most 1. An honest peer's claim is its own moving average of
    its bytes over its rounds' whole time, which lags and reads lower than a leader's measurement
    of its transfers alone; without this, an honest peer counted for its claim and a liar for its
    (higher) measured rate, and the liar won a larger share for a claim over the evidence. The
    median stays with the honest members while they are most of those measured."""
    ratios = [min(1.0, figure / rate) for member, figure in zip(members, figures, strict=True)
              if member.peer_id != me and (rate := rates.get(member.peer_id)) is not None and rate > 0]
    return statistics.median(ratios) if ratios else 1.0
