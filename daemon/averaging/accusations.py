"""Accusations: a member shows the other members that a reducer misstated its contribution.

A reducer's account states every contribution it averaged, each with its sender's signature of
the contribution's digest (accounts.py, signatures.py). Every member checks its own entry; the
others cannot. A reducer can therefore make a wrong answer agree with its account by misstating
another sender's projection: that sender refuses the answer, the others apply it. So the sender
tells them, method "avg.accuse" (unary):
    header {"g": group_id, "r": the reducer's member index, "c": the chunk,
            "m": the codec meta of the sender's chunk as it went out},
    payload: the chunk as it went out.
The accuser is the link's peer. Each member that applied that answer judges it (`judge`) against
the account it got itself:
- the payload hashes to the digest its entry names (which the accuser signed) and measures
  otherwise than the entry states: the reducer forged its account. It is banned at once
  (`offences_forged_account`, `forged_accounts`);
- the payload does not hash to that digest: the accuser shows another chunk than the one it
  signed, which no honest peer does (`offences_false_accusation`, banned at once);
- the entry states the payload truly, or the account this member got does not list the accuser:
  nothing is proven (the reducer may have sent the accuser another account than this member's;
  counted as `accusations_unfounded`).
The answer was applied already (the accusation comes after it): a forged account costs the
round that part, and the reducer every later round with this member.

Bounds: an accusation is judged only for a round this member took part in (the last
`ROUNDS_KEPT`), from one of its senders, for an answer this member applied, once per sender and
chunk, with a payload no larger than the codec's for that chunk; a judgement runs in a thread.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from .. import timebase
from ..net import Message, PeerTransport, RequestContext, TransportError
from .accounts import Entry, MisstatedContribution, measure, misstates, signs_of
from .bans import BanList
from .compression import Codec, CompressionError, get_codec
from .group import Group
from .signatures import contribution_digest
from .wire import ChunkPlan, PeerFault

log = structlog.get_logger(__name__)

METHOD = "avg.accuse"
# rounds whose applied answers can still be judged (an accusation comes within seconds; each
# round's entries are ~300 bytes per sender and chunk)
ROUNDS_KEPT = 8
CALL_TIMEOUT = 10.0

Verdict = Literal["forged", "false", "unfounded"]


@dataclass(frozen=True)
class Applied:
    """What a member applied of a reducer's answer to one chunk: the account's entries and the
    answer's digest (its signs, accounts.signs_of), over the chunk's segments."""

    entries: tuple[Entry, ...]
    answer: bytes
    parts: tuple[tuple[int, int], ...]


def judge(applied: Applied, *, accuser: int, group_id: str, reducer: int, chunk: int,
          meta: Mapping[str, Any], payload: Any, codec: Codec) -> tuple[Verdict, str]:
    """Whether the accuser's chunk (`payload`, `meta`, as it says it sent it) proves that the
    account this member applied misstated it."""
    entry = next((e for e in applied.entries if e.sender == accuser), None)
    if entry is None:
        return "unfounded", "the account applied here does not list the accuser"
    digest = contribution_digest(group_id, reducer, chunk, meta, payload).hex()
    if digest != entry.digest:
        return "false", ("the accuser shows another chunk than the one it signed (the account "
                         "names its signature of another digest)")
    n = applied.parts[-1][1]
    try:
        values = codec.decode(payload, dict(meta), n)
    except CompressionError as exc:  # the reducer decoded it: one that does not decode is not it
        return "false", f"the accuser's chunk does not decode: {exc}"
    projections, norm = measure(signs_of(applied.answer, n), values, applied.parts)
    if misstates(entry, projections, norm, n):
        return "forged", (f"the reducer's account misstates member {accuser}'s contribution to "
                          f"chunk {chunk}, which that member proved with the chunk it signed")
    return "unfounded", "the account applied here states the accuser's contribution truly"


@dataclass
class _Round:
    group: Group
    index: int
    applied: dict[tuple[int, int], Applied]  # (reducer, chunk) -> what was applied (filling)
    over: asyncio.Event  # the round has ended here
    heard: set[tuple[int, int, int]] = field(default_factory=set)  # (accuser, reducer, chunk)


class Accusations:
    """Sends this member's accusations and judges the ones it gets (module docstring)."""

    def __init__(self, transport: PeerTransport, bans: BanList,
                 counters: collections.Counter[str]) -> None:
        self.transport = transport
        self.bans = bans
        self.counters = counters
        self._rounds: collections.OrderedDict[str, _Round] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = log.bind(peer_id=transport.peer_id)
        transport.add_unary_handler(METHOD, self._handle)

    def remember(self, group: Group, index: int, applied: dict[tuple[int, int], Applied],
                 over: asyncio.Event) -> None:
        """A round starts here: `applied` fills as its answers are applied, `over` is set when
        it ends."""
        self._rounds[group.group_id] = _Round(group, index, applied, over)
        while len(self._rounds) > ROUNDS_KEPT:
            self._rounds.popitem(last=False)

    def accuse(self, group: Group, index: int, reducer: int, proof: MisstatedContribution) -> None:
        """Show every other sender of the round that `reducer` misstated our chunk (in the
        background: the round does not wait)."""
        if proof.payload is None or proof.chunk < 0:
            return
        header = {"g": group.group_id, "r": reducer, "c": proof.chunk, "m": dict(proof.meta)}
        message = Message(header, bytes(memoryview(proof.payload).cast("B")))
        for m, member in enumerate(group.members):
            if m not in (index, reducer) and member.sends:
                task = asyncio.get_running_loop().create_task(
                    self._send(member.peer_id, message), name=f"allreduce-accuse-{m}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

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
        if not isinstance(group_id, str) or not _index(reducer) or not _index(chunk) \
                or not isinstance(meta, dict):
            self.counters["accusations_malformed"] += 1
            raise PeerFault("an accusation is {\"g\": group, \"r\": reducer, \"c\": chunk, "
                            "\"m\": meta} with the chunk as payload")
        kept = self._rounds.get(group_id)
        members = kept.group.members if kept is not None else ()
        accuser = next((i for i, m in enumerate(members) if m.peer_id == ctx.peer_id), None)
        if kept is None or accuser is None or not members[accuser].sends \
                or reducer >= len(members) or reducer in (accuser, kept.index):
            self.counters["accusations_refused"] += 1
            raise PeerFault(f"no round {group_id} here in which {ctx.peer_id} sent to member "
                            f"{reducer}")
        if (accuser, reducer, chunk) in kept.heard:
            self.counters["accusations_refused"] += 1
            raise PeerFault("this chunk's accusation was heard already")
        a, b = kept.group.part_bounds[reducer]
        plan = ChunkPlan(a, b, kept.group.chunk_elements)
        codec = get_codec(kept.group.compression)
        if chunk >= plan.count or len(message.payload) > codec.max_payload_bytes(
                plan.relative(chunk)[1] - plan.relative(chunk)[0]):
            self.counters["accusations_refused"] += 1
            raise PeerFault(f"member {reducer}'s part has no chunk {chunk}, or not one that large")
        kept.heard.add((accuser, reducer, chunk))
        if (reducer, chunk) not in kept.applied and not kept.over.is_set():
            # (the accuser got its answer before this member got the same one)
            left = kept.group.deadline - timebase.now() + 1.0
            try:
                async with asyncio.timeout(max(0.0, left)):
                    await kept.over.wait()
            except TimeoutError:
                pass
        applied = kept.applied.get((reducer, chunk))
        if applied is None:
            self.counters["accusations_unfounded"] += 1
            return Message({"verdict": "unfounded", "why": "this member did not apply that answer"})
        verdict, why = await asyncio.to_thread(
            judge, applied, accuser=accuser, group_id=group_id, reducer=reducer, chunk=chunk,
            meta=meta, payload=message.payload, codec=codec)
        self._act(kept.group, accuser, reducer, verdict, why)
        return Message({"verdict": verdict, "why": why})

    def _act(self, group: Group, accuser: int, reducer: int, verdict: Verdict, why: str) -> None:
        if verdict == "forged":
            self.counters["forged_accounts"] += 1
            self.bans.offence(group.members[reducer].peer_id, "forged_account", why, conclusive=True)
        elif verdict == "false":
            self.counters["accusations_false"] += 1
            self.bans.offence(group.members[accuser].peer_id, "false_accusation", why, conclusive=True)
        else:
            self.counters["accusations_unfounded"] += 1

    def close(self) -> None:
        """Stop the accusations under way (the service is closing)."""
        for task in list(self._tasks):
            task.cancel()


def _index(raw: Any) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 1 << 31

