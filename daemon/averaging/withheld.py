"""Withheld answers: a sender its reducer skipped checks its entry in the account the others got.

A reducer can misstate one sender's contribution in the account that every other member gets
(the others' checks pass: each checks its own entry) and send that sender a `skip`, an aborted
stream or a broken signature instead of the answer: the sender then holds nothing signed to
accuse it with (accusations.py). But every member tells the other senders after the round which
answers it applied (answers.py). So a sender that sent a chunk and applied no answer to it asks a
member that applied one for what it got, method "avg.account" (unary):
    header {"g": group_id, "r": reducer, "c": chunk}
    -> header {"v": the account, "h": the answer's digest (hex), "a": the reducer's signature}
and judges its own entry in it with the chunk it sent, as any member judges an accusation
(accusations.judge, with the accuser's wider margin: a judge whose sums fall a little otherwise
still agrees). Where the reducer signed an account that misstates it, the sender bans the
reducer (`offences_forged_account`, counted as `withheld_forgeries`) and shows the others that
account as its accusation. An account that states it truly or one whose signature does not hold
proves nothing by itself: counted (`withheld_checked`, `withheld_unproven`) and nobody is
blamed. But the reducer may have signed more than one account for the chunk (one stating this
sender truly, for its accomplices or itself to serve, and the forged one the honest members
applied), so the sender goes on: the summaries name each member's account by its digest, and it
asks for every account digest claimed for the chunk until one is proven forged or each was
judged (a member whose account it judged is not asked again, nor is anyone for a digest it
judged). A member's summary that claims an answer of its own part is ignored (answers.py).

Bounds: accounts are kept (as their JSON bytes) for the last `ROUNDS_KEPT` rounds only (an
account is at most a frame header: 64 KiB a chunk); a member answers a sender of the round that
is not banned here, once per chunk; a sender keeps the chunks it got no answer to for the same
rounds and at most `MAX_KEPT_BYTES` of them in all (beyond that it does not check; a round's go
once `UNANSWERED_SECONDS` past its deadline, when another round needs the room), asks each
member at most once per chunk (so at most the group's size), `ASKS_AT_ONCE` at a time per
chunk, the digest most members claim first (accomplices that claim first and stall hold up no
honest member's answer), and stops asking about a reducer once it proved one forgery of it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import timebase
from ..net import Message, PeerTransport, RequestContext, TransportError
from .accounts import MisstatedContribution
from .accusations import Accusations, judge
from .bans import BanList
from .compression import get_codec
from .group import Group
from .round_calls import RoundCalls
from .signatures import account_digest
from .wire import ChunkPlan, PeerFault

METHOD = "avg.account"
ROUNDS_KEPT = 4
MAX_KEPT_BYTES = 64 << 20  # the unanswered chunks a sender keeps to check, in all
UNANSWERED_SECONDS = 120.0  # ... and for how long past their round's deadline, at least
CALL_TIMEOUT = 5.0
ASKS_AT_ONCE = 3  # calls under way per chunk (a member that stalls holds up no other)
# the accuser's margin against rounding (accounts.misstates): twice the judges'
ACCUSER_MARGIN = 1.0

Key = tuple[int, int]  # (reducer, chunk)


@dataclass
class _Round:
    group: Group
    index: int
    told: Mapping[Key, tuple[bytes, bytes, str]]  # what we applied (answers.Told)
    accounts: Mapping[Key, bytes]  # ... and the accounts that came with it (JSON)
    unanswered: dict[Key, tuple[bytes, dict[str, Any]]] = field(default_factory=dict)
    # per chunk, the account digests members said they applied, each with who said so
    claims: dict[Key, dict[bytes, list[str]]] = field(default_factory=dict)
    judged: dict[Key, set[bytes]] = field(default_factory=dict)  # account digests judged
    asked: dict[Key, set[str]] = field(default_factory=dict)  # members we asked, per chunk
    asking: dict[Key, int] = field(default_factory=dict)  # calls under way, per chunk
    settled: bool = False  # the round is over here: what went unanswered is known
    proven: set[int] = field(default_factory=set)  # reducers we proved a forgery of
    served: set[tuple[int, Key]] = field(default_factory=set)  # (member, chunk) answered


class WithheldAnswers(RoundCalls[_Round]):
    """Serves the accounts this member applied, and checks its own entry in those it was not
    sent (module docstring)."""

    def __init__(self, transport: PeerTransport, bans: BanList,
                 counters: collections.Counter[str], accusations: Accusations) -> None:
        super().__init__(transport, bans, counters, METHOD, self._handle, ROUNDS_KEPT)
        self._accusations = accusations

    def remember(self, group: Group, index: int, told: Mapping[Key, tuple[bytes, bytes, str]],
                 accounts: Mapping[Key, bytes]) -> None:
        """A round starts here: `told` and `accounts` fill with what we apply."""
        self._keep(group.group_id, _Round(group, index, told, accounts))

    def withheld(self, group_id: str, unanswered: Mapping[Key, tuple[Any, Mapping[str, Any]]]
                 ) -> None:
        """Our round is over: the chunks we sent (payload as it went out, meta) and applied no
        answer to. Kept (copied) within MAX_KEPT_BYTES; those another member said it applied are
        checked at once, the others as their summaries come."""
        kept = self._rounds.get(group_id)
        if kept is None:
            return
        now = timebase.now()
        for other in self._rounds.values():  # (their summaries came long ago: room for ours)
            if other.group.deadline + UNANSWERED_SECONDS < now:
                other.unanswered.clear()
        kept.settled = True
        room = MAX_KEPT_BYTES - sum(len(p) for r in self._rounds.values()
                                    for p, _ in r.unanswered.values())
        for key, (payload, meta) in sorted(unanswered.items()):
            if self.bans.banned(kept.group.members[key[0]].peer_id) is not None:
                continue  # (proven in the round already: its wrong answer, our accusation)
            size = memoryview(payload).nbytes
            if size > room:
                self.counters["withheld_not_kept"] += 1
                continue
            room -= size
            kept.unanswered[key] = (bytes(memoryview(payload).cast("B")), dict(meta))
        kept.claims = {k: v for k, v in kept.claims.items() if k in kept.unanswered}
        for key in list(kept.unanswered):
            self._ask_next(kept, key)

    def applied(self, group_id: str, peer: str, items: Iterable[tuple[int, int, bytes]]) -> None:
        """A member's summary says it applied these answers: (reducer, chunk, the account's
        digest) each (answers.py)."""
        kept = self._rounds.get(group_id)
        if kept is None:
            return
        for j, c, digest in items:
            if (j, c) in kept.told or (kept.settled and (j, c) not in kept.unanswered):
                continue  # (we hold that answer, or need it no more)
            claimed = kept.claims.setdefault((j, c), {})
            if all(peer not in peers for peers in claimed.values()):  # (one claim a member)
                claimed.setdefault(digest, []).append(peer)
            if (j, c) in kept.unanswered:
                self._ask_next(kept, (j, c))

    def _ask_next(self, kept: _Round, key: Key) -> None:
        """Ask members for the account digests claimed for `key` that are not judged yet, the
        digest most members claim first (the one the honest members applied, unless accomplices
        outnumber them), up to ASKS_AT_ONCE calls at once."""
        if key[0] in kept.proven:
            return
        asked, judged = kept.asked.setdefault(key, set()), kept.judged.get(key, set())
        claimed = sorted(kept.claims.get(key, {}).items(), key=lambda item: -len(item[1]))
        for peer in [p for digest, peers in claimed if digest not in judged for p in peers]:
            if kept.asking.get(key, 0) >= ASKS_AT_ONCE:
                return
            if peer not in asked:
                asked.add(peer)
                kept.asking[key] = kept.asking.get(key, 0) + 1
                self._spawn(self._ask(kept, key, peer), f"allreduce-withheld-{key[0]}-{key[1]}")

    async def _ask(self, kept: _Round, key: Key, peer: str) -> None:
        try:
            proof = await self._judged(kept, key, peer)
        except (TransportError, TimeoutError, PeerFault, ValueError, TypeError) as exc:
            # (TypeError: an account JSON carries but cannot write back, nested too deep)
            self._log.debug("allreduce_withheld_not_asked", to=peer, reason=str(exc)[:200])
            proof = None
        finally:
            kept.asking[key] -= 1
        j = key[0]
        if proof is not None and j not in kept.proven:
            kept.proven.add(j)
            self.counters["withheld_forgeries"] += 1
            self.bans.offence(kept.group.members[j].peer_id, "forged_account",
                              f"{proof} (its answer was withheld from that member)",
                              conclusive=True)
            self._accusations.accuse(kept.group, kept.index, j, proof)
            for other in [k for k in kept.unanswered if k[0] == j]:
                del kept.unanswered[other]
        elif key in kept.unanswered:  # the next account claimed, or the next member claiming it
            self._ask_next(kept, key)

    async def _judged(self, kept: _Round, key: Key, peer: str) -> MisstatedContribution | None:
        """Ask `peer` for the account it applied to `key` and judge our entry in it: the proof
        where the reducer signed one that misstates us (else None; PeerFault for a bad reply)."""
        j, c = key
        reply = await self.transport.call(
            peer, METHOD, Message({"g": kept.group.group_id, "r": j, "c": c}), timeout=CALL_TIMEOUT)
        entry, answer = kept.unanswered.get(key), reply.header.get("h")
        if entry is None or j in kept.proven:
            return None
        if not isinstance(answer, str) or len(answer) != 64:
            raise PeerFault("an account reply without the answer's digest")
        payload, meta = entry
        digest = bytes.fromhex(answer)
        account, signature = reply.header.get("v"), reply.header.get("a")
        verdict, why = await asyncio.to_thread(
            judge, kept.group, accuser=kept.index, reducer=j, chunk=c, meta=meta, payload=payload,
            account=account, answer=digest, signature=signature,
            codec=get_codec(kept.group.compression), margin=ACCUSER_MARGIN)
        if verdict == "forged":
            return MisstatedContribution(why, c, payload, meta, account, digest, signature)
        if verdict == "false":  # this account states our chunk truly (the reducer may have
            # signed another for the others: their digests are asked next)
            self.counters["withheld_checked"] += 1
            kept.judged.setdefault(key, set()).add(account_digest(account))
        else:
            self.counters["withheld_unproven"] += 1
        return None

    async def _handle(self, ctx: RequestContext, message: Message) -> Message:
        header = message.header
        group_id, j, c = header.get("g"), header.get("r"), header.get("c")
        kept = self._rounds.get(group_id) if isinstance(group_id, str) else None
        members = kept.group.members if kept is not None else ()
        asker = next((i for i, m in enumerate(members) if m.peer_id == ctx.peer_id), None)
        if kept is None or asker is None or not members[asker].sends \
                or self.bans.banned(ctx.peer_id) is not None:
            self.counters["withheld_refused"] += 1
            raise PeerFault(f"no round {group_id} here in which {ctx.peer_id} sent")
        if not (_index(j) and _index(c) and j < len(members)) or (asker, (j, c)) in kept.served:
            self.counters["withheld_refused"] += 1
            raise PeerFault("ask once per chunk: {\"g\": group, \"r\": reducer, \"c\": chunk}")
        a, b = kept.group.part_bounds[j]
        if c >= ChunkPlan(a, b, kept.group.chunk_elements).count:
            self.counters["withheld_refused"] += 1
            raise PeerFault(f"member {j}'s part has no chunk {c}")
        kept.served.add((asker, (j, c)))
        told, account = kept.told.get((j, c)), kept.accounts.get((j, c))
        if told is None or account is None:
            raise PeerFault(f"no answer of member {j} to chunk {c} was applied here")
        return Message({"v": orjson.loads(account), "h": told[0].hex(), "a": told[2]})


def _index(raw: Any) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 1 << 31
