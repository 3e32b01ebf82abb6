"""Signed answers compared between members: a reducer that tells members different things.

Every member checks the answers it gets against their accounts, but only its own entry in each;
a reducer can send each member an account in which that member's entry is true and another's is
forged (the same answer, the same signs: accounts.py), and nobody's check fails. But a reducer
signs each answer with its account (signatures.py). So after a round each member tells every
other sender of it, method "avg.answers" (unary), what it was told:
    header {"g": group_id}, payload: JSON [[reducer, chunk, answer digest, account digest,
    the reducer's signature], ...] (hex; one per answer it applied).
A member that applied an answer to the same chunk finds the two digests equal; two valid
signatures of the reducer over different ones for one chunk of one round prove it told members
different things: it is banned at once (`offences_equivocation`, `equivocations`). A summary
whose signature does not hold proves nothing (`answer_summaries_unproven`; a hostile leader may
also have sent the two members different groups).

It comes after the answers were applied, like accusations: it costs the round that part, and
the reducer every later round with the members that compared. What it does not cover: a sender
the reducer skipped (or sent a broken answer) never holds the account the others applied, so it
cannot check its own entry in it (docs/security.md).

Bounds: one summary per member and round, for one of the last `ROUNDS_KEPT` rounds this member
was in, from one of its senders not banned here, at most one item per chunk of the round (and
ITEM_BYTES each, checked before the JSON is read); signatures are checked only where digests
differ.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from ..net import Message, PeerTransport, RequestContext, TransportError
from .bans import BanList
from .group import Group
from .round_calls import RoundCalls
from .signatures import SIGNATURE_HEX, answer_digests_signed_by, round_name
from .wire import ChunkPlan, PeerFault

log = structlog.get_logger(__name__)

METHOD = "avg.answers"
ROUNDS_KEPT = 64
ITEM_BYTES = 320  # the most one item of a summary takes as JSON
CALL_TIMEOUT = 10.0

# (reducer, chunk) -> (the answer's digest, its account's digest, the reducer's signature)
Told = dict[tuple[int, int], tuple[bytes, bytes, str]]


@dataclass
class _Round:
    group: Group
    index: int
    told: Told  # what this member applied (filling as the round goes)
    heard: set[int] = field(default_factory=set)  # members whose summary came


class AnswerSummaries(RoundCalls[_Round]):
    """Sends this member's summary after each round and compares the ones it gets."""

    def __init__(self, transport: PeerTransport, bans: BanList,
                 counters: collections.Counter[str],
                 on_applied: Callable[[str, str, list[tuple[int, int, bytes]]], None] | None = None
                 ) -> None:
        super().__init__(transport, bans, counters, METHOD, self._handle, ROUNDS_KEPT)
        # told which answers a member applied (withheld.py: a member they were withheld from
        # asks it for the account)
        self._on_applied = on_applied

    def remember(self, group: Group, index: int, told: Told) -> None:
        """A round starts here: `told` fills with what we apply."""
        self._keep(group.group_id, _Round(group, index, told))

    def send(self, group: Group, index: int, told: Told) -> None:
        """Our round is over: tell every other sender what we were told (in the background)."""
        if not told:
            return
        items = [[j, c, answer.hex(), account.hex(), signature]
                 for (j, c), (answer, account, signature) in sorted(told.items())]
        message = Message({"g": group.group_id}, orjson.dumps(items))
        for m, member in enumerate(group.members):
            if m != index and member.sends:
                self._spawn(self._send(member.peer_id, message), f"allreduce-answers-{m}")

    async def _send(self, peer: str, message: Message) -> None:
        try:
            await self.transport.call(peer, METHOD, message, timeout=CALL_TIMEOUT)
        except (TransportError, TimeoutError) as exc:
            self._log.debug("allreduce_answers_not_delivered", to=peer, reason=str(exc)[:200])

    async def _handle(self, ctx: RequestContext, message: Message) -> Message:
        group_id = message.header.get("g")
        kept = self._rounds.get(group_id) if isinstance(group_id, str) else None
        members = kept.group.members if kept is not None else ()
        sender = next((i for i, m in enumerate(members) if m.peer_id == ctx.peer_id), None)
        if kept is None or sender is None or not members[sender].sends or sender in kept.heard \
                or self.bans.banned(ctx.peer_id) is not None \
                or len(message.payload) > ITEM_BYTES * _chunks(kept.group) + 2:
            self.counters["answer_summaries_refused"] += 1
            raise PeerFault(f"no summary of round {group_id} is taken from {ctx.peer_id} here")
        kept.heard.add(sender)
        try:
            items = orjson.loads(bytes(message.payload))
        except orjson.JSONDecodeError:
            items = None
        if not isinstance(items, list) or len(items) > _chunks(kept.group):
            self.counters["answer_summaries_malformed"] += 1
            raise PeerFault("a summary is a JSON list of [reducer, chunk, answer, account, "
                            "signature]")
        proven, applied = await asyncio.to_thread(self._compare, kept, sender, items)
        if self._on_applied is not None:
            self._on_applied(group_id, ctx.peer_id, applied)
        for j in proven:
            self.counters["equivocations"] += 1
            self.bans.offence(members[j].peer_id, "equivocation",
                              f"it signed two different answers or accounts for one chunk of round "
                              f"{group_id} (one to this member, one to {ctx.peer_id})",
                              conclusive=True)
        return Message({"equivocations": len(proven)})

    def _compare(self, kept: _Round, sender: int, items: list[Any]
                 ) -> tuple[list[int], list[tuple[int, int, bytes]]]:
        """The reducers proven to have told the summary's sender (member `sender`) otherwise
        than us, and the answers it says it applied (reducer, chunk, account digest), but those
        of its own part (no member applies an answer of its own part: a hostile reducer would
        claim one to serve an account of its choosing, withheld.py)."""
        name: str | None = None
        proven: set[int] = set()
        applied: list[tuple[int, int, bytes]] = []
        for item in items:
            parsed = _item(item)
            if parsed is None:
                self.counters["answer_summaries_malformed"] += 1
                continue
            j, c, answer, account, signature = parsed
            if j != sender:
                applied.append((j, c, account))
            mine = kept.told.get((j, c))
            if mine is None or (mine[0], mine[1]) == (answer, account) or j in proven \
                    or j >= len(kept.group.members):
                continue
            name = name or round_name(kept.group)
            if answer_digests_signed_by(kept.group.members[j].peer_id, name, j, c, answer,
                                        account, signature):
                proven.add(j)
            else:
                self.counters["answer_summaries_unproven"] += 1
        return sorted(proven), applied


def _chunks(group: Group) -> int:
    """Answers a member can apply in a round: every chunk of every part."""
    return sum(ChunkPlan(a, b, group.chunk_elements).count for a, b in group.part_bounds if b > a)


def _item(raw: Any) -> tuple[int, int, bytes, bytes, str] | None:
    if not isinstance(raw, list) or len(raw) != 5:
        return None
    j, c, answer, account, signature = raw
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in (j, c)):
        return None
    if not all(isinstance(x, str) and len(x) == 64 for x in (answer, account)) \
            or not isinstance(signature, str) or len(signature) != SIGNATURE_HEX:
        return None
    try:
        return j, c, bytes.fromhex(answer), bytes.fromhex(account), signature
    except ValueError:
        return None
