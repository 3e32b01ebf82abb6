"""What one peer's matchmaking (matchmaking.py) holds between its rounds and the calls it answers:
the rounds it is forming or joining now (a `Gathering` per key), the keys it will gather under
soon, and the group ids it has taken.

Stages of a grid round. A peer registers the keys of its stages while its own stages run
(`coming`), or the prefix of a round whose stages it does not know yet (`coming_under`: it is
still agreeing on the round's roster); a key is struck off when its gathering begins. The peers
of its slice that reach a stage first then learn that it is on its way (matchmaking_methods.py)
and wait for it.

Rounds over. Once a peer has moved past a round's head (a step, a state round or a download moved
its head on), it does not gather under that round's keys again; it remembers the round's key
prefix (`over`, the newest `OVER_ROUNDS`), and answers a join under it with `RoundOver`. A peer
that comes late to a round (a newcomer that loaded the state just as the others averaged, a
helper whose slice's stage is done) then moves on at once instead of asking each leader it tries
again and again until its patience runs out (a newcomer of a 64-peer churn run sat 26 s in a
stage that had ended before it came, and fell two epochs behind).

Group ids taken (ours and leaders'): a group under an id seen before is refused, so no round's
signatures can be shown again in another (signatures.py). Each is remembered with the leader
that sent it first: a leader that sends an id another leader sent first may be honest, beaten to
it by a member of its round that copied the id; refused, but no offence of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .group import Group, Member
from .round_request import RoundRequest

SEEN_GROUPS = 8192  # group ids remembered, to refuse one used again
OVER_ROUNDS = 64  # key prefixes of rounds over, remembered to answer late joins at once


@dataclass
class Gathering:
    """A round this peer is forming (as leader) or joining (as follower)."""

    request: RoundRequest
    leader: str | None = None  # None while undecided, our own id when leading
    joiners: dict[str, Member] = field(default_factory=dict)
    group: asyncio.Future[Group] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    redirect: asyncio.Future[str] | None = None  # while joining a leader: where it sends us instead
    accepted: bool = False  # the leader we follow has taken our join
    # peers whose join we refused (banned, too heavy, another vector): not waited for as leader
    refused: set[str] = field(default_factory=set)
    stalled: bool = False  # a leader took our join and sent no group we could take
    give_up: float = 0.0  # when settling ends (moved later, up to `latest`, for a peer on its way)
    latest: float = 0.0

    def refuse(self, peer_id: str) -> None:
        """Stop waiting for `peer_id` (its join was refused): the group may close without it."""
        self.refused.add(peer_id)
        self.joined.set()


class Gatherings:
    """The rounds this peer is forming or joining, by key; those it will soon; the group ids taken."""

    def __init__(self) -> None:
        self._rounds: dict[str, Gathering] = {}
        self._coming: set[str] = set()  # keys we will gather under soon (see `coming`)
        self._coming_under: dict[str, int] = {}  # ... and key prefixes (see `coming_under`)
        self._seen_groups: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._over: collections.OrderedDict[str, None] = collections.OrderedDict()

    def get(self, key: str) -> Gathering | None:
        """The round being formed here under `key`, if any."""
        return self._rounds.get(key)

    def begin(self, request: RoundRequest) -> Gathering:
        """A round under `request.key` is being formed here from now on (its key struck off those
        we will gather under soon)."""
        gathering = Gathering(request)
        self._rounds[request.key] = gathering
        self._coming.discard(request.key)
        for prefix in [p for p in self._over if _under(request.key, p)]:
            del self._over[prefix]  # (an aux peer that saw the run's head go back: not over)
        return gathering

    def end(self, key: str) -> None:
        """The round under `key` is no longer being formed here."""
        self._rounds.pop(key, None)

    @contextlib.contextmanager
    def coming(self, keys: Iterable[str]) -> Iterator[None]:
        """While inside: this peer will gather under `keys`; a key is struck off when its
        gathering begins."""
        added = {k for k in keys if k not in self._coming and k not in self._rounds}
        self._coming |= added
        try:
            yield
        finally:
            self._coming -= added

    @contextlib.contextmanager
    def coming_under(self, prefix: str) -> Iterator[None]:
        """While inside: this peer will gather under some key that starts with `prefix`."""
        self._coming_under[prefix] = self._coming_under.get(prefix, 0) + 1
        try:
            yield
        finally:
            left = self._coming_under[prefix] - 1
            if left:
                self._coming_under[prefix] = left
            else:
                del self._coming_under[prefix]

    def will_gather(self, key: str) -> bool:
        """Whether this peer will gather under `key` soon (`coming`, `coming_under`)."""
        return key in self._coming or any(key.startswith(p) for p in self._coming_under)

    def over(self, prefix: str) -> None:
        """This peer has moved past the round under `prefix` and its keys below it
        (`prefix/...`): joins there are answered `RoundOver` until a gathering under one of
        them begins here again (an aux peer that saw the run's head go back), unless this peer
        says it will gather there soon (`coming`: that answer comes first). The oldest of
        `OVER_ROUNDS` is forgotten first."""
        self._over[prefix] = None
        self._over.move_to_end(prefix)
        while len(self._over) > OVER_ROUNDS:
            self._over.popitem(last=False)

    def is_over(self, key: str) -> bool:
        """Whether the round `key` belongs to is over here (`over`)."""
        return any(_under(key, prefix) for prefix in self._over)

    def first_leader(self, group_id: str) -> str | None:
        """The leader that sent `group_id` first (ourselves, for a group we led), if it was taken."""
        return self._seen_groups.get(group_id)

    def seen(self, group_id: str, leader: str) -> None:
        """`leader` sent `group_id` (or we assembled it): remember it, the oldest forgotten first."""
        if group_id in self._seen_groups:  # (its first leader stays; sent again, it stays old)
            return
        self._seen_groups[group_id] = leader
        while len(self._seen_groups) > SEEN_GROUPS:
            self._seen_groups.popitem(last=False)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")
