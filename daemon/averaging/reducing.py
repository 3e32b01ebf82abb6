"""A round's reducer role: serve every sender's stream of our part and average it chunk by chunk.

The round (butterfly.py) hands each sender's stream to `adopt`, which serves it in the round's
task group. Every sender's chunks (our own included, `contribute`) go to a `PartReducer`
(reducer.py) and, as soon as a chunk has come from every live sender, it is averaged; answering.py
encodes it once, writes it into our own vector and sends the same bytes back to every sender (so
sending, reducing and receiving overlap chunk by chunk). With a sparsifying codec our own
contribution goes through the codec too (compression.py).

Faults never raise: a sender whose stream fails or stalls is dropped from the chunks it has not
delivered (its stream aborted with the reason). A sender whose contribution is rejected
(screening.py: NaN/Inf, wrong length, a value over the cap, a norm outlier, a protocol violation)
commits an offence (bans.py) and is left out of every chunk not averaged yet, the ones it
delivered included when they are kept. A banned sender is left out from the start and its stream
refused. The round owns the tasks, the deadline and the thread pool's jobs; this is only the
reducing half of its state.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import numpy as np

from ..net import Stream
from .answering import PartAnswers
from .bans import BanList
from .claims import stall_allowance
from .codec import Buffer, Codec, CompressionError, Meta
from .compression import sparsifies
from .group import Group
from .jobs import ChunkJobs
from .reducer import PartReducer
from .report import TransferLog
from .screening import OffenceKind, ScreeningPolicy, offence_kind
from .sending import FAULTS, describe, leaf, receive_buffer
from .signatures import LEADER_SIGNATURE_KEY, ROUND_KEY, SIGNATURE_KEY, check_round_tag
from .wire import ChunkPlan, GroupMismatch, PeerFault, StreamOpen, parse_chunk


class ReducerRole:
    def __init__(self, peer_id: str, group: Group, index: int, vector: np.ndarray, weight: float,
                 weights: Sequence[float], own: ChunkPlan | None, senders: Sequence[int], *,
                 codec: Codec, answers: PartAnswers, jobs: ChunkJobs, traffic: TransferLog,
                 left: Callable[[], float], stall_timeout: float, counters: Counter[str],
                 policy: ScreeningPolicy, bans: BanList, round_name: str, log: Any) -> None:
        self.peer_id = peer_id  # ours
        self.group = group
        self.index = index
        self.vector = vector
        self.weight = weight
        self.weights = weights  # what each member's vector is averaged with
        self.codec = codec
        self.answers = answers
        self.jobs = jobs
        self.traffic = traffic
        self._left = left  # the per-operation timeout (butterfly.Round._left)
        self.stall_timeout = stall_timeout
        self.counters = counters
        self.policy = policy
        self.bans = bans
        self.round_name = round_name  # what signatures name this round by
        self.log = log
        self.loop = asyncio.get_running_loop()
        self.sends = group.members[index].sends
        self.own = own
        self.reducer = PartReducer(own, senders, policy=policy, own=index if self.sends else None,
                                   aggregation=group.aggregation) if own else None
        self.remaining = own.count if own else 0
        self.reduced = asyncio.Event()
        if not self.remaining:
            self.reduced.set()
        self.adopted: set[int] = set()
        self.serving: dict[int, asyncio.Task[None]] = {}
        self.excluded: dict[int, str] = {}
        self.offences: dict[int, OffenceKind] = {}
        self.clipped = 0  # contributions the round's rule scaled down (aggregation.py)
        self.tg: asyncio.TaskGroup | None = None
        self.closing = False

    def open(self, tg: asyncio.TaskGroup) -> None:
        """Serve senders' streams, and average, in the round's task group from now on."""
        self.tg = tg

    def close(self) -> None:
        """The round is over: no stream is served and no chunk averaged any more."""
        self.closing = True

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self.closing or self.tg is None:
            coro.close()
            return
        try:
            self.tg.create_task(coro, name=name)
        except RuntimeError:  # the group is shutting down at the deadline: the round is over
            coro.close()

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
                                self.peer_id)
            except GroupMismatch as exc:  # its weight may be what the leader changed: no offence
                self.exclude(i, str(exc))
                return str(exc)
        weight = self.weights[i]  # (its claim, within the round's bound)
        if opened.weight != weight:
            reason = f"member {i} sends with weight {opened.weight:g}, the group says {weight:g}"
            self.exclude(i, reason, "protocol")
            return reason
        return None

    async def adopt(self, peer_id: str, stream: Stream, opened: StreamOpen) -> None:
        """Serve a sender's stream in the round's task group; return once it is served."""
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
                tg.create_task(self.answers.send(stream, peer))
            clean = True
        except* FAULTS as errors:
            self.exclude(i, describe(errors), offence_kind(leaf(errors)))
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
                                self.counters, self.bans, self.peer_id)
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
            self.answers.record_signature(i, c, meta, payload, signature)
        first, last = self.own.relative(c)
        row = self.reducer.row(c, i)
        target = row if row is not None else None if out is None else out[:last - first]
        values = self.codec.decode(payload, meta, last - first, target)
        self.reducer.add(c, i, values, weight, values if values.flags.writeable else None)

    async def contribute(self) -> None:
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
            self.exclude(i, f"chunk {c}: {describe(error)}", offence_kind(error))

    async def _finalize(self, c: int) -> None:
        assert self.own is not None
        a, b = self.own.absolute(c)
        rejected: dict[int, str] = {}
        try:
            rejected, clipped = await self.jobs.run(b - a, self._average, c)
            self.clipped += clipped
        except CompressionError as exc:  # the average overflowed float32
            self.answers.unaveraged[c] = describe(exc)
        for i, reason in rejected.items():
            self.counters["bad_chunks"] += 1
            self.exclude(i, f"chunk {c}: {reason}", "norm_outlier")
        self.answers.done[c].set()
        self.remaining -= 1
        if not self.remaining:
            self.reduced.set()

    def _average(self, c: int) -> tuple[dict[int, str], int]:
        """Average chunk c into our vector and encode it for the senders (answering.py); the
        senders the norm rule rejected in it, and how many contributions the round's rule clipped."""
        assert self.own is not None and self.reducer is not None
        average, rejected, used = self.reducer.average(c)
        if average is None:
            self.answers.unaveraged[c] = "no sender's contribution was accepted"
            return rejected, 0
        self.answers.compose(c, average, used)
        return rejected, sum(1 for u in used if u.scale < 1.0)

    def _stall_for(self, i: int) -> float:
        """How long sender i may go without delivering a chunk: the stall timeout, or more for a
        slow link, from its bounded bandwidth figure (claims.py: a claimed 1 B/s buys no more
        than a link SPREAD times slower than the group's median, and never below 32 KiB/s)."""
        return stall_allowance(self.group, i, self.stall_timeout)

    async def watch_arrivals(self) -> None:
        """Drop the senders whose stream has not come within the stall timeout."""
        try:
            async with asyncio.timeout(min(self.stall_timeout, self._left())):
                await self.reduced.wait()
        except TimeoutError:  # (the part is not reduced yet: who never opened a stream?)
            for i, member in enumerate(self.group.members):
                if member.sends and i != self.index and i not in self.adopted:
                    self.exclude(i, f"no stream came within {self.stall_timeout}s")

    def exclude_banned(self) -> None:
        for i, member in enumerate(self.group.members):
            banned = self.bans.banned(member.peer_id) if member.sends and i != self.index else None
            if banned is not None and self.reducer is not None:
                self.bans.refused(member.peer_id, "round")
                self.exclude(i, banned)

    def exclude(self, i: int, reason: str, offence: OffenceKind | None = None) -> None:
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
