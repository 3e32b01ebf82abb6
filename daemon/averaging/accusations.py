"""Accusations: a member shows the other members that a reducer misstated its contribution.

A reducer's account states every contribution it averaged, each with its sender's signature of
the contribution's digest, and the reducer signs the answer and its account (accounts.py,
signatures.py). Every member checks its own entry; the others cannot. A reducer can therefore
make a wrong answer agree with its account by misstating another sender's projections, or send
each member an account in which only that member's entry is true: the misstated sender refuses
the answer, the others apply it. So the sender shows them, method "avg.accuse" (unary):
    header {"g": group_id, "r": the reducer's member index, "c": the chunk,
            "m": the codec meta of the sender's chunk as it went out,
            "v": the account it got, "h": the answer's digest (hex, accounts.answer_digest),
            "a": the reducer's signature of both},
    payload: the chunk as it went out.
The accuser is the link's peer. A member of that round judges it (`judge`) on that evidence
alone, whatever account it got itself:
- the reducer signed that account, whose entry for the accuser names the digest of the
  accuser's chunk and states other projections or another norm than that chunk has: the
  reducer forged its account. It is banned at once (`offences_forged_account`,
  `forged_accounts`);
- an account whose signature does not hold for this round as this member knows it: nothing is
  proven (`accusations_unproven`): the accuser may have forged it, or a hostile leader may have
  sent this member another group than the accuser's;
- anything else (an entry for another chunk or none, an entry that states the chunk truly, to
  within half the rounding margin the accuser's own check allows): no honest member accuses so,
  the accuser is banned at once (`offences_false_accusation`, `accusations_false`). An honest
  member accuses only once its own check found its entry, with the digest of what it sent,
  misstated in an answer whose signature it checked.
The answer was applied already where the accusation comes (it comes after it): a forged account
costs the round that part, and the reducer every later round with these members.

Bounds: an accusation is judged only for a round this member was in (the last `ROUNDS_KEPT`),
from one of its senders that is not banned here, once per accuser and reducer (an honest one
stops at its reducer's first wrong answer), with a payload no larger than the codec's for that
chunk; a judgement runs in a thread.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from ..net import Message, PeerTransport, RequestContext, TransportError
from .accounts import (
    MisstatedContribution,
    WrongAverage,
    measure,
    misstates,
    parse_account,
    segments,
    signs_of,
)
from .bans import BanList
from .codec import Codec, CompressionError
from .compression import get_codec
from .group import Group
from .round_calls import RoundCalls
from .signatures import answer_signed_by, contribution_digest, round_name
from .wire import ChunkPlan, PeerFault

log = structlog.get_logger(__name__)

METHOD = "avg.accuse"
ROUNDS_KEPT = 64  # rounds whose accusations are still judged here (a group each: small)
CALL_TIMEOUT = 10.0

Verdict = Literal["forged", "false", "unproven"]


def judge(group: Group, *, accuser: int, reducer: int, chunk: int, meta: Mapping[str, Any],
          payload: Any, account: Any, answer: bytes, signature: Any, codec: Codec,
          margin: float = 0.5) -> tuple[Verdict, str]:
    """Whether the evidence proves that reducer `reducer` misstated member `accuser`'s chunk
    (module docstring): "forged"; "false" where the accuser showed what no honest member does;
    "unproven" where the reducer's signature does not hold here (a forgery of the accuser's, or
    a group that a hostile leader sent this member otherwise than the accuser: nobody is
    blamed). `margin`: against rounding (accounts.misstates), half the accuser's for a judge;
    an accuser judging for itself (withheld.py) passes its own."""
    name = round_name(group)
    if not answer_signed_by(group.members[reducer].peer_id, name, reducer, chunk, answer, account,
                            signature):
        return "unproven", "the account it shows is not signed by its reducer for this round"
    a, b = group.part_bounds[reducer]
    first, last = ChunkPlan(a, b, group.chunk_elements).relative(chunk)
    n = last - first
    senders = sum(1 for m in group.members if m.sends)
    parts = segments(n, senders)
    try:
        entries, _ = parse_account(account, senders, len(parts))
    except WrongAverage as exc:  # the reducer signed it: its own fault
        return "forged", f"the reducer signed a malformed account: {exc}"
    entry = next((e for e in entries if e.sender == accuser), None)
    if entry is None:
        return "false", "the account it shows does not list it"
    try:
        digest = contribution_digest(group.group_id, reducer, chunk, meta, payload).hex()
    except (TypeError, ValueError):  # a meta JSON cannot write: not what any reducer took
        return "false", "it shows a chunk whose meta cannot be hashed"
    if digest != entry.digest:
        return "false", "it shows another chunk than the one the account names"
    try:
        values = codec.decode(payload, dict(meta), n)
    except CompressionError as exc:  # the reducer decoded it: one that does not decode is not it
        return "false", f"its chunk does not decode: {exc}"
    projections, norm = measure(signs_of(answer, n), values, parts)
    if misstates(entry, projections, norm, n, margin=margin):
        return "forged", (f"the reducer's signed account misstates member {accuser}'s contribution "
                          f"to chunk {chunk}, which that member proved with the chunk it signed")
    return "false", "the account it shows states its chunk truly"


@dataclass
class _Round:
    group: Group
    index: int
    heard: set[tuple[int, int]] = field(default_factory=set)  # (accuser, reducer)


class Accusations(RoundCalls[_Round]):
    """Sends this member's accusations and judges the ones it gets (module docstring)."""

    def __init__(self, transport: PeerTransport, bans: BanList,
                 counters: collections.Counter[str]) -> None:
        super().__init__(transport, bans, counters, METHOD, self._handle, ROUNDS_KEPT)

    def remember(self, group: Group, index: int) -> None:
        """A round starts here: accusations of its reducers may come."""
        self._keep(group.group_id, _Round(group, index))

    def accuse(self, group: Group, index: int, reducer: int, proof: MisstatedContribution) -> None:
        """Show every other sender of the round that `reducer` misstated our chunk (in the
        background: the round does not wait)."""
        if proof.payload is None or proof.answer is None:
            return
        header = {"g": group.group_id, "r": reducer, "c": proof.chunk, "m": dict(proof.meta),
                  "v": proof.account, "h": proof.answer.hex(), "a": proof.signature}
        message = Message(header, bytes(memoryview(proof.payload).cast("B")))
        for m, member in enumerate(group.members):
            if m not in (index, reducer) and member.sends:
                self._spawn(self._send(member.peer_id, message), f"allreduce-accuse-{m}")

    async def _send(self, peer: str, message: Message) -> None:
        self.counters["accusations_sent"] += 1
        try:
            answer = await self.transport.call(peer, METHOD, message, timeout=CALL_TIMEOUT)
        except (TransportError, TimeoutError) as exc:
            self._log.info("allreduce_accusation_not_delivered", to=peer, reason=str(exc)[:200])
            return
        self._log.info("allreduce_accusation_judged", by=peer, verdict=answer.header.get("verdict"))

    async def _handle(self, ctx: RequestContext, message: Message) -> Message:
        header = message.header
        group_id, reducer, chunk, meta = (header.get("g"), header.get("r"), header.get("c"),
                                          header.get("m", {}))
        answer = header.get("h")
        if not isinstance(group_id, str) or not _index(reducer) or not _index(chunk) \
                or not isinstance(meta, dict) or not isinstance(answer, str) or len(answer) != 64:
            self.counters["accusations_malformed"] += 1
            raise PeerFault("an accusation is {\"g\": group, \"r\": reducer, \"c\": chunk, \"m\": "
                            "meta, \"v\": account, \"h\": answer digest, \"a\": signature} with "
                            "the chunk as payload")
        kept = self._rounds.get(group_id)
        members = kept.group.members if kept is not None else ()
        accuser = next((i for i, m in enumerate(members) if m.peer_id == ctx.peer_id), None)
        if kept is None or accuser is None or not members[accuser].sends \
                or reducer >= len(members) or reducer in (accuser, kept.index) \
                or not kept.group.part_bounds[reducer][1] > kept.group.part_bounds[reducer][0]:
            self.counters["accusations_refused"] += 1
            raise PeerFault(f"no round {group_id} here in which {ctx.peer_id} sent to member "
                            f"{reducer}")
        if self.bans.banned(ctx.peer_id) is not None or (accuser, reducer) in kept.heard:
            self.counters["accusations_refused"] += 1
            raise PeerFault("an accusation of this reducer was heard already, or this peer is "
                            "banned here")
        a, b = kept.group.part_bounds[reducer]
        plan = ChunkPlan(a, b, kept.group.chunk_elements)
        codec = get_codec(kept.group.compression)
        if chunk >= plan.count or len(message.payload) > codec.max_payload_bytes(
                plan.relative(chunk)[1] - plan.relative(chunk)[0]):
            self.counters["accusations_refused"] += 1
            raise PeerFault(f"member {reducer}'s part has no chunk {chunk}, or not one that large")
        try:
            digest = bytes.fromhex(answer)
        except ValueError:
            self.counters["accusations_malformed"] += 1
            raise PeerFault("an accusation's answer digest is not hex") from None
        kept.heard.add((accuser, reducer))
        verdict, why = await asyncio.to_thread(
            judge, kept.group, accuser=accuser, reducer=reducer, chunk=chunk, meta=meta,
            payload=message.payload, account=header.get("v"), answer=digest,
            signature=header.get("a"), codec=codec)
        self._act(kept.group, accuser, reducer, verdict, why)
        return Message({"verdict": verdict, "why": why})

    def _act(self, group: Group, accuser: int, reducer: int, verdict: Verdict, why: str) -> None:
        if verdict == "forged":
            self.counters["forged_accounts"] += 1
            self.bans.offence(group.members[reducer].peer_id, "forged_account", why, conclusive=True)
        elif verdict == "unproven":
            self.counters["accusations_unproven"] += 1
        else:
            self.counters["accusations_false"] += 1
            self.bans.offence(group.members[accuser].peer_id, "false_accusation", why, conclusive=True)


def _index(raw: Any) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 1 << 31
