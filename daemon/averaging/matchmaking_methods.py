"""The matchmaking methods a peer answers (unary), for the rounds it is gathering (gatherings.py):

- `avg.join` (a follower to the leader it asks): header {key, member, size, compression,
  chunk_elements, aggregation, direct (a direct round), token (a closed run's)}; answers
  {"accepted": true} or {"redirect": leader}.
- `avg.group` (a leader to each member): header {group, signature}: the group it assembled.
- `avg.redirect` (a peer that took our join to us): header {key, leader}: it follows that leader.
- `avg.coming` (a leader to a member that has not joined at its window's end): header {key,
  token}; answers {"coming": bool}.

A peer asked to join while it follows someone else answers with a redirect to its leader; ranks
only decrease along redirects, so they end. A peer asked while still gathering, or while its own
leader has not taken it yet (that one may be silent), takes the join (it may well lead); should
it follow another leader after all, it sends those it took there (`avg.redirect`, matchmaking.py).
A banned peer's join is refused (bans.py), as is a weight over the round's `max_weight` (an
offence) or another vector: the leader then stops waiting for that peer.

A peer not gathering under the key yet answers a join with `NotGathering`, or with `LeaderComing`
where it will gather under it soon (an earlier stage of the same grid round runs): its followers
wait for it (see matchmaking.py); with `RoundOver` where it has stepped past that round
(gatherings.py): its followers move on at once. `avg.coming` asks the same of a member: a peer
that is not on its way (crashed, or not in the round) says so, and nobody waits for it past the
window.

What a follower checks of the group its leader sends is `group_refusal` (round_request.py), its
leader's signature (signatures.py), and that its id names no round seen before (gatherings.py);
a group it refuses is counted (`refused_groups`), and where no honest leader would have sent it,
an offence of that leader.
"""

from __future__ import annotations

import dataclasses

import structlog

from .. import timebase
from ..dht import DHTNode
from ..identity import Identity
from ..net import Message, PeerTransport, RequestContext
from .bans import BanList
from .errors import LeaderComing, MatchmakingError, NotGathering, RoundOver
from .gatherings import Gatherings
from .group import Group, Member
from .round_request import MAX_GROUP_MEMBERS, group_refusal
from .signatures import group_signed_by, round_name

log = structlog.get_logger(__name__)

JOIN = "avg.join"
GROUP = "avg.group"
REDIRECT = "avg.redirect"
COMING = "avg.coming"


class MatchmakingMethods:
    """Answers avg.join, avg.group, avg.redirect and avg.coming from what `gatherings` holds."""

    def __init__(self, transport: PeerTransport, dht: DHTNode, gatherings: Gatherings,
                 bans: BanList, identity: Identity | None) -> None:
        self._dht = dht
        self._gatherings = gatherings
        self._bans = bans
        self._identity = identity  # None: groups need no leader's signature (see Matchmaker)
        self.peer_id = transport.peer_id
        self.refused_groups = 0  # groups from leaders that did not match what we asked for
        transport.add_unary_handler(JOIN, self.on_join)
        transport.add_unary_handler(GROUP, self.on_group)
        transport.add_unary_handler(REDIRECT, self.on_redirect)
        transport.add_unary_handler(COMING, self.on_coming)

    # The leader's side of avg.join ---------------------------------------------------------

    async def on_join(self, ctx: RequestContext, message: Message) -> Message:
        header = message.header
        key = header.get("key")
        if isinstance(key, str) and self._dht.access is not None:
            # A closed run's rounds admit its members only (AccessDenied, counted per peer).
            self._dht.access.authorize_read(ctx.peer_id, key, header.get("token"))
        gathering = self._gatherings.get(key) if isinstance(key, str) else None
        if gathering is None:
            if isinstance(key, str) and self._gatherings.will_gather(key):
                raise LeaderComing("still in an earlier stage of this round; ask again shortly")
            if isinstance(key, str) and self._gatherings.is_over(key):
                raise RoundOver("this peer has stepped past that round: it will not form it again")
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
            # on to our leader once that one takes us (`Matchmaker._join_leader`).
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

    async def on_group(self, ctx: RequestContext, message: Message) -> Message:
        try:
            group = Group.from_json(message.header["group"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MatchmakingError(f"bad group: {exc}") from None
        gathering = self._gatherings.get(group.key)
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
        first_from = self._gatherings.first_leader(group.group_id)
        offence = offence or first_from == ctx.peer_id
        if refusal is None and first_from is not None:
            refusal = f"its id {group.group_id[:16]} names a round seen before" + (
                "" if offence else f" (from {first_from[:12]}: who copied whose is unknown)")
        self._gatherings.seen(group.group_id, ctx.peer_id)
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

    async def on_coming(self, ctx: RequestContext, message: Message) -> Message:
        """Whether we will join the asker's round of `key`: we gather under it soon (an earlier
        stage of it runs), or we are gathering under it now and have not settled yet."""
        key = message.header.get("key")
        if not isinstance(key, str):
            raise MatchmakingError("avg.coming needs a key")
        if self._dht.access is not None:
            self._dht.access.authorize_read(ctx.peer_id, key, message.header.get("token"))
        gathering = self._gatherings.get(key)
        soon = self._gatherings.will_gather(key) or (gathering is not None and not gathering.closed
                                                     and gathering.leader in (None, ctx.peer_id))
        return Message({"coming": soon})

    async def on_redirect(self, ctx: RequestContext, message: Message) -> Message:
        """The leader we joined follows another peer after all: join that one instead."""
        key, leader = message.header.get("key"), message.header.get("leader")
        gathering = self._gatherings.get(key) if isinstance(key, str) else None
        if gathering is None or gathering.leader != ctx.peer_id or gathering.redirect is None:
            raise MatchmakingError("not waiting for a group from you under that key")
        if not isinstance(leader, str) or leader in (ctx.peer_id, self.peer_id):
            raise MatchmakingError("bad redirect")
        if not gathering.redirect.done():
            gathering.redirect.set_result(leader)
        return Message({})
