"""Matchmaking: the peers that want to average under one key form one group, within a window.

1. Each peer announces itself in the DHT: a sub-key of `averaging/<key>` named by its own peer id
   (only it can write that), holding its `Member` info, expiring when its window closes.
2. It reads the key until the window closes, or until it has seen `expected` peers.
3. The leader is the first reachable candidate in an order by a hash of the key and the peer id
   (`ranked`: the same for every peer that sees the same candidates, and not for sale by
   grinding peer ids, since the key is not known in advance). A follower asks the leader to
   let it join (`avg.join`, acknowledged at once, so a silent leader is skipped quickly); the
   leader waits for joins until its window closes (or every candidate it saw has joined), then
   assembles the group: the ordered members, their shares of the vector from the load balancer,
   a fresh group id, the round's deadline, and sends that same `Group` to every member
   (`avg.group`).
4. A peer asked to join while it follows someone else answers with a redirect to its leader; ranks
   only decrease along redirects, so they end. A peer asked while still gathering, or while its
   own leader has not taken it yet (that one may be silent), takes the join (it may well lead);
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
(`NotGathering`) asks again for a moment instead of moving on. No DHT traffic, and no wait for
announcements to spread: with a hundred peers, gathering through the DHT took most of a round.

Stages of a grid round (`RoundRequest.staged`). A peer registers the keys of its stages while
its own stages run (`coming`). Its slice's peers that reach a stage first then learn that it is
on its way (`LeaderComing`, and `avg.coming` for a leader to ask a member that has not joined at
its window's end) and wait for it up to the round's latest gathering (`latest_after`: 4 windows
and a grace) instead of giving up after one window: in a 128-peer grid, the first stage's slices
ended up to 11 s apart, and the peers of a quick slice gave up on their next leader just as it
came (they averaged alone; the round failed). A follower keeps a grace at the end to regroup
without a leader that never comes, moves on at once when a leader that said it was coming says
it no longer is, and once accepted waits for its group as long as its leader may wait. A peer
that is not on its way (crashed, or not in the round) says so, and nobody waits for it past the
window. Other direct rounds close at their window as before.

What a round asks for, and what a follower checks of the group its leader sends, are in
round_request.py; the leaders this peer ranks last after they failed it, in avoided_leaders.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import random
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from .. import timebase
from ..dht import DHTNode
from ..net import (
    HandshakeError,
    Message,
    PeerTransport,
    PeerUnreachableError,
    RemoteError,
    RequestContext,
    TransportError,
)
from .avoided_leaders import AvoidedLeaders
from .bans import BanList
from .corruption import equivocal_group
from .errors import LeaderComing, MatchmakingError, NotGathering
from .group import Group, Member
from .round_request import (
    EXTEND_WINDOWS,
    JOIN_ACK_SECONDS,
    MAX_ADDRESSES,
    MAX_GROUP_MEMBERS,
    RoundRequest,
    ack_seconds,
    grace,
    group_refusal,
    latest_after,
    member_from,
    ranked,
)
from .signatures import group_signed_by, round_name, sign_group

log = structlog.get_logger(__name__)

SEEN_GROUPS = 8192  # group ids remembered, to refuse one used again
JOIN = "avg.join"
GROUP = "avg.group"
REDIRECT = "avg.redirect"
COMING = "avg.coming"
DHT_PREFIX = "averaging/"
POLL_SECONDS = (0.01, 0.2)  # between DHT reads while gathering: first, and at most (backing off)
# Each read returns every announcement so far: with n peers polling, gathering costs n^2 entries
# a poll. So the pause grows with what was seen (0.2 s per 16 announcements, at most
# MAX_POLL_SECONDS), and a read asks READ_REPLICAS of the key's nodes (an announcement is
# stored on all of them): 64 peers polling every 0.2 s all 8 replicas saturated two cores.
MAX_POLL_SECONDS = 1.0
READ_REPLICAS = 3
JOIN_ATTEMPTS = 4  # avg.join to a leader that refused the connection at once (see _call_leader)
PATIENCE_WINDOWS = 1.0  # how long a direct round waits for its leader to begin, in windows

# Given the members and the vector, the leader's choice of part ranges (the load balancer).
Planner = Callable[[tuple[Member, ...], int, int], tuple[tuple[int, int], ...]]


@dataclass
class _Gathering:
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


class Matchmaker:
    def __init__(self, transport: PeerTransport, dht: DHTNode, planner: Planner, *,
                 bans: BanList | None = None,
                 nonce: Callable[[int], bytes] = secrets.token_bytes,
                 equivocate: bool = False) -> None:
        self._transport = transport
        self._dht = dht
        self._planner = planner
        self._bans = bans or BanList()
        self._nonce = nonce  # of group ids (the simulator passes a seeded one)
        self._rng = random.Random(nonce(8))
        self.peer_id = transport.peer_id
        # signs the groups we lead, and asks the leaders we follow to sign theirs
        # (signatures.sign_group): a transport without an identity (in-memory tests) does neither
        self._identity = getattr(transport, "identity", None)
        self._equivocate = equivocate  # TEST ONLY (corruption.py): tell one follower another group
        self._rounds: dict[str, _Gathering] = {}
        self._coming: set[str] = set()  # keys we will gather under soon (see `coming`)
        self._coming_under: dict[str, int] = {}  # ... and key prefixes (see `coming_under`)
        self.refused_groups = 0  # groups from leaders that did not match what we asked for
        # group ids taken (ours and leaders'): a group under an id seen before is refused, so no
        # round's signatures can be shown again in another (signatures.py)
        # (with the leader that sent each: a leader that sends an id another leader sent first
        # may be honest, beaten to it by a member of its round that copied the id; refused, but
        # no offence of it)
        self._seen_groups: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._redirecting: set[asyncio.Task[None]] = set()  # redirects sent beside a round
        # leaders that failed us twice in a row, ranked last for a while, and the candidates
        # that sent us back to them (avoided_leaders.py)
        self.avoided = AvoidedLeaders()
        transport.add_unary_handler(JOIN, self._on_join)
        transport.add_unary_handler(GROUP, self._on_group)
        transport.add_unary_handler(REDIRECT, self._on_redirect)
        transport.add_unary_handler(COMING, self._on_coming)

    def _seen(self, group_id: str, leader: str) -> None:
        if group_id in self._seen_groups:  # (its first leader stays; sent again, it stays old)
            return
        self._seen_groups[group_id] = leader
        while len(self._seen_groups) > SEEN_GROUPS:
            self._seen_groups.popitem(last=False)

    @contextlib.contextmanager
    def coming(self, keys: Iterable[str]) -> Iterator[None]:
        """While inside: this peer will gather under `keys` (the later stages of a grid round it
        is in); a key is struck off when its gathering begins (see the module docstring)."""
        added = {k for k in keys if k not in self._coming and k not in self._rounds}
        self._coming |= added
        try:
            yield
        finally:
            self._coming -= added

    @contextlib.contextmanager
    def coming_under(self, prefix: str) -> Iterator[None]:
        """While inside: this peer will gather under some key that starts with `prefix` (a grid
        round whose stages it does not know yet: it is still agreeing on the round's roster).
        A peer that waits for it as a stage's leader waits on instead of giving up after one
        window and averaging without it (its slice then split in two: two means of one block,
        and the round's slices stepped apart)."""
        self._coming_under[prefix] = self._coming_under.get(prefix, 0) + 1
        try:
            yield
        finally:
            left = self._coming_under[prefix] - 1
            if left:
                self._coming_under[prefix] = left
            else:
                del self._coming_under[prefix]

    def _will_gather(self, key: str) -> bool:
        """Whether this peer will gather under `key` soon (`coming`, `coming_under`)."""
        return key in self._coming or any(key.startswith(p) for p in self._coming_under)

    async def form_group(self, request: RoundRequest) -> Group:
        """The group this round averages in (possibly just us). Returns by the window's end (a grid
        stage's: its latest gathering) plus
        a short grace; raises MatchmakingError only for misuse (a key already being formed)."""
        if request.key in self._rounds:
            raise MatchmakingError(f"a round under key {request.key!r} is already being formed here")
        if request.member.peer_id != self.peer_id:
            raise MatchmakingError("the request's member must be this peer")
        gathering = _Gathering(request)
        self._rounds[request.key] = gathering
        self._coming.discard(request.key)
        window_end = timebase.now() + request.window
        try:
            if request.peers:
                expected = {p for p in request.peers if self._bans.banned(p) is None}
                expected.add(self.peer_id)
                first = {p for p in request.leaders if self._bans.banned(p) is None}
                order = [*ranked(request.key, first), *ranked(request.key, expected - first)]
                return await self._settle_avoiding(gathering, order, expected, window_end)
            await self._announce(request, window_end)
            candidates, window_end = await self._gather(request, window_end)
            # Only a peer others can dial may lead; a peer nobody can dial only ever joins.
            leaders = ranked(request.key, [p for p, m in candidates.items() if m.can_reduce])
            return await self._settle_avoiding(gathering, leaders, set(candidates), window_end)
        finally:
            gathering.closed = True
            if not gathering.group.done():
                gathering.group.cancel()
            self._rounds.pop(request.key, None)

    # Announcing and gathering ------------------------------------------------------------

    async def _announce(self, request: RoundRequest, window_end: float) -> None:
        info = {**request.member.to_json(), "size": request.size, "compression": request.compression,
                "chunk_elements": request.chunk_elements, "aggregation": request.aggregation,
                # how to reach us: a candidate may never have met us (a newcomer, a big swarm)
                "addresses": [str(a) for a in self._transport.listen_addresses()[:MAX_ADDRESSES]]}
        try:
            await self._dht.store(DHT_PREFIX + request.key, orjson.dumps(info),
                                  window_end + 2 * grace(request), sub_key=self.peer_id,
                                  timeout=max(0.5, window_end - timebase.now()))
        except (TransportError, TimeoutError) as exc:
            log.warning("matchmaking_announce_failed", key=request.key, error=str(exc))

    async def _gather(self, request: RoundRequest, window_end: float) -> tuple[dict[str, Member], float]:
        """Read the announcements until the window closes or `expected` peers are seen; past the
        window while fewer than `min_trainers` trainers are seen (see RoundRequest). Returns
        them and when the gathering ended."""
        seen: dict[str, Member] = {self.peer_id: request.member}
        pause = POLL_SECONDS[0]
        latest = min(window_end + (EXTEND_WINDOWS - 1) * request.window,
                     request.deadline - 4 * grace(request))
        while True:
            remaining = window_end - timebase.now()
            if remaining <= 0:
                trainers = sum(1 for m in seen.values() if m.role != "aux")
                if trainers >= request.min_trainers or timebase.now() >= latest:
                    break
                window_end = min(latest, timebase.now() + request.window / 2)
                await self._announce(request, window_end)  # keep being seen meanwhile
                continue
            try:
                # the last read of the window asks every node of the key (a lookup cut short or
                # an old route may miss the writer's nearest nodes)
                record = await self._dht.get(DHT_PREFIX + request.key, timeout=max(0.2, remaining),
                                             replicas=None if remaining <= pause else READ_REPLICAS)
            except (TransportError, TimeoutError) as exc:
                log.debug("matchmaking_read_failed", key=request.key, error=str(exc))
                record = None
            # (only sub-keys written by the peer they name: anyone may write "1", "11", ...,
            # which would sort first and use up the attempts to settle)
            for sub_key, entry in (record.own_sub_keys.items() if record is not None else ()):
                found = member_from(entry.value, sub_key, request)
                if found is not None:
                    member, addresses = found
                    if sub_key not in seen and addresses:
                        self._transport.learn_addresses(sub_key, addresses, first_hand=False)
                    seen[sub_key] = member
            if request.expected is not None and len(seen) >= request.expected:
                break
            await asyncio.sleep(min(pause, max(0.0, window_end - timebase.now())))
            pause = min(pause * 2, _poll_cap(len(seen)))
        for peer_id in [p for p in seen if p != self.peer_id and self._bans.banned(p) is not None]:
            self._bans.refused(peer_id, "candidate")
            del seen[peer_id]
        return seen, max(window_end, timebase.now())

    # Deciding the leader -----------------------------------------------------------------

    async def _settle_avoiding(self, gathering: _Gathering, leaders: list[str],
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

    async def _settle(self, gathering: _Gathering, leaders: list[str], candidates: set[str],
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
                return await self._lead(gathering, candidates, gone=tried)
            gathering.leader = leader
            gathering.accepted = False
            tried.add(leader)
            # Those that joined us while we were undecided follow us there (we do not lead).
            taken, gathering.joiners = list(gathering.joiners), {}
            outcome, *_ = await asyncio.gather(
                self._join(gathering, leader),
                *(self._send_redirect(request, peer_id, leader) for peer_id in taken))
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
            return await self._lead(gathering, candidates, gone=tried)
        return self._alone(request)

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

    async def _join(self, gathering: _Gathering, leader: str) -> Group | str | None:
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

    async def _call_leader(self, gathering: _Gathering, leader: str, header: dict[str, Any],
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

    async def _join_leader(self, gathering: _Gathering, leader: str, header: dict[str, Any],
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
        # those that joined us while this leader had not answered yet follow it too (`_on_join`;
        # sent beside the wait: a joiner gone silent must not hold up our own group)
        taken, gathering.joiners = list(gathering.joiners), {}
        for peer_id in taken:
            task = asyncio.create_task(self._send_redirect(request, peer_id, leader))
            self._redirecting.add(task)
            task.add_done_callback(self._redirecting.discard)
        # accepted: the leader sends the group (avg.group) once it is assembled, or, if it follows
        # another peer after all, that peer's id (avg.redirect). In a direct round the leader may
        # wait past its window for members on their way (`_still_coming`), at most until its
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
        if self.avoided.failed(leader, timebase.now()):  # (or sent none we could take: _on_group)
            self._log_avoided(leader)
        return None

    async def _lead(self, gathering: _Gathering, candidates: set[str],
                    gone: set[str] | frozenset[str] = frozenset()) -> Group:
        """Wait for the others to join (until the window closes or all candidates are in; in a
        direct round, past the window for those still on their way, see `_still_coming`)."""
        request = gathering.request
        gathering.leader = self.peer_id
        others = set(candidates) - {self.peer_id} - set(gone)

        def missing() -> set[str]:
            return others - gathering.refused - set(gathering.joiners)

        while missing() and len(gathering.joiners) + 1 < min(request.max_group_size, MAX_GROUP_MEMBERS):
            if timebase.now() >= gathering.give_up:
                if not (request.staged and request.peers
                        and await self._still_coming(gathering, missing())):
                    break
                continue  # (a join may have come during the question)
            gathering.joined.clear()
            try:
                async with asyncio.timeout(max(0.0, gathering.give_up - timebase.now())):
                    await gathering.joined.wait()
            except TimeoutError:
                continue
        gathering.closed = True
        members = (request.member, *sorted(gathering.joiners.values(), key=lambda m: m.peer_id))
        group = await self._assemble(request, members)
        gathering.group.set_result(group)
        log.info("matchmaking_group_formed", key=request.key, size=len(members), group=group.group_id[:12])
        told = {m.peer_id: group for m in members[1:]}
        if self._equivocate and len(told) > 1:
            told[members[1].peer_id] = equivocal_group(group, self._identity)
        await asyncio.gather(*(self._send_group(g, peer_id) for peer_id, g in told.items()))
        return group

    async def _still_coming(self, gathering: _Gathering, missing: set[str]) -> bool:
        """Past the window: whether one of the `missing` members says it is on its way (still in
        an earlier stage of the round); if so, wait a little longer, at most until the round's
        latest gathering."""
        request = gathering.request
        left = gathering.latest - timebase.now()
        if left <= 0:
            return False
        timeout = min(ack_seconds(request), left)
        header: dict[str, Any] = {"key": request.key}
        access = self._dht.access  # a closed run's members answer members only
        if access is not None and (token := access.credential(request.key)) is not None:
            header["token"] = token

        async def ask(peer_id: str) -> bool:
            try:
                reply = await self._transport.call(peer_id, COMING, Message(header),
                                                   timeout=timeout)
            except (TransportError, TimeoutError):
                return False
            return reply.header.get("coming") is True

        limit = min(request.max_group_size, MAX_GROUP_MEMBERS)
        answers = await asyncio.gather(*(ask(p) for p in sorted(missing)[:limit]))
        if not any(answers):
            return False
        gathering.give_up = min(gathering.latest, timebase.now() + max(0.5, request.window / 2))
        log.debug("matchmaking_waiting_for_coming", key=request.key, coming=sum(answers))
        return True

    async def _send_group(self, group: Group, peer_id: str) -> None:
        timeout = min(JOIN_ACK_SECONDS, group.deadline - timebase.now())
        try:
            await self._transport.call(peer_id, GROUP, Message(
                {"group": group.to_json(), "signature": group.leader_signature}),
                timeout=max(0.1, timeout))
        except (TransportError, TimeoutError) as exc:  # it will be missing from the all-reduce
            log.warning("matchmaking_group_not_delivered", peer=peer_id[:12], error=str(exc))

    async def _send_redirect(self, request: RoundRequest, peer_id: str, leader: str) -> None:
        timeout = min(JOIN_ACK_SECONDS, request.deadline - timebase.now())
        try:
            await self._transport.call(peer_id, REDIRECT, Message({"key": request.key, "leader": leader}),
                                       timeout=max(0.1, timeout))
        except (TransportError, TimeoutError) as exc:  # it waits for a group and then goes on
            log.info("matchmaking_redirect_not_delivered", peer=peer_id[:12], error=str(exc))

    async def _assemble(self, request: RoundRequest, members: tuple[Member, ...]) -> Group:
        if len(members) == 1:
            return self._alone(request)
        ordered = tuple(sorted(members, key=lambda m: m.peer_id))
        digest = hashlib.sha256(request.key.encode() + self._nonce(16)
                                + "".join(m.peer_id for m in ordered).encode()).hexdigest()
        # The load balancer's LP runs in a thread: the event loop never waits on it.
        bounds = await asyncio.to_thread(self._planner, ordered, request.size, request.chunk_elements)
        group = Group(digest, request.key, ordered, request.size, bounds, request.chunk_elements,
                      request.compression, request.deadline, request.aggregation)
        group.check()
        group = dataclasses.replace(group, leader=self.peer_id, leader_signature="" if (
            self._identity is None) else sign_group(self._identity, group.group_id, round_name(group)))
        self._seen(group.group_id, self.peer_id)
        return group

    def _alone(self, request: RoundRequest) -> Group:
        log.info("matchmaking_alone", key=request.key)
        return Group("solo-" + self._nonce(8).hex(), request.key, (request.member,), request.size,
                     ((0, request.size),), request.chunk_elements, request.compression,
                     request.deadline, request.aggregation)

    # The leader's side of avg.join ---------------------------------------------------------

    async def _on_join(self, ctx: RequestContext, message: Message) -> Message:
        header = message.header
        key = header.get("key")
        if isinstance(key, str) and self._dht.access is not None:
            # A closed run's rounds admit its members only (AccessDenied, counted per peer).
            self._dht.access.authorize_read(ctx.peer_id, key, header.get("token"))
        gathering = self._rounds.get(key) if isinstance(key, str) else None
        if gathering is None:
            if isinstance(key, str) and self._will_gather(key):
                raise LeaderComing("still in an earlier stage of this round; ask again shortly")
            raise NotGathering("no round of that key is being formed here")
        if gathering.leader is not None and gathering.leader != self.peer_id:
            if gathering.accepted:
                return Message({"redirect": gathering.leader})
            if gathering.request.peers:
                # a direct round: we still wait for the leader before us; if it never comes we
                # lead, so ask again shortly rather than follow a leader that may not exist
                raise NotGathering("still waiting for the round's leader; ask again shortly")
            # A leader that has not taken us yet may be silent: sending the joiner there (it
            # skipped that one already) cost it a second try of a dead peer, and the round
            # split (its group formed after the others had settled on the next one). We take
            # the join as an undecided peer does: we lead it if our leader is gone, or send it
            # on to our leader once that one takes us (`_join_leader`).
        try:
            member = Member.from_json(header["member"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MatchmakingError(f"bad member info: {exc}") from None
        if member.peer_id != ctx.peer_id:
            raise MatchmakingError("a peer may only join as itself")
        banned = self._bans.banned(ctx.peer_id)
        if banned is not None:
            self._bans.refused(ctx.peer_id, "join")
            gathering.refuse(ctx.peer_id)
            raise MatchmakingError(f"you are {banned}")
        limit = gathering.request.max_weight
        if limit is not None and member.weight > limit:
            self._bans.offence(ctx.peer_id, "weight", f"claimed {member.weight:g} > {limit:g}")
            gathering.refuse(ctx.peer_id)
            raise MatchmakingError(f"a weight of {member.weight:g} is more than this round's "
                                   f"{limit:g}")
        if not gathering.request.compatible(header):
            gathering.refuse(ctx.peer_id)
            raise MatchmakingError("this round averages a vector of another size, chunking, "
                                   "compression or aggregation")
        if gathering.closed:
            raise MatchmakingError("the group is already formed")
        if len(gathering.joiners) + 1 >= min(gathering.request.max_group_size, MAX_GROUP_MEMBERS):
            raise MatchmakingError("the group is full")
        gathering.joiners[member.peer_id] = member
        gathering.joined.set()
        return Message({"accepted": True})

    async def _on_group(self, ctx: RequestContext, message: Message) -> Message:
        try:
            group = Group.from_json(message.header["group"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MatchmakingError(f"bad group: {exc}") from None
        gathering = self._rounds.get(group.key)
        if gathering is None or gathering.leader != ctx.peer_id:
            raise MatchmakingError("not waiting for a group from you under that key")
        if self.peer_id not in {m.peer_id for m in group.members}:
            raise MatchmakingError("the group does not include this peer")
        refusal = group_refusal(group, gathering.request, timebase.now())
        offence = refusal is not None
        signature = message.header.get("signature")
        if refusal is None and self._identity is not None and not group_signed_by(
                ctx.peer_id, group.group_id, round_name(group), signature):
            # a bad signature is an offence; none at all may be a leader of an earlier dedloc
            refusal = ("it is not signed by its leader" if signature
                       else "it is not signed (a leader of an earlier dedloc?)")
            offence = bool(signature)
        first_from = self._seen_groups.get(group.group_id)
        offence = offence or first_from == ctx.peer_id
        if refusal is None and first_from is not None:
            refusal = f"its id {group.group_id[:16]} names a round seen before" + (
                "" if offence else f" (from {first_from[:12]}: who copied whose is unknown)")
        self._seen(group.group_id, ctx.peer_id)
        if refusal is not None:  # we wait out the leader and go on without it
            self.refused_groups += 1
            log.warning("matchmaking_group_refused", leader=ctx.peer_id[:12], key=group.key,
                        reason=refusal)
            # an offence: no honest leader's group breaks these rules (a round that failed runs
            # again under the same key, with the same leader first: without a ban, a hostile
            # leader that ranks first stalled its run's head for good)
            if offence:
                self._bans.offence(ctx.peer_id, "group", refusal)
            raise MatchmakingError(f"refused the group: {refusal}")
        if not gathering.group.done():
            gathering.group.set_result(dataclasses.replace(  # (the signature checked above)
                group, leader=ctx.peer_id,
                leader_signature=signature if self._identity is not None else ""))
        return Message({})

    async def _on_coming(self, ctx: RequestContext, message: Message) -> Message:
        """Whether we will join the asker's round of `key`: we gather under it soon (an earlier
        stage of it runs), or we are gathering under it now and have not settled yet."""
        key = message.header.get("key")
        if not isinstance(key, str):
            raise MatchmakingError("avg.coming needs a key")
        if self._dht.access is not None:
            self._dht.access.authorize_read(ctx.peer_id, key, message.header.get("token"))
        gathering = self._rounds.get(key)
        soon = self._will_gather(key) or (gathering is not None and not gathering.closed
                                       and gathering.leader in (None, ctx.peer_id))
        return Message({"coming": soon})

    async def _on_redirect(self, ctx: RequestContext, message: Message) -> Message:
        """The leader we joined follows another peer after all: join that one instead."""
        key, leader = message.header.get("key"), message.header.get("leader")
        gathering = self._rounds.get(key) if isinstance(key, str) else None
        if gathering is None or gathering.leader != ctx.peer_id or gathering.redirect is None:
            raise MatchmakingError("not waiting for a group from you under that key")
        if not isinstance(leader, str) or leader in (ctx.peer_id, self.peer_id):
            raise MatchmakingError("bad redirect")
        if not gathering.redirect.done():
            gathering.redirect.set_result(leader)
        return Message({})


def _poll_cap(seen: int) -> float:
    """The longest pause between reads while gathering, having seen `seen` announcements."""
    return min(MAX_POLL_SECONDS, POLL_SECONDS[1] * max(1.0, seen / 16))
