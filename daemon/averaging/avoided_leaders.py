"""Leaders whose rounds failed this peer, ranked last for a while (the hostage attack). Pure: time
is passed in.

A leader that gathers a follower and then withholds what it owes it (the answers for its own
part, its contribution, or the group itself) proves nothing against itself in a group of two:
a withheld answer is no offence, since honest reducers fail parts too. Before, the follower
joined it again round after round, as it ranked first for the round's key, while the peers that
had banned it for something else formed their own group without the follower; and as the quorum
still counts banned peers, that group could lack a majority, and the run stalled
(docs/security.md).

A leader that behaves well in a group too small to be stepped on holds its follower as surely.
So a follower counts, per leader, the rounds in a row that leader failed it (`leader_failed_us`
below: its own part, its contribution, a group too small; and matchmaking's "accepted our join
and sent no group we could take"). After `FAILURES_TO_AVOID` in a row the leader is *avoided*:
this peer's matchmaking ranks it after every other candidate, for `avoid_seconds`, doubling
each time it is avoided again without a good round in between (at most `max_avoid_seconds`).
A good round it led forgets its count.

An avoided leader is not refused. A candidate that follows it sends us to it (a redirect) and we
go: that keeps an honest leader's group whole where only our link to it failed twice. A hostile
identity can use that to send us back to an avoided accomplice, so a round that fails us counts
against the candidates whose redirects brought us back to a leader we avoid as well
(matchmaking.py). The avoidance ends early only where we then led, and nobody came: the others
follow that leader. (Alone for any other reason, a candidate that took our join and stalled,
say, it goes on: an identity ranked after an avoided accomplice could otherwise end the
avoidance at will.) What the rule cannot tell apart: an honest leader whose part fails every
follower twice in a row (an overloaded machine) is avoided by all of them, and leads alone
until the avoidance runs out.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .group import Group
from .report import AllReduceReport

__all__ = ["FAILURES_TO_AVOID", "MAX_REMEMBERED", "AvoidedLeaders", "leader_failed_us"]

FAILURES_TO_AVOID = 2  # rounds in a row a leader failed us before we avoid it
MAX_REMEMBERED = 1024  # leaders whose failures are remembered (identities are free)
INTRODUCED_GROUPS = 64  # groups whose leader we were redirected to, remembered until judged
MAX_CHAIN = 8  # redirects followed back from a group's leader to those that sent us there


@dataclass
class AvoidedLeaders:
    """Which leaders this peer's matchmaking ranks last now, and since when."""

    avoid_seconds: float = 120.0
    max_avoid_seconds: float = 1800.0
    times_avoided: int = 0  # leaders that became avoided (counted each time)
    # of each leader: failures in a row, times avoided in a row, avoided until (unix seconds)
    _failures: collections.OrderedDict[str, int] = field(default_factory=collections.OrderedDict)
    _avoidances: dict[str, int] = field(default_factory=dict)
    _until: dict[str, float] = field(default_factory=dict)
    # per group we followed: the candidates that sent us back to its (avoided) leader
    _introducers: collections.OrderedDict[str, tuple[str, ...]] = field(
        default_factory=collections.OrderedDict)

    def note_introducers(self, group: Group, sent_by: dict[str, str], own_id: str) -> None:
        """Remember who redirected us to `group`'s leader (and to theirs; `sent_by`: a leader we
        were redirected to -> who sent us there): a round of it that fails us counts against
        them too (`group_failed`)."""
        chain: list[str] = []
        peer = group.leader
        while peer in sent_by and len(chain) < MAX_CHAIN:
            peer = sent_by[peer]
            if peer == own_id or peer == group.leader or peer in chain:
                break
            chain.append(peer)
        if chain:
            self._introducers[group.group_id] = tuple(chain)
            while len(self._introducers) > INTRODUCED_GROUPS:
                self._introducers.popitem(last=False)

    def group_failed(self, group: Group, now: float) -> list[str]:
        """`group`'s leader failed us (`leader_failed_us`), and so did the candidates that sent
        us to it; returns those this makes avoided now."""
        blamed = (group.leader, *self._introducers.pop(group.group_id, ()))
        return [p for p in blamed if p and self.failed(p, now)]

    def group_served(self, group: Group) -> None:
        """The round `group`'s leader led went through for us: it and those that sent us to it
        are forgiven their failures."""
        for peer in (group.leader, *self._introducers.pop(group.group_id, ())):
            if peer:
                self.served(peer)

    def failed(self, leader: str, now: float) -> bool:
        """A round `leader` led (or sent us to) failed us; True if that makes it avoided now."""
        count = self._failures.pop(leader, 0) + 1
        self._failures[leader] = count  # (moved last: the most recently failing are kept)
        while len(self._failures) > MAX_REMEMBERED:
            old, _ = self._failures.popitem(last=False)
            self._avoidances.pop(old, None)
            self._until.pop(old, None)
        if count < FAILURES_TO_AVOID or self._until.get(leader, float("-inf")) > now:
            return False
        times = self._avoidances.get(leader, 0)
        self._avoidances[leader] = times + 1
        self._until[leader] = now + min(self.max_avoid_seconds,
                                        self.avoid_seconds * 2.0 ** min(times, 30))
        # once the time is over, one more failure avoids it again (for twice as long)
        self._failures[leader] = FAILURES_TO_AVOID - 1
        self.times_avoided += 1
        return True

    def served(self, leader: str) -> None:
        """A round `leader` led went through for us: its failures are forgotten."""
        self._failures.pop(leader, None)
        self._avoidances.pop(leader, None)
        self._until.pop(leader, None)

    def forgive(self, leader: str) -> None:
        """End `leader`'s avoidance now (the others follow it: see matchmaking.py); its next
        failure avoids it again, for twice as long as the last time."""
        if leader in self._until:
            self._until[leader] = float("-inf")

    def until(self, leader: str) -> float:
        """When `leader`'s avoidance ends (or ended; -inf: never avoided)."""
        return self._until.get(leader, float("-inf"))

    def avoided(self, now: float) -> frozenset[str]:
        """The leaders ranked last now."""
        return frozenset(p for p, until in self._until.items() if until > now)

    def ranked(self, order: list[str], now: float) -> list[str]:
        """`order` with the avoided leaders moved to its end (each part in its order)."""
        avoided = self.avoided(now)
        if not avoided:
            return order
        return [p for p in order if p not in avoided] + [p for p in order if p in avoided]


def leader_failed_us(group: Group, report: AllReduceReport, min_trainers: int = 1) -> bool:
    """Whether the leader of `group` failed this member in the round `report` tells of: the
    answers for its own part did not come (or did not pass), its contribution to our part never
    reached our reducer, or it closed a group of just itself and us, fewer trainers than the
    round needs to be stepped on (`min_trainers`: a hostile leader that behaves well in a group
    of two that never steps holds its follower as surely; a larger group too small is counted
    against nobody, or every member of an honest leader's group, late peers missing, would
    avoid it at once). Another member's failure is not the leader's."""
    if not group.leader or group.leader not in {m.peer_id for m in group.members}:
        return False
    if len(group.members) == 2 and sum(1 for m in group.members if m.role != "aux") < min_trainers:
        return True  # (the hostage's shape: in a larger group, every follower would blame it)
    if any(f.reducer == group.leader for f in report.failures):
        return True
    return group.members[group.index_of(group.leader)].sends \
        and group.leader in report.senders_excluded
