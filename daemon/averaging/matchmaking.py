"""Matchmaking: the peers that want to average under one key form one group, within a window.

1. Each peer announces itself in the DHT: a sub-key of `averaging/<key>` named by its own peer id
   (only it can write that), holding its `Member` info, expiring when its window closes.
2. It reads the key until the window closes, or until it has seen `expected` peers
   (announcements.py).
3. The leader is the first reachable candidate in an order by a hash of the key and the peer id
   (`ranked`: the same for every peer that sees the same candidates, and not for sale by
   grinding peer ids, since the key is not known in advance). A follower asks the leader to
   let it join (`avg.join`, acknowledged at once, so a silent leader is skipped quickly); the
   leader waits for joins until its window closes, then sends the same `Group` to every member
   (`avg.group`; the leader's side: leading.py).
4. A peer asked to join while it follows someone else sends the joiner on to its leader, and
   one still undecided takes the join (the methods a peer answers: matchmaking_methods.py);
   if it then follows another leader after all (one its joiner had not seen), it redirects those
   it took there (`avg.redirect`), so that none waits for a group that never comes. A leader
   that does not answer, or that has already closed its group, is skipped for the next
   candidate while time remains; in the end a peer can always average alone (a group of one),
   so matchmaking never deadlocks and never waits past the window (a grid stage's round: past
   its latest gathering, see below).
5. A peer banned here (bans.py) counts towards `expected` but is no candidate: it is not taken as
   a leader, not waited for, and its join is refused.

Direct rounds. A caller that already knows who averages with it (a run's engine reads the peers
at the run's head from its progress board) passes them as `RoundRequest.peers`: steps 1 and 2 are
skipped, the candidates are those peers, and a follower whose leader has not begun its round yet
(`NotGathering`) asks again for a moment instead of moving on, unless the leader says it has
stepped past the round (`RoundOver`). No DHT traffic, and no wait for
announcements to spread: with a hundred peers, gathering through the DHT took most of a round.

Stages of a grid round (`RoundRequest.staged`). A peer registers the keys of its stages while
its own stages run (`coming`, gatherings.py). Its slice's peers that reach a stage first then
learn that it is on its way (`LeaderComing`, and `avg.coming` for a leader to ask a member that
has not joined at its window's end: leading.py) and wait for it up to the round's latest
gathering instead of giving up after one window. A follower keeps a grace at the end to regroup
without a leader that never comes, moves on at once when a leader that said it was coming says
it no longer is, and once accepted waits for its group as long as its leader may wait.

What a round asks for, and what a follower checks of the group its leader sends, are in
round_request.py; the leaders this peer ranks last after they failed it, in avoided_leaders.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from .. import timebase
from ..dht import DHTNode
from ..net import (
    HandshakeError,
    Message,
    PeerTransport,
    PeerUnreachableError,
    RemoteError,
    TransportError,
)
from .announcements import DHT_PREFIX, Announcements
from .avoided_leaders import AvoidedLeaders
from .bans import BanList
from .errors import LeaderComing, MatchmakingError, NotGathering
from .gatherings import Gathering, Gatherings
from .group import Group
from .leading import Leading, Planner
from .matchmaking_methods import COMING, GROUP, JOIN, REDIRECT, MatchmakingMethods
from .round_request import (
    MAX_GROUP_MEMBERS,
    RoundRequest,
    ack_seconds,
    grace,
    group_refusal,
    latest_after,
    ranked,
)

# (the names other modules and tests import from here, wherever they are defined)
__all__ = [
    "COMING",
    "DHT_PREFIX",
    "GROUP",
    "JOIN",
    "MAX_GROUP_MEMBERS",
    "REDIRECT",
    "Matchmaker",
    "MatchmakingError",
    "Planner",
    "RoundRequest",
    "group_refusal",
]

log = structlog.get_logger(__name__)

JOIN_ATTEMPTS = 4  # avg.join to a leader that refused the connection at once (see _call_leader)
PATIENCE_WINDOWS = 1.0  # how long a direct round waits for its leader to begin, in windows


class Matchmaker:
    def __init__(self, transport: PeerTransport, dht: DHTNode, planner: Planner, *,
                 bans: BanList | None = None,
                 nonce: Callable[[int], bytes] = secrets.token_bytes,
                 equivocate: bool = False) -> None:
        self._transport = transport
        self._dht = dht
        self._bans = bans or BanList()
        self._rng = random.Random(nonce(8))  # (`nonce` makes group ids: the simulator seeds it)
        self.peer_id = transport.peer_id
        # signs the groups we lead, and asks the leaders we follow to sign theirs
        # (signatures.sign_group): a transport without an identity (in-memory tests) does neither
        identity = getattr(transport, "identity", None)
        # the rounds being formed here, those we will gather under soon, the group ids taken
        self._gatherings = Gatherings()
        self._announcements = Announcements(transport, dht, self._bans)  # (not in direct rounds)
        self._redirecting: set[asyncio.Task[None]] = set()  # redirects sent beside a round
        # leaders that failed us twice in a row, ranked last for a while, and the candidates
        # that sent us back to them (avoided_leaders.py)
        self.avoided = AvoidedLeaders()
        # equivocate: TEST ONLY (corruption.py), tell one follower another group
        self._leading = Leading(transport, dht, planner, self._gatherings, nonce=nonce,
                                identity=identity, equivocate=equivocate)
        self._methods = MatchmakingMethods(transport, dht, self._gatherings, self._bans, identity)

    @property
    def refused_groups(self) -> int:
        """Groups from leaders that did not match what we asked for."""
        return self._methods.refused_groups

    def coming(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """While inside: this peer will gather under `keys` (the later stages of a grid round it
        is in); a key is struck off when its gathering begins (see the module docstring)."""
        return self._gatherings.coming(keys)

    def coming_under(self, prefix: str) -> contextlib.AbstractContextManager[None]:
        """While inside: this peer will gather under some key that starts with `prefix` (a grid
        round whose stages it does not know yet: it is still agreeing on the round's roster).
        A peer that waits for it as a stage's leader waits on instead of giving up after one
        window and averaging without it (its slice then split in two: two means of one block,
        and the round's slices stepped apart)."""
        return self._gatherings.coming_under(prefix)

    def round_over(self, prefix: str) -> None:
        """This peer has moved past the round under `prefix` (and its stages): a join under it
        is answered with `RoundOver` (gatherings.py says until when)."""
        self._gatherings.over(prefix)

    async def form_group(self, request: RoundRequest) -> Group:
        """The group this round averages in (possibly just us). Returns by the window's end (a grid
        stage's: its latest gathering) plus
        a short grace; raises MatchmakingError only for misuse (a key already being formed)."""
        if self._gatherings.get(request.key) is not None:
            raise MatchmakingError(f"a round under key {request.key!r} is already being formed here")
        if request.member.peer_id != self.peer_id:
            raise MatchmakingError("the request's member must be this peer")
        gathering = self._gatherings.begin(request)
        window_end = timebase.now() + request.window
        try:
            if request.peers:
                expected = {p for p in request.peers if self._bans.banned(p) is None}
                expected.add(self.peer_id)
                first = {p for p in request.leaders if self._bans.banned(p) is None}
                order = [*ranked(request.key, first), *ranked(request.key, expected - first)]
                return await self._settle_avoiding(gathering, order, expected, window_end)
            await self._announcements.announce(request, window_end)
            candidates, window_end = await self._announcements.gather(request, window_end)
            # Only a peer others can dial may lead; a peer nobody can dial only ever joins.
            leaders = ranked(request.key, [p for p, m in candidates.items() if m.can_reduce])
            return await self._settle_avoiding(gathering, leaders, set(candidates), window_end)
        finally:
            gathering.closed = True
            if not gathering.group.done():
                gathering.group.cancel()
            self._gatherings.end(request.key)

    # Deciding the leader -----------------------------------------------------------------

    async def _settle_avoiding(self, gathering: Gathering, leaders: list[str],
                               candidates: set[str], window_end: float) -> Group:
        """`_settle`, with the leaders we avoid ranked last (avoided_leaders.py). Where we then
        led and nobody came our way, the others follow those leaders, and avoiding them only
        keeps us out of the run's group. The avoidance ends there (one more failure avoids them
        again, for twice as long): a flaky link to an honest leader costs a round, not the
        avoidance's minutes."""
        avoided = self.avoided.avoided(timebase.now()) & set(leaders)
        group = await self._settle(gathering, self.avoided.ranked(leaders, timebase.now()),
                                   candidates, window_end)
        # (we led, and nobody joined: not alone because a candidate stalled us, which an
        # identity ranked after an avoided accomplice could do at will to end the avoidance)
        if avoided and len(group.members) == 1 and gathering.leader == self.peer_id \
                and not gathering.stalled:
            for peer_id in sorted(avoided):
                self.avoided.forgive(peer_id)
            log.info("matchmaking_avoidance_ended", key=gathering.request.key,
                     leaders=[p[:12] for p in sorted(avoided)])
        return group

    async def _settle(self, gathering: Gathering, leaders: list[str], candidates: set[str],
                      window_end: float) -> Group:
        """Join the first of `leaders` that takes us (or lead, when we come first)."""
        request = gathering.request
        gathering.give_up = window_end + grace(request)
        gathering.latest = max(gathering.give_up, min(
            window_end - request.window + latest_after(request),
            request.deadline - 3 * grace(request)))
        tried: set[str] = set()
        asked_again: set[str] = set()
        sent_by: dict[str, str] = {}  # a leader we were redirected to -> who sent us there
        for _ in range(8):
            options = [pid for pid in leaders if pid not in tried]
            if not options:
                break
            leader = options[0]
            if leader == self.peer_id:  # those that refused us have closed their round: not them
                return await self._leading.lead(gathering, candidates, gone=tried)
            gathering.leader = leader
            gathering.accepted = False
            tried.add(leader)
            # Those that joined us while we were undecided follow us there (we do not lead).
            taken, gathering.joiners = list(gathering.joiners), {}
            outcome, *_ = await asyncio.gather(
                self._join(gathering, leader),
                *(self._leading.send_redirect(request, peer_id, leader) for peer_id in taken))
            if isinstance(outcome, Group):
                self.avoided.note_introducers(outcome, sent_by, self.peer_id)
                return outcome
            if outcome is not None and self._bans.banned(outcome) is not None:
                # (an honest peer that follows a leader it has not banned sends us on to it)
                self._bans.refused(outcome, "redirect")
                outcome = None
            if outcome is not None and (outcome not in tried or outcome not in asked_again):
                if outcome in self.avoided.avoided(timebase.now()):
                    # it sends us back to a leader we avoid: should that one fail us again, the
                    # blame is shared (an honest peer passing on an honest leader's redirect is
                    # blamed only where we had cause to avoid that leader)
                    sent_by.setdefault(outcome, leader)
                # a redirect to the leader's leader; one we tried already is asked once more:
                # it refused us before it had begun (a direct round's leader that came late,
                # after our patience), and those that follow it now say it has begun
                if outcome in tried:
                    tried.discard(outcome)
                    asked_again.add(outcome)
                leaders = [outcome, *(p for p in leaders if p != outcome)]
        if gathering.joiners:  # taken while our last leader had not answered: lead them
            return await self._leading.lead(gathering, candidates, gone=tried)
        return self._leading.alone(request)

    def leader_failed(self, group: Group) -> list[str]:
        """The leader of `group` failed us (averager.py judges the round: `leader_failed_us`);
        so did the candidates that sent us to it. Returns those now avoided."""
        avoided = self.avoided.group_failed(group, timebase.now())
        for leader in avoided:
            self._log_avoided(leader)
        return avoided

    def leader_served(self, group: Group) -> None:
        """The round `group`'s leader led went through for us."""
        self.avoided.group_served(group)

    def _log_avoided(self, leader: str) -> None:
        log.warning("matchmaking_leader_avoided", leader=leader[:12],
                    seconds=round(max(0.0, self.avoided.until(leader) - timebase.now()), 1))

    async def _join(self, gathering: Gathering, leader: str) -> Group | str | None:
        """Ask `leader` to take us; the group, a redirect (a peer id), or None if it failed."""
        request = gathering.request
        header = {"key": request.key, "member": request.member.to_json(), "size": request.size,
                  "compression": request.compression, "chunk_elements": request.chunk_elements,
                  "aggregation": request.aggregation}
        if request.peers:
            header["direct"] = True
        access = self._dht.access  # a closed run's rounds need our membership token
        if access is not None and (token := access.credential(request.key)) is not None:
            header["token"] = token
        timeout = min(ack_seconds(request), gathering.give_up - timebase.now())
        if timeout <= 0:
            return None
        redirect = gathering.redirect = asyncio.get_running_loop().create_future()
        try:
            return await self._join_leader(gathering, leader, header, timeout, redirect)
        finally:
            gathering.redirect = None
            redirect.cancel()

    async def _call_leader(self, gathering: Gathering, leader: str, header: dict[str, Any],
                           timeout: float) -> Message:
        """avg.join, tried again (a few times, jittered) when the leader refused the connection
        at once: a leader a hundred newcomers dial together has its handshake slots full for
        a moment, which is no reason to give up on it (a leader that does not answer is)."""
        attempt = 0
        patience = timebase.now() + PATIENCE_WINDOWS * gathering.request.window
        coming = False  # it told us it is on its way (LeaderComing)
        while True:
            started = timebase.monotonic()
            try:
                return await self._transport.call(leader, JOIN, Message(header), timeout=timeout)
            except RemoteError as exc:
                # the leader we expect has not begun its round yet (its last batch, a look at the
                # run): it comes, give it a moment; one still in an earlier stage of the same
                # round comes for sure: as long as the round may gather
                staged = gathering.request.staged and header.get("direct")
                if exc.kind == LeaderComing.__name__ and staged:
                    # (a grace left at the end: should it not come after all, we regroup)
                    coming = True
                    gathering.give_up = max(gathering.give_up, gathering.latest)
                    patience = max(patience, gathering.latest - grace(gathering.request))
                elif exc.kind == NotGathering.__name__ and coming:
                    raise  # it said it was coming, and now it is not in the round: move on
                if exc.kind not in (NotGathering.__name__, LeaderComing.__name__) \
                        or not header.get("direct") \
                        or timebase.now() + 0.2 >= min(gathering.give_up, patience):
                    raise
                # a leader still in an earlier stage is busy there: ask it less often
                await asyncio.sleep((0.5 if coming else 0.1) + 0.2 * self._rng.random())
                continue
            except (PeerUnreachableError, HandshakeError) as exc:
                attempt += 1
                fast = timebase.monotonic() - started < timeout / 2
                pause = (0.1 + 0.4 * self._rng.random()) * 2 ** attempt
                if not fast or attempt >= JOIN_ATTEMPTS or timebase.now() + pause >= gathering.give_up:
                    raise
                log.debug("matchmaking_join_retry", leader=leader[:12], error=str(exc))
                await asyncio.sleep(pause)

    async def _join_leader(self, gathering: Gathering, leader: str, header: dict[str, Any],
                           timeout: float, redirect: asyncio.Future[str]) -> Group | str | None:
        request = gathering.request
        try:
            reply = await self._call_leader(gathering, leader, header, timeout)
        except RemoteError as exc:
            log.info("matchmaking_join_refused", leader=leader[:12], kind=exc.kind, error=exc.message)
            return None
        except (TransportError, TimeoutError) as exc:
            log.info("matchmaking_leader_unreachable", leader=leader[:12], error=str(exc))
            return None
        if "redirect" in reply.header:
            return str(reply.header["redirect"])
        gathering.accepted = True
        # those that joined us while this leader had not answered yet follow it too
        # (`MatchmakingMethods.on_join`; sent beside the wait: a joiner gone silent must not hold
        # up our own group)
        taken, gathering.joiners = list(gathering.joiners), {}
        for peer_id in taken:
            task = asyncio.create_task(self._leading.send_redirect(request, peer_id, leader))
            self._redirecting.add(task)
            task.add_done_callback(self._redirecting.discard)
        # accepted: the leader sends the group (avg.group) once it is assembled, or, if it follows
        # another peer after all, that peer's id (avg.redirect). In a direct round the leader may
        # wait past its window for members on their way (`Leading._still_coming`), at most until its
        # latest gathering, which began no later than now: we wait that long (leaving earlier,
        # we would be in its group without sending, and the round would fail for all)
        until = gathering.give_up + grace(request)
        if request.staged and request.peers:
            until = max(until, min(request.deadline - 2 * grace(request),
                                   timebase.now() + latest_after(request) + grace(request)))
        await asyncio.wait([gathering.group, redirect], return_when=asyncio.FIRST_COMPLETED,
                           timeout=max(0.0, until - timebase.now()))
        if gathering.group.done() and not gathering.group.cancelled():
            return gathering.group.result()
        if redirect.done():
            log.info("matchmaking_redirected", leader=leader[:12], to=redirect.result()[:12])
            return redirect.result()
        log.info("matchmaking_leader_never_sent_group", leader=leader[:12])
        gathering.stalled = True
        if self.avoided.failed(leader, timebase.now()):  # (or sent none we could take: on_group)
            self._log_avoided(leader)
        return None
