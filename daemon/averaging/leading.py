"""A round's leader's side of matchmaking (matchmaking.py), once this peer leads a gathering.

The leader waits for joins (answered by matchmaking_methods.py) until its window closes (or every
candidate it saw has joined or was refused), then assembles the group: the ordered members,
their shares of the vector from the load balancer, a fresh group id, the round's deadline, and
sends that same `Group`, signed (signatures.sign_group), to every member (`avg.group`).

Stages of a grid round (`RoundRequest.staged`): past its window, a leader asks the members that
have not joined whether they are on their way (`avg.coming`: still in an earlier stage of the
round), and waits for them up to the round's latest gathering (`latest_after`: 4 windows and a
grace) instead of giving up after one window: in a 128-peer grid, the first stage's slices ended
up to 11 s apart, and the peers of a quick slice gave up on their next leader just as it came
(they averaged alone; the round failed). Nobody waits past the window for a member that is not
on its way. Other direct rounds close at their window as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import structlog

from .. import timebase
from ..dht import DHTNode
from ..identity import Identity
from ..net import Message, PeerTransport, TransportError
from .corruption import equivocal_group
from .gatherings import Gathering, Gatherings
from .group import Group, Member
from .matchmaking_methods import COMING, GROUP, REDIRECT
from .round_request import JOIN_ACK_SECONDS, MAX_GROUP_MEMBERS, RoundRequest, ack_seconds
from .signatures import round_name, sign_group

log = structlog.get_logger(__name__)

# Given the members and the vector, the leader's choice of part ranges (the load balancer).
Planner = Callable[[tuple[Member, ...], int, int], tuple[tuple[int, int], ...]]


class Leading:
    """Leads this peer's gatherings: waits for their joiners, assembles and sends their groups."""

    def __init__(self, transport: PeerTransport, dht: DHTNode, planner: Planner,
                 gatherings: Gatherings, *, nonce: Callable[[int], bytes],
                 identity: Identity | None, equivocate: bool) -> None:
        self._transport = transport
        self._dht = dht
        self._planner = planner
        self._gatherings = gatherings  # (the group ids we assemble are taken there)
        self._nonce = nonce  # of group ids
        self._identity = identity  # signs the groups we lead (None: not signed)
        self._equivocate = equivocate  # TEST ONLY (corruption.py): tell one follower another group
        self.peer_id = transport.peer_id

    async def lead(self, gathering: Gathering, candidates: set[str],
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

    async def _still_coming(self, gathering: Gathering, missing: set[str]) -> bool:
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

    async def send_redirect(self, request: RoundRequest, peer_id: str, leader: str) -> None:
        """Tell `peer_id`, whose join we took, that we follow `leader` after all (avg.redirect)."""
        timeout = min(JOIN_ACK_SECONDS, request.deadline - timebase.now())
        try:
            await self._transport.call(peer_id, REDIRECT, Message({"key": request.key, "leader": leader}),
                                       timeout=max(0.1, timeout))
        except (TransportError, TimeoutError) as exc:  # it waits for a group and then goes on
            log.info("matchmaking_redirect_not_delivered", peer=peer_id[:12], error=str(exc))

    async def _assemble(self, request: RoundRequest, members: tuple[Member, ...]) -> Group:
        if len(members) == 1:
            return self.alone(request)
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
        self._gatherings.seen(group.group_id, self.peer_id)
        return group

    def alone(self, request: RoundRequest) -> Group:
        """A group of one: this peer averages by itself."""
        log.info("matchmaking_alone", key=request.key)
        return Group("solo-" + self._nonce(8).hex(), request.key, (request.member,), request.size,
                     ((0, request.size),), request.chunk_elements, request.compression,
                     request.deadline, request.aggregation)
