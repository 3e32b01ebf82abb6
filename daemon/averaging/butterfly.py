"""One member's share of one butterfly all-reduce round (the protocol is in wire.py).

As a sender (sending.py), the member streams part j of its vector to each reducer j and writes the
averaged chunks it gets back straight into its vector. As a reducer, it hands every sender's chunks
(its own included) to a `PartReducer` and, as soon as a chunk has come from every live sender,
averages it, encodes it once, writes it into its own vector and sends the same bytes back to every
sender (so sending, reducing and receiving overlap chunk by chunk). The averages go back in the
senders' codec, or in its `reply_codec` where that differs (a sparse codec's averages are not
sparse enough for it); with a sparsifying codec the reducer's own contribution goes through the
codec too (compression.py).

Ownership: `execute` runs every task of the round in one TaskGroup under one deadline (the
group's); a sender stream served by the transport's handler is adopted into that group. Numpy work
on chunks above `inline_elements` runs in the service's thread pool; those jobs are awaited
shielded (a job that started finishes and its bookkeeping stays right) and drained before
`execute` returns, so nothing touches the vector after the call.

Faults never raise: a sender whose stream fails or stalls is dropped from the chunks it has not
delivered (its stream aborted with the reason); a reducer whose stream fails leaves its remaining
chunks local. A sender whose contribution is rejected (screening.py: NaN/Inf, wrong length, a
value over the cap, a norm outlier, a protocol violation) commits an offence (bans.py) and is
left out of every chunk not averaged yet, the ones it delivered included when they are kept. A
banned sender is left out from the start and its stream refused. The report says what failed and
why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import numpy as np
import structlog

from .. import timebase
from ..identity import Identity
from ..net import Message, PeerTransport, Stream
from .accounts import (
    ACCOUNT_KEY,
    CLIPPED,
    Entry,
    MisstatedContribution,
    WrongAverage,
    account_header,
    answer_digest,
    codec_errors,
    measure,
    project,
    segments,
    signs_of,
)
from .accusations import Accusations
from .aggregation import l2_norm
from .answers import AnswerSummaries
from .audits import Own, OwnAudits, commitment
from .bans import BanList
from .claims import stall_allowance
from .codec import Buffer, CompressionError, Meta
from .compression import get_codec, reply_codec, sparsifies
from .corruption import forged_entries, wrong_answer
from .group import Group
from .jobs import ChunkJobs
from .reducer import PartReducer
from .report import AllReduceReport, TransferLog, build_report
from .screening import OffenceKind, ScreeningPolicy, offence_kind
from .sending import FAULTS, PartSender, describe, leaf, receive_buffer
from .signatures import (
    ANSWER_SIGNATURE_KEY,
    LEADER_SIGNATURE_KEY,
    ROUND_KEY,
    SIGNATURE_KEY,
    check_round_tag,
    contribution_digest,
    round_name,
    sign_answer,
    signed_by,
)
from .wire import (
    ChunkPlan,
    GroupMismatch,
    PeerFault,
    ProtocolViolation,
    StreamOpen,
    chunk_header,
    parse_chunk,
)
from .withheld import WithheldAnswers

log = structlog.get_logger(__name__)


class Round:
    def __init__(self, transport: PeerTransport, group: Group, index: int, vector: np.ndarray,
                 weight: float, *, weights: Sequence[float] | None = None,
                 pool: concurrent.futures.Executor, stall_timeout: float,
                 inline_elements: int, counters: Counter[str], on_open: Callable[[Round], None],
                 policy: ScreeningPolicy, bans: BanList, corruption: str | None = None,
                 wrong_answers: str | None = None, identity: Identity | None = None,
                 accusations: Accusations | None = None, audits: OwnAudits | None = None,
                 summaries: AnswerSummaries | None = None,
                 withheld: WithheldAnswers | None = None) -> None:
        self.transport = transport
        self.group = group
        self.index = index
        self.vector = vector
        self.weight = weight
        # what each member's vector is averaged with (Group.bounded_weights)
        self.weights = tuple(m.weight for m in group.members) if weights is None else tuple(weights)
        self.codec = get_codec(group.compression)
        self.reply = reply_codec(self.codec)  # what the averages go back in
        self.stall_timeout = stall_timeout
        self.counters = counters
        self._on_open = on_open
        self.bans = bans
        self.policy = policy
        self.wrong_answers = wrong_answers  # tests only (corruption.py)
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + (group.deadline - timebase.now())
        members = group.members
        self.sends = members[index].sends
        self.plans = {j: ChunkPlan(a, b, group.chunk_elements) for j, (a, b) in enumerate(group.part_bounds)
                      if b > a}
        # reducer role
        self.own = own = self.plans.get(index)
        senders = [i for i, m in enumerate(members) if m.sends]
        self.senders = len(senders)
        self.reducer = PartReducer(own, senders, policy=policy, own=index if self.sends else None,
                                   aggregation=group.aggregation) if own else None
        count = own.count if own else 0
        # per chunk: the answer's payload, meta, account and our signature of them
        self.results: list[tuple[Buffer, Meta, Any, str | None] | None] = [None] * count
        self.unaveraged: dict[int, str] = {}
        self.done = [asyncio.Event() for _ in range(count)]
        self.remaining = count
        self.reduced = asyncio.Event()
        if not count:
            self.reduced.set()
        self.adopted: set[int] = set()
        self.serving: dict[int, asyncio.Task[None]] = {}
        self.excluded: dict[int, str] = {}
        self.offences: dict[int, OffenceKind] = {}
        self.clipped = 0  # contributions the round's rule scaled down (aggregation.py)
        # (sender, chunk) -> the digest of its contribution and its signature (signatures.py)
        self.signed: dict[tuple[int, int], tuple[str, str]] = {}
        self.accusations = accusations
        self.audits = audits
        self.summaries = summaries
        self.identity = identity
        self.round_name = round_name(group)  # what signatures name this round by
        # chunk -> our own contribution to it and its segments' digests, for audits (audits.py)
        self.own_kept: dict[int, Own] = {}
        # tests only (corruption.py, `equivocate`): per chunk what each member's account is cut from
        self.equivocal: dict[int, tuple[list[Entry], list[float], list[float], bytes, tuple[float, ...]]] = {}
        # tests only (`forge_skip`): per chunk the sender sent a skip in place of the answer
        self.withheld_from: dict[int, int] = {}
        # shared
        self.traffic = TransferLog()
        self.jobs = ChunkJobs(pool, inline_elements)
        self.tg: asyncio.TaskGroup | None = None
        self.closing = False
        self.log = log.bind(group_id=group.group_id, peer_id=transport.peer_id, member=index)
        self.sender = PartSender(transport, group, index, weight, vector, self.codec, self.reply,
                                 self.plans,
                                 self.jobs, self.traffic, self._left, self._exclude, self.log,
                                 corruption, check=policy.check_answers,
                                 accept_clipped=policy.robust == "centered_clip",
                                 aggregation=group.aggregation,
                                 on_wrong_average=self._wrong_average, weights=self.weights,
                                 identity=identity, round_name=self.round_name,
                                 counters=counters, bans=bans)
        if accusations is not None:
            accusations.remember(group, index)
        if summaries is not None:
            summaries.remember(group, index, self.sender.told)
        self.withheld = withheld
        if withheld is not None:
            withheld.remember(group, index, self.sender.told, self.sender.accounts)
        if audits is not None and policy.check_answers and self.reducer is not None and self.sends:
            audits.keep(group, self.own_kept)

    # --- the round ------------------------------------------------------------------------------
    async def execute(self) -> AllReduceReport:
        started = timebase.monotonic()
        try:
            async with asyncio.timeout_at(self.deadline), asyncio.TaskGroup() as tg:
                self.tg = tg
                self._on_open(self)
                self._exclude_banned()
                for j in self.sender.targets:
                    banned = self.bans.banned(self.group.members[j].peer_id)
                    if banned is not None:  # its part stays local here
                        self.bans.refused(self.group.members[j].peer_id, "reducer")
                        self.sender.errors[j] = f"reducer {banned}"
                        continue
                    tg.create_task(self.sender.exchange(j), name=f"allreduce-send-{j}")
                if self.reducer is not None:
                    if self.sends:
                        tg.create_task(self._contribute(), name="allreduce-own")
                    tg.create_task(self._watch_arrivals(), name="allreduce-arrivals")
                tg.create_task(self.reduced.wait(), name="allreduce-reduced")
        except TimeoutError:
            self.log.info("allreduce_deadline_passed")
        finally:
            self.closing = True
            await self.jobs.drain()
            if self.audits is not None and self.sender.applied:
                self.audits.audit(self.group, self.index, self.sender.applied)
            if self.summaries is not None and self.sender.told:
                self.summaries.send(self.group, self.index, self.sender.told)
            if self.withheld is not None and self.sends:  # what we sent and got no answer to
                got = self.sender.got  # (an answer taken unchecked, CLIPPED, is no withheld one)
                self.withheld.withheld(self.group.group_id, {
                    (j, c): (payload, meta) for (j, c), (payload, meta, _) in self.sender.sent.items()
                    if (j, c) not in self.sender.told and not got[j][c]})
            if self.sender.retries:
                self.counters["streams_reopened_not_started"] += self.sender.retries
        report = self._report(timebase.monotonic() - started)
        self.log.info("allreduce_round", seconds=round(report.seconds, 4), bytes_sent=report.bytes_sent,
                      bytes_received=report.bytes_received, failed=len(report.failures),
                      excluded=len(report.senders_excluded))
        return report

    def _left(self) -> float:
        """Per-operation timeout: a backstop a little past the round's deadline, which stops every
        operation itself (so a failure at the deadline reads "deadline passed")."""
        return max(0.0, self.deadline - self.loop.time()) + 1.0

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self.closing or self.tg is None:
            coro.close()
            return
        try:
            self.tg.create_task(coro, name=name)
        except RuntimeError:  # the group is shutting down at the deadline: the round is over
            coro.close()

    # --- reducer role ---------------------------------------------------------------------------
    def refusal(self, peer_id: str, opened: StreamOpen) -> str | None:
        """Why a sender's stream cannot be served (None: it can); a member that lies about its
        weight is excluded for it too."""
        i, members = opened.sender, self.group.members
        if self.closing or self.tg is None or self.reduced.is_set():
            return f"round {self.group.group_id} is over here"
        if self.reducer is None:
            return f"member {self.index} reduces nothing in round {self.group.group_id}"
        if i >= len(members) or i == self.index or members[i].peer_id != peer_id:
            return f"peer {peer_id} is not member {i} of round {self.group.group_id}"
        if not members[i].sends:
            return f"member {i} does not send in round {self.group.group_id}"
        if i in self.excluded:
            return f"member {i} was excluded: {self.excluded[i]}"
        if i in self.adopted:
            return f"member {i} already has a stream open"
        if opened.round_name:  # (none: a sender of an earlier dedloc; its chunks are set aside)
            try:
                check_round_tag({ROUND_KEY: opened.round_name,
                                 LEADER_SIGNATURE_KEY: opened.leader_signature}, self.group,
                                self.round_name, "sender", self.counters, self.bans,
                                self.transport.peer_id)
            except GroupMismatch as exc:  # its weight may be what the leader changed: no offence
                self._exclude(i, str(exc))
                return str(exc)
        weight = self.weights[i]  # (its claim, within the round's bound)
        if opened.weight != weight:
            reason = f"member {i} sends with weight {opened.weight:g}, the group says {weight:g}"
            self._exclude(i, reason, "protocol")
            return reason
        return None

    async def adopt(self, peer_id: str, stream: Stream, opened: StreamOpen) -> None:
        """Serve a sender's stream in this round's task group; return once it is served."""
        banned = self.bans.banned(peer_id)
        if banned is not None:
            self.bans.refused(peer_id, "stream")
        reason = self.refusal(peer_id, opened) if banned is None else f"peer {peer_id} is {banned}"
        if reason is not None or self.tg is None:
            self.counters["streams_refused"] += 1
            raise PeerFault(reason)
        i = opened.sender
        try:
            task = self.tg.create_task(self._serve(i, stream, opened.weight), name=f"allreduce-reduce-{i}")
        except RuntimeError:  # the task group is shutting down at the deadline
            raise PeerFault(f"round {self.group.group_id} is over here") from None
        self.adopted.add(i)
        self.serving[i] = task
        finished = self.loop.create_future()
        task.add_done_callback(lambda _: finished.done() or finished.set_result(None))
        await finished

    async def _serve(self, i: int, stream: Stream, weight: float) -> None:
        peer = self.group.members[i].peer_id
        self.traffic.start(peer)
        clean = False
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._gather(i, stream, weight, peer))
                tg.create_task(self._answer(stream, peer))
            clean = True
        except* FAULTS as errors:
            self._exclude(i, describe(errors), offence_kind(leaf(errors)))
        finally:
            self.serving.pop(i, None)
            if not clean:
                await stream.abort(self.excluded.get(i, "round over"))

    async def _gather(self, i: int, stream: Stream, weight: float, peer: str) -> None:
        """Receive sender i's chunks in order, each added into the sums (in a thread) while the
        next one arrives into the other buffer."""
        assert self.own is not None and self.reducer is not None
        plan, reducer = self.own, self.reducer
        size = self.codec.max_payload_bytes(plan.largest)
        buffers = (receive_buffer(size), receive_buffer(size))
        lossless = self.codec.name == "none" or reducer.keep  # kept: decoded into its row
        decoded = (None, None) if lossless else (np.empty(plan.largest, np.float32),
                                                   np.empty(plan.largest, np.float32))
        previous: asyncio.Future[None] | None = None
        for c in range(plan.count):
            message = await stream.receive_into(buffers[c % 2],
                                                timeout=min(self._left(), self._stall_for(i)))
            if message is None:
                raise PeerFault(f"the sender closed its stream after {c} of {plan.count} chunks")
            meta = parse_chunk(message.header, c, plan.count)
            self.traffic.received(peer, len(message.payload))
            if self.policy.check_answers and SIGNATURE_KEY in message.header:
                check_round_tag(message.header, self.group, self.round_name, "sender",
                                self.counters, self.bans, self.transport.peer_id)
            if previous is not None:
                await asyncio.shield(previous)
            if not reducer.expects(i, c):
                return
            reducer.take(i, c)
            first, last = plan.relative(c)
            previous = self.jobs.submit(last - first, self._add_chunk, i, c, message.payload, meta,
                                        weight, decoded[c % 2], message.header.get(SIGNATURE_KEY))
            previous.add_done_callback(partial(self._on_added, i, c, weight))
        if previous is not None:
            await asyncio.shield(previous)

    def _add_chunk(self, i: int, c: int, payload: Buffer, meta: Meta, weight: float,
                   out: np.ndarray | None, signature: Any) -> None:
        assert self.own is not None and self.reducer is not None
        if self.policy.check_answers:  # the account names it; members check the signature
            try:
                digest = contribution_digest(self.group.group_id, self.index, c, meta, payload)
            except (TypeError, ValueError) as exc:  # a meta JSON cannot carry (nested too deep)
                raise ProtocolViolation(f"chunk {c}: a codec meta that cannot be hashed: {exc}") \
                    from None
            if not signed_by(self.group.members[i].peer_id, self.round_name, self.index, c,
                             digest, signature):
                raise ProtocolViolation(f"chunk {c} does not carry the sender's signature of it "
                                        "(a sender of an older dedloc?)")
            self.signed[(i, c)] = (digest.hex(), signature)
        first, last = self.own.relative(c)
        row = self.reducer.row(c, i)
        target = row if row is not None else None if out is None else out[:last - first]
        values = self.codec.decode(payload, meta, last - first, target)
        self.reducer.add(c, i, values, weight, values if values.flags.writeable else None)

    async def _contribute(self) -> None:
        """Add our own part with our weight: exact, or as the codec conveys it when it sparsifies."""
        assert self.own is not None and self.reducer is not None
        plan, reducer = self.own, self.reducer
        scratch = np.empty(plan.largest, np.float32)
        for c in range(plan.count):
            if not reducer.expects(self.index, c):
                continue
            reducer.take(self.index, c)
            a, b = plan.absolute(c)
            job = self.jobs.submit(b - a, self._add_own, c, self.vector[a:b], scratch[:b - a])
            job.add_done_callback(partial(self._on_added, self.index, c, self.weight))
            await asyncio.shield(job)

    def _add_own(self, c: int, values: np.ndarray, scratch: np.ndarray) -> None:
        assert self.reducer is not None
        if sparsifies(self.codec):
            values = self.codec.decode(*self.codec.encode(values), values.size, out=scratch)
        self.reducer.add(c, self.index, values, self.weight, scratch)

    def _on_added(self, i: int, c: int, weight: float, job: asyncio.Future[None]) -> None:
        assert self.reducer is not None
        error = None if job.cancelled() else job.exception()
        if job.cancelled() or error is not None:
            settled = self.reducer.released(c)
        else:
            settled = self.reducer.added(c, weight)
        if settled:
            self._spawn(self._finalize(c), f"allreduce-average-{c}")
        if error is not None:
            self.counters["bad_chunks"] += 1
            self._exclude(i, f"chunk {c}: {describe(error)}", offence_kind(error))

    async def _finalize(self, c: int) -> None:
        assert self.own is not None
        a, b = self.own.absolute(c)
        rejected: dict[int, str] = {}
        try:
            rejected, clipped = await self.jobs.run(b - a, self._average, c)
            self.clipped += clipped
        except CompressionError as exc:  # the average overflowed float32
            self.unaveraged[c] = describe(exc)
        for i, reason in rejected.items():
            self.counters["bad_chunks"] += 1
            self._exclude(i, f"chunk {c}: {reason}", "norm_outlier")
        self.done[c].set()
        self.remaining -= 1
        if not self.remaining:
            self.reduced.set()

    def _average(self, c: int) -> tuple[dict[int, str], int]:
        """Average chunk c into our vector and encode it for the senders; the senders the norm
        rule rejected in it, and how many contributions the round's rule clipped."""
        assert self.own is not None and self.reducer is not None
        average, rejected, used = self.reducer.average(c)
        if average is None:
            self.unaveraged[c] = "no sender's contribution was accepted"
            return rejected, 0
        if self.wrong_answers is not None:
            wrong_answer(self.wrong_answers, average)
        payload, meta = self.reply.encode(average)
        a, b = self.own.absolute(c)
        self.reply.decode(payload, meta, b - a, out=self.vector[a:b])  # the same values as everyone's
        account: Any = None
        signature: str | None = None
        if self.policy.check_answers and self.policy.robust == "centered_clip":
            account = CLIPPED  # (not linear: no account can check it)
        elif self.policy.check_answers:  # what went into the answer, for the senders to check
            parts = segments(b - a, self.senders)
            signed = [self.signed.pop((u.sender, c), ("", "")) for u in used]
            for k, u in enumerate(used):
                if u.sender == self.index:  # our own: committed to, kept for audits (audits.py)
                    root, own = commitment(self.group.group_id, self.index, c,
                                           np.array(u.values), parts)
                    self.own_kept[c] = own
                    signed[k] = (root, "")
            # (the signs come after every contribution is fixed, ours included)
            answer = answer_digest(self.group.group_id, self.index, c, meta, payload,
                                   [digest for digest, _ in signed])
            r = signs_of(answer, b - a)
            errors = [0.0] * len(parts) if self.reply.name == "none" else codec_errors(
                self.vector[a:b], average, parts)
            entries = [Entry(u.sender, u.weight, project(r, u.values, parts),
                             l2_norm(u.values) if u.norm is None else u.norm, *signature)
                       for u, signature in zip(used, signed, strict=True)]
            if self.wrong_answers in ("forge", "forge_own", "forge_skip"):
                forged = forged_entries(entries, [u.scale for u in used], self.index,
                                        measure(r, self.vector[a:b], parts)[0],
                                        own=self.wrong_answers == "forge_own")
                if self.wrong_answers == "forge_skip":  # tests only: skip the sender misstated
                    for e, f in zip(entries, forged, strict=True):
                        if e != f:
                            self.withheld_from[c] = e.sender
                entries = forged
            account = account_header(entries, errors)
            if self.identity is not None:
                signature = sign_answer(self.identity, self.round_name, self.index, c, answer, account)
            if self.wrong_answers == "equivocate":  # tests only: an account per member (_answer)
                self.equivocal[c] = (entries, [u.scale for u in used], errors, answer,
                                     measure(r, self.vector[a:b], parts)[0])
        self.results[c] = (payload, meta, account, signature)
        return rejected, sum(1 for u in used if u.scale < 1.0)

    async def _answer(self, stream: Stream, peer: str) -> None:
        assert self.own is not None
        for c in range(self.own.count):
            await self.done[c].wait()
            result = self.results[c]
            if result is None or self.withheld_from.get(c) == self.group.index_of(peer):
                header: dict[str, Any] = {"c": c, "skip": self.unaveraged.get(c, "not averaged")}
                payload: Buffer = b""
            else:
                payload, meta, account, signature = result
                if c in self.equivocal:
                    account, signature = self._equivocal(c, peer)
                header = chunk_header(c, meta)
                if account is not None:
                    header[ACCOUNT_KEY] = account
                if signature is not None:
                    header[ANSWER_SIGNATURE_KEY] = signature
                    header[ROUND_KEY] = self.round_name
                    header[LEADER_SIGNATURE_KEY] = self.group.leader_signature
            await stream.send(Message(header, payload), timeout=self._left())
            self.traffic.sent(peer, len(payload))
        await stream.close()

    def _equivocal(self, c: int, peer: str) -> tuple[Any, str | None]:
        """TEST ONLY (`equivocate`): chunk c's account as told to `peer`: its own entry true,
        another sender's forged to agree with the (wrong) answer, signed."""
        entries, scales, errors, answer, projections = self.equivocal[c]
        account = account_header(forged_entries(entries, scales, self.index, projections,
                                                spare=self.group.index_of(peer)), errors)
        return account, None if self.identity is None else sign_answer(
            self.identity, self.round_name, self.index, c, answer, account)

    def _stall_for(self, i: int) -> float:
        """How long sender i may go without delivering a chunk: the stall timeout, or more for a
        slow link, from its bounded bandwidth figure (claims.py: a claimed 1 B/s buys no more
        than a link SPREAD times slower than the group's median, and never below 32 KiB/s)."""
        return stall_allowance(self.group, i, self.stall_timeout)

    async def _watch_arrivals(self) -> None:
        """Drop the senders whose stream has not come within the stall timeout."""
        try:
            async with asyncio.timeout(min(self.stall_timeout, self._left())):
                await self.reduced.wait()
            return
        except TimeoutError:
            pass
        for i, member in enumerate(self.group.members):
            if member.sends and i != self.index and i not in self.adopted:
                self._exclude(i, f"no stream came within {self.stall_timeout}s")

    def _wrong_average(self, j: int, reason: str, error: WrongAverage) -> None:
        """Reducer j answered against its own account: nothing more of its part is applied here
        (sending.py stops at the first such answer), and it is banned at once. Where its account
        misstated our contribution, the other senders applied that answer: we show them
        (accusations.py)."""
        peer = self.group.members[j].peer_id
        self.counters["wrong_averages"] += 1
        self.bans.offence(peer, "wrong_average", reason, conclusive=True)
        if isinstance(error, MisstatedContribution) and self.accusations is not None:
            self.accusations.accuse(self.group, self.index, j, error)

    def _exclude_banned(self) -> None:
        for i, member in enumerate(self.group.members):
            banned = self.bans.banned(member.peer_id) if member.sends and i != self.index else None
            if banned is not None and self.reducer is not None:
                self.bans.refused(member.peer_id, "round")
                self._exclude(i, banned)

    def _exclude(self, i: int, reason: str, offence: OffenceKind | None = None) -> None:
        """Leave sender i out of every chunk it has not delivered; stop serving its stream. An
        offence also leaves it out of the chunks it delivered that are kept and not averaged
        yet, and is recorded against it (once per round)."""
        if self.reducer is None or i == self.index or not self.group.members[i].sends:
            return
        if offence is not None and i not in self.offences:
            self.offences[i] = offence
            self.reducer.discard(i)
            self.bans.offence(self.group.members[i].peer_id, offence, reason)
        if i in self.excluded:
            return
        self.excluded[i] = reason
        self.counters["senders_excluded"] += 1
        self.log.warning("allreduce_sender_excluded", sender=self.group.members[i].peer_id, reason=reason)
        for c in self.reducer.drop(i):
            self._spawn(self._finalize(c), f"allreduce-average-{c}")
        task = self.serving.get(i)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    # --- report ---------------------------------------------------------------------------------
    def _report(self, seconds: float) -> AllReduceReport:
        outcomes: dict[str, list[tuple[tuple[int, int], bool, str]]] = {}
        for j, plan in self.plans.items():
            if j == self.index:
                done = [(self.results[c] is not None, self.unaveraged.get(c, "deadline passed"))
                        for c in range(plan.count)]
            else:
                sent = self.sender.outcome(j)
                if sent is None:
                    continue
                done = sent
            outcomes[self.group.members[j].peer_id] = [
                (plan.absolute(c), ok, reason) for c, (ok, reason) in enumerate(done)]
        excluded = {self.group.members[i].peer_id: r for i, r in sorted(self.excluded.items())}
        rejected = {self.group.members[i].peer_id: k for i, k in sorted(self.offences.items())}
        return build_report(self.group.group_id, seconds, outcomes, self.traffic, excluded, rejected,
                            self.clipped)

