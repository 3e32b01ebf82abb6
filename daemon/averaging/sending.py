"""A round's sender role: stream part j of our vector to reducer j, write its averages back.

`PartSender.exchange(j)` opens the stream to reducer j (wire.py), pushes the chunks (encoding the
next one while the current one goes) and writes each averaged chunk that comes back straight into
the vector. A reducer that fails leaves its remaining chunks local: `outcome(j)` says, per chunk,
whether it was averaged and why not. The round (butterfly.py) owns the tasks, the deadline and the
thread pool's jobs; this is only the sending half of its state.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..identity import Identity
from ..net import (
    Message,
    PeerTransport,
    PeerUnreachableError,
    Stream,
    StreamAborted,
    TransportClosed,
    TransportError,
)
from .accounts import (
    ACCOUNT_KEY,
    CLIPPED,
    MisstatedContribution,
    WrongAverage,
    answer_digest,
    check_answer,
    check_signatures,
    measure,
    parse_account,
    segments,
    signs_of,
)
from .aggregation import Aggregation
from .audits import Applied
from .bans import BanList
from .codec import Buffer, Codec, CompressionError, Meta
from .corruption import SenderCorruption
from .group import Group
from .jobs import ChunkJobs
from .report import TransferLog
from .signatures import (
    ANSWER_SIGNATURE_KEY,
    LEADER_SIGNATURE_KEY,
    ROUND_KEY,
    SIGNATURE_KEY,
    account_digest,
    account_json,
    answer_digests_signed_by,
    check_round_tag,
    contribution_digest,
    sign,
)
from .wire import (
    METHOD,
    NOT_STARTED_PATIENCE,
    ChunkPlan,
    PeerFault,
    StreamOpen,
    chunk_header,
    parse_chunk,
    says_not_started,
    says_slot_taken,
)

FAULTS = (TransportError, PeerFault, CompressionError)
RETRY_SECONDS = (0.05, 1.0)  # the first and the longest wait before opening a refused stream again


def leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def describe(error: BaseException) -> str:
    return f"{type(leaf(error)).__name__}: {leaf(error)}"


def receive_buffer(size: int) -> memoryview:
    """A receive buffer (not zero-filled: the transport writes every byte before we read it)."""
    return memoryview(np.empty(size, np.uint8))


@dataclass
class PartSender:
    transport: PeerTransport
    group: Group
    index: int
    weight: float
    vector: np.ndarray
    codec: Codec  # what our chunks go out in
    reply: Codec  # what the reducers' averages come back in
    plans: dict[int, ChunkPlan]
    jobs: ChunkJobs
    traffic: TransferLog
    left: Callable[[], float]  # the per-operation timeout (butterfly.Round._left)
    on_link_lost: Callable[[int, str], None]  # reducer j's link is gone: it cannot send to us either
    log: Any
    corruption: str | None = None  # tests only (corruption.py): how our chunks go out bad
    check: bool = False  # check each answer against its reducer's account before applying it
    accept_clipped: bool = False  # take answers aggregated by centered clipping (not checkable)
    aggregation: Aggregation = "mean"  # the round's rule, which the answers are checked against
    # reducer j contradicted its account (or misstated ours: the error holds our proof)
    on_wrong_average: Callable[[int, str, WrongAverage], None] | None = None
    weights: Sequence[float] | None = None  # each member's weight in the round (its claim if None)
    identity: Identity | None = None  # signs each chunk we send (signatures.py) where we check
    round_name: str = ""  # what signatures name the round by (signatures.round_name)
    counters: Counter[str] = field(default_factory=Counter)  # the all-reduce's (group_mismatches)
    bans: BanList | None = None  # where a leader proven to have signed two groups is banned
    # the reducers we send to, which averaged chunks came back, why others did not
    targets: list[int] = field(init=False)
    got: dict[int, list[bool]] = field(init=False)
    skipped: dict[tuple[int, int], str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    # what we sent and its digest, until its answer is checked (lossy codecs: the reducer
    # averaged the decoded; a misstated answer: it is our proof, accusations.py)
    sent: dict[tuple[int, int], tuple[Buffer, Meta, bytes | None]] = field(default_factory=dict)
    # what we applied of each (reducer, chunk), for auditing reducers after the round (audits.py)
    applied: dict[tuple[int, int], Applied] = field(default_factory=dict)
    # ... and what its reducer signed, for comparing with the other members (answers.py)
    told: dict[tuple[int, int], tuple[bytes, bytes, str]] = field(default_factory=dict)
    # ... and the accounts themselves, for a member its reducer skipped (withheld.py)
    accounts: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (as JSON)
    retries: int = 0  # streams opened again after a RoundNotStarted refusal

    def __post_init__(self) -> None:
        self.targets = [j for j in self.plans if j != self.index] \
            if self.group.members[self.index].sends else []
        self.got = {j: [False] * self.plans[j].count for j in self.targets}

    def outcome(self, j: int) -> list[tuple[bool, str]] | None:
        """Per chunk of part j: averaged here?, and why not (None: we do not send to j)."""
        if j not in self.got:
            return None
        default = self.errors.get(j, "deadline passed")
        return [(self.got[j][c], self.skipped.get((j, c), default)) for c in range(self.plans[j].count)]

    async def exchange(self, j: int) -> None:
        """Send part j to reducer j and take its averages back. A reducer that refuses the
        stream because its round has not started there and it has no slot for the stream to wait
        in (wire.RoundNotStarted) is asked again, every `RETRY_SECONDS` at most, for up to
        `NOT_STARTED_PATIENCE` seconds, and until the round's deadline after a refusal that says
        the stream lost the slot it held (`wire.SLOT_TAKEN`)."""
        patience_ends = asyncio.get_running_loop().time() + NOT_STARTED_PATIENCE
        delay = RETRY_SECONDS[0]
        while not await self._exchange_once(j, patience_ends):
            self.retries += 1
            await asyncio.sleep(min(delay, max(0.0, self.left())))
            delay = min(delay * 2, RETRY_SECONDS[1])

    async def _exchange_once(self, j: int, patience_ends: float) -> bool:
        """One stream to reducer j; False when it should be opened again."""
        peer = self.group.members[j].peer_id
        plan = self.plans[j]
        stream: Stream | None = None
        reason = "round over"
        clean = again = False
        try:
            opened = StreamOpen(self.group.group_id, self.index, self.weight, self.group.deadline,
                                self.round_name, self.group.leader_signature)
            stream = await self.transport.open_stream(peer, METHOD, opened.header(), timeout=self.left())
            self.traffic.start(peer)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._push(stream, plan, peer, j))
                tg.create_task(self._pull(stream, plan, j, peer))
            clean = True
        except* FAULTS as errors:
            reason = describe(errors)
            # (a stream that held a waiting slot and lost it was not late: asked again until the
            # deadline)
            if isinstance(leaf(errors), StreamAborted) and says_not_started(leaf(errors)) \
                    and not any(self.got[j]) and not any(key[0] == j for key in self.skipped) \
                    and (asyncio.get_running_loop().time() < patience_ends
                         or says_slot_taken(leaf(errors))) and self.left() > 0:
                self.log.debug("allreduce_reducer_not_started", reducer=peer)
                again = True
            else:
                self.errors[j] = reason
                self.log.info("allreduce_reducer_failed", reducer=peer, reason=reason)
                wrong = leaf(errors)
                if isinstance(wrong, WrongAverage) and self.on_wrong_average is not None:
                    self.on_wrong_average(j, reason, wrong)
                if isinstance(leaf(errors), TransportClosed | PeerUnreachableError):
                    self.on_link_lost(j, f"link lost: {reason}")
        finally:
            if stream is not None and not clean:
                await stream.abort(reason)
        return not again

    def _encode(self, plan: ChunkPlan, j: int, c: int
                ) -> asyncio.Future[tuple[Buffer, Meta, bytes | None, str | None]]:
        a, b = plan.absolute(c)
        return self.jobs.submit(b - a, self._encode_signed, j, c, self.vector[a:b])

    def _encode_signed(self, j: int, c: int, values: np.ndarray
                       ) -> tuple[Buffer, Meta, bytes | None, str | None]:
        """Chunk c of part j as it goes out, its digest and our signature of it (None, None
        where we do not check answers, or have no identity to sign with)."""
        if self.corruption is not None:
            payload, meta = SenderCorruption.encode(self.corruption, self.codec, values)
        else:
            payload, meta = self.codec.encode(values)
        if not self.check or self.identity is None:
            return payload, meta, None, None
        digest = contribution_digest(self.group.group_id, j, c, meta, payload)
        return payload, meta, digest, sign(self.identity, self.round_name, j, c, digest)

    async def _push(self, stream: Stream, plan: ChunkPlan, peer: str, j: int) -> None:
        upcoming = self._encode(plan, j, 0)
        for c in range(plan.count):
            payload, meta, digest, signature = await asyncio.shield(upcoming)
            if self.check:
                self.sent[(j, c)] = (payload, meta, digest)
            if c + 1 < plan.count:
                upcoming = self._encode(plan, j, c + 1)  # encode the next chunk while this one goes
            header = chunk_header(c, meta)
            if signature is not None:
                header[SIGNATURE_KEY] = signature
                header[ROUND_KEY] = self.round_name
                header[LEADER_SIGNATURE_KEY] = self.group.leader_signature
            await stream.send(Message(header, payload), timeout=self.left())
            self.traffic.sent(peer, len(payload))
        await stream.close()

    async def _pull(self, stream: Stream, plan: ChunkPlan, j: int, peer: str) -> None:
        scratch = receive_buffer(self.reply.max_payload_bytes(plan.largest))
        for c in range(plan.count):
            message = await stream.receive_into(scratch, timeout=self.left())
            if message is None:
                raise PeerFault(f"the reducer closed its stream after {c} of {plan.count} chunks")
            skip = message.header.get("skip")
            if skip is not None and message.header.get("c") == c:
                self.skipped[(j, c)] = f"not averaged by the reducer: {str(skip)[:200]}"
                continue
            meta = parse_chunk(message.header, c, plan.count)
            self.traffic.received(peer, len(message.payload))
            if self.check and ANSWER_SIGNATURE_KEY in message.header:
                check_round_tag(message.header, self.group, self.round_name, "reducer",
                                self.counters, self.bans, self.transport.peer_id)
            a, b = plan.absolute(c)
            await self.jobs.run(b - a, self._take_average, j, c, message.payload, meta,
                                message.header.get(ACCOUNT_KEY), message.header.get(ANSWER_SIGNATURE_KEY))

    def _take_average(self, j: int, c: int, payload: Buffer, meta: Meta, account: Any,
                      signature: Any) -> None:
        a, b = self.plans[j].absolute(c)
        if not self.check or (account == CLIPPED and self.accept_clipped):
            self.reply.decode(payload, meta, b - a, out=self.vector[a:b])
        else:
            answer = self.reply.decode(payload, meta, b - a, out=np.empty(b - a, np.float32))
            self._check(j, c, payload, meta, account, signature, answer)
            np.copyto(self.vector[a:b], answer)
        self.got[j][c] = True

    def _check(self, j: int, c: int, payload: Buffer, meta: Meta, account: Any, signature: Any,
               answer: np.ndarray) -> None:
        """WrongAverage unless reducer j's answer to chunk c agrees with its account (accounts.py);
        nothing of it has been written into the vector yet."""
        if account == CLIPPED:
            raise WrongAverage("the reducer aggregates by centered clipping, which no account can "
                               "check and this member does not take (averaging.robust_aggregation)")
        if account is None:
            raise WrongAverage("the reducer's answer comes without an account")
        members = self.group.members
        senders = sum(1 for m in members if m.sends)
        a, b = self.plans[j].absolute(c)
        parts = segments(b - a, senders)
        entries, errors = parse_account(account, senders, len(parts))
        digest = answer_digest(self.group.group_id, j, c, meta, payload, [e.digest for e in entries])
        encoded = account_json(account)  # (kept below: encoded once)
        told = account_digest(account, encoded)
        if not answer_digests_signed_by(members[j].peer_id, self.round_name, j, c, digest, told,
                                        signature):
            raise WrongAverage("the answer and its account are not signed by their reducer")
        r = signs_of(digest, b - a)
        projections, norm = measure(r, answer, parts)
        mine = sent = None
        if members[self.index].sends:
            sent = self.sent.pop((j, c), None)
            values = self.vector[a:b] if sent is None else self.codec.decode(sent[0], sent[1], b - a)
            mine = measure(r, values, parts)
        try:
            check_signatures(entries, peers=[m.peer_id for m in members], round_=self.round_name,
                             reducer=j, chunk=c, me=self.index,
                             my_digest=None if sent is None else sent[2])
            check_answer(entries, errors, weights=[m.weight for m in members] if self.weights is None
                         else list(self.weights),
                         sends=[m.sends for m in members], me=self.index, mine=mine,
                         answer_projections=projections, answer_norm=norm,
                         answer_bound=self.reply.error_bound(answer), parts=parts,
                         aggregation=self.aggregation)
        except MisstatedContribution as exc:
            if sent is None or sent[2] is None:
                raise
            # our proof for the other members: the chunk as it went out (a copy: the vector's
            # slice may change once the round is over)
            raise MisstatedContribution(str(exc), c, bytes(memoryview(sent[0]).cast("B")), sent[1],
                                        account, digest, signature) from None
        self.applied[(j, c)] = Applied(tuple(entries), digest, tuple(parts))
        self.told[(j, c)] = (digest, told, signature)
        self.accounts[(j, c)] = encoded  # (half the memory of the parsed list)
