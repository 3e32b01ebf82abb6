"""The butterfly all-reduce service: one per daemon, any number of rounds at a time.

    service = AllReduceService(transport)
    report = await service.run(group, my_index, vector, weight)   # vector: averaged in place

`AllReduceService` serves the "avg.part" stream method (wire.py) and routes each incoming stream
by its group id to the local round of that group (`butterfly.Round`). A stream that comes before
the local round has started waits for it, at most `arrival_grace` seconds and never past the
deadline the opener announced; a stream for a group that does not show up (or whose round is
over) is refused: the stream is aborted with the reason. Such streams hold one of a bounded
number of waiting slots, shared by every round (a reducer cannot tell a stream for a group it
has not heard of yet from a stranger's): a few per sender, and when all are held, a sender
holding fewer takes over the oldest slot, at least `_WAITING_EVICT_AFTER` old, of the sender
holding the most (net/admission.py); the stream dropped is refused as `RoundNotStarted` and its
sender, if honest, opens it again.

`run` raises only for misuse (wrong vector, member index, weight, unknown codec, a round of that
group already running); whatever peers do, it returns by the group's deadline with a report of
what was averaged and what was not (report.py).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import math
import os
import random
from typing import Any

import numpy as np
import structlog

from .. import timebase
from ..identity import Identity
from ..net import PeerTransport, RequestContext, Stream
from ..net.admission import FairSlots
from .accusations import Accusations
from .answers import AnswerSummaries
from .audits import OwnAudits
from .bans import BanList
from .butterfly import Round
from .codec import CompressionError, finite_range
from .compression import CODECS
from .corruption import SenderCorruption
from .errors import AveragingError
from .group import Group
from .report import AllReduceReport, PartFailure, PeerTransfer
from .screening import ScreeningPolicy
from .wire import METHOD, SLOT_TAKEN, PeerFault, RoundNotStarted, StreamOpen, says_slot_taken
from .withheld import WithheldAnswers

__all__ = ["AllReduceError", "AllReduceReport", "AllReduceService", "PartFailure", "PeerTransfer"]

log = structlog.get_logger(__name__)

_MAX_WAITING_STREAMS = 256
# A sender opens one stream to each reducer of a round, and a peer is in a few rounds at once
# (a gradient round, a state round, grid stages): more waiting streams from one peer are a
# stranger taking the slots that honest members of rounds about to start need.
_MAX_WAITING_PER_PEER = 8
# When every waiting slot is held, a slot this old may be taken over by a sender holding fewer:
# an honest stream waits well under this for a round that is about to start (its reducer is
# getting the group from the leader), and strangers' streams that wait for nothing cannot keep
# the slots from honest senders, however many identities they hold the slots with.
_WAITING_EVICT_AFTER = 1.0
_FINISHED_MEMORY = 256
_FINITE_CHECK_BLOCK = 1 << 20


class _Waiter:
    """A stream waiting for its round to start here: `woken` says "open", "evicted", "gone" (the
    stream failed: its sender aborted it, or the link ended) or "closed" (the service)."""

    __slots__ = ("group_id", "woken")

    def __init__(self, group_id: str, woken: asyncio.Future[str]) -> None:
        self.group_id = group_id
        self.woken = woken


class AllReduceError(AveragingError, ValueError):
    """`run` was misused (the caller's fault): the message says what is wrong."""


class AllReduceService:
    """Serves "avg.part" on `transport` and runs all-reduce rounds.

    stall_timeout: a sender whose stream has not come, or that sent nothing for that long, is left
    out of the chunks it has not delivered. arrival_grace: how long a stream for a round that has
    not started here may wait for it. inline_elements: chunks smaller than that are encoded,
    decoded and added on the event loop; bigger ones go to a pool of `threads` worker threads
    (measured on 2 cores: a thread hop costs ~60 us, an add of 64K float32 ~11 us, of 256K ~48 us;
    and work in a thread lets the loop drive the sockets meanwhile). policy: how contributions
    are screened and aggregated (screening.py); bans: the offences and bans of this daemon
    (bans.py; the service's own when not given); corruption, wrong_answers: tests only
    (corruption.py).
    """

    def __init__(self, transport: PeerTransport, *, stall_timeout: float = 10.0,
                 arrival_grace: float = 5.0, inline_elements: int = 1 << 16,
                 threads: int | None = None, policy: ScreeningPolicy | None = None,
                 bans: BanList | None = None, corruption: SenderCorruption | None = None,
                 wrong_answers: str | None = None, identity: Identity | None = None,
                 rng: random.Random | None = None) -> None:
        self.transport = transport
        # signs our contributions (signatures.py): the transport's own identity where it has one
        self.identity = identity or getattr(transport, "identity", None)
        self.policy = policy or ScreeningPolicy()
        self.bans = bans or BanList()
        self.corruption = corruption
        self.wrong_answers = wrong_answers  # tests only (corruption.py)
        self.stall_timeout = stall_timeout
        self.arrival_grace = arrival_grace
        self.inline_elements = inline_elements
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads or min(8, os.cpu_count() or 2), thread_name_prefix="allreduce")
        self._rounds: dict[str, Round] = {}
        # by group id, in the order they came (a dict, not a set: woken in that order, the same
        # in every run of a simulation)
        self._arrivals: dict[str, dict[_Waiter, None]] = {}
        self._waiting: FairSlots[_Waiter] = FairSlots(_MAX_WAITING_STREAMS, _MAX_WAITING_PER_PEER,
                                                      _WAITING_EVICT_AFTER)  # by sender
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._log = log.bind(peer_id=transport.peer_id)
        transport.add_stream_handler(METHOD, self._handle)
        self.accusations = Accusations(transport, self.bans, self.counters)
        self.withheld = WithheldAnswers(transport, self.bans, self.counters, self.accusations)
        self.summaries = AnswerSummaries(transport, self.bans, self.counters,
                                         on_applied=self.withheld.applied)
        # (what to audit is drawn at random: the simulator passes a seeded generator)
        self.audits = OwnAudits(transport, self.bans, self.counters,
                                rng or random.SystemRandom())

    # --- rounds ---------------------------------------------------------------------------------
    async def run(self, group: Group, my_index: int, vector: np.ndarray, weight: float, *,
                  finite_checked: bool = False, weight_budget: float | None = None,
                  max_represents: int = 1) -> AllReduceReport:
        """Average `vector` (float32, 1-D, `group.size` long; changed in place) with the group.

        Member `my_index` sends its vector with `weight` (> 0) if it is a sender and reduces its
        part `group.part_bounds[my_index]`. Parts (or chunks of them) that could not be averaged
        keep their local values and are listed in the report's `failed_parts`. `finite_checked`:
        the caller has already made sure the vector holds no NaN or Inf. `weight_budget`: what the
        senders weigh at most together (`Group.bounded_weights`, each member's count of the trainers
        it stands for taken at most `max_represents`; None: each as claimed)."""
        self._check(group, my_index, vector, weight)
        weights = group.bounded_weights(weight_budget, max_represents)
        if not group.members[my_index].sends:
            weight = 0.0
        else:
            if weight == group.members[my_index].weight:  # (the group's bound on its claim)
                weight = weights[my_index]
            if not finite_checked:
                await self._check_finite(vector)
        if group.group_id in self._rounds:
            raise AllReduceError(f"a round of group {group.group_id} is already running")
        self.counters["rounds"] += 1
        round_ = Round(self.transport, group, my_index, vector, weight, weights=weights, pool=self._pool,
                       stall_timeout=self.stall_timeout, inline_elements=self.inline_elements,
                       counters=self.counters, on_open=self._open, policy=self.policy, bans=self.bans,
                       corruption=self.corruption.next_round() if self.corruption else None,
                       wrong_answers=self.wrong_answers, identity=self.identity,
                       accusations=self.accusations, audits=self.audits,
                       summaries=self.summaries, withheld=self.withheld)
        try:
            report = await round_.execute()
        finally:
            self._rounds.pop(group.group_id, None)
            self._finished[group.group_id] = None
            while len(self._finished) > _FINISHED_MEMORY:
                self._finished.popitem(last=False)
        if report.failed_parts:
            self.counters["rounds_with_failures"] += 1
        return report

    async def _check_finite(self, vector: np.ndarray) -> None:
        if vector.size >= _FINITE_CHECK_BLOCK:
            await asyncio.get_running_loop().run_in_executor(self._pool, check_finite, vector)
        else:
            check_finite(vector)

    def _check(self, group: Group, my_index: int, vector: np.ndarray, weight: float) -> None:
        try:
            group.check()
        except ValueError as exc:
            raise AllReduceError(f"bad group: {exc}") from exc
        if self._closed:
            raise AllReduceError("the all-reduce service is closed")
        if not 0 <= my_index < len(group.members):
            raise AllReduceError(f"member index {my_index} is not in a group of {len(group.members)}")
        if group.members[my_index].peer_id != self.transport.peer_id:
            raise AllReduceError(f"member {my_index} of the group is not this peer")
        if group.compression not in CODECS:
            raise AllReduceError(f"unknown compression {group.compression!r} (known: {', '.join(CODECS)})")
        if not isinstance(vector, np.ndarray) or vector.dtype != np.float32 or vector.ndim != 1 \
                or not vector.flags.c_contiguous or not vector.flags.writeable:
            raise AllReduceError("the vector must be a writable, contiguous, 1-D float32 array")
        if vector.size != group.size:
            raise AllReduceError(f"the vector has {vector.size} elements, the group averages {group.size}")
        if group.members[my_index].sends and not (math.isfinite(weight) and weight > 0):
            raise AllReduceError(f"a sender's weight must be finite and positive, not {weight}")

    def _open(self, round_: Round) -> None:
        """Called by the round once it can take streams."""
        group_id = round_.group.group_id
        self._rounds[group_id] = round_
        for waiter in list(self._arrivals.get(group_id, ())):
            self._release(waiter)  # its slot is free at once: it no longer waits
            if not waiter.woken.done():
                waiter.woken.set_result("open")

    @property
    def waiting_streams(self) -> int:
        """Streams waiting here for a round that has not started."""
        return len(self._waiting)

    # --- incoming streams -----------------------------------------------------------------------
    async def _handle(self, ctx: RequestContext, stream: Stream) -> None:
        """Route a sender's stream to its round; refusals abort the stream with the reason."""
        try:
            opened = StreamOpen.parse(stream.header)
            round_ = self._rounds.get(opened.group_id) or await self._wait_for_round(
                opened, ctx.peer_id, stream)
        except PeerFault as exc:
            if not says_slot_taken(exc):  # (a take-over is counted as streams_evicted_waiting)
                self.counters["streams_refused"] += 1
            raise
        async with asyncio.timeout_at(round_.deadline + 1.0):
            await round_.adopt(ctx.peer_id, stream, opened)

    async def _wait_for_round(self, opened: StreamOpen, peer_id: str, stream: Stream) -> Round:
        group_id = opened.group_id
        if self._closed:
            raise PeerFault("the all-reduce service is closing")
        if group_id in self._finished:
            raise PeerFault(f"round {group_id} is over here")
        wait = min(self.arrival_grace, opened.deadline - timebase.now())
        if not wait > 0:  # (NaN too)
            raise PeerFault(f"round {group_id} has not started here and its deadline has passed")
        loop = asyncio.get_running_loop()
        now = loop.time()
        admission = self._waiting.admit(peer_id, now)
        if admission.refused == "per_source":
            self.counters["streams_refused_peer_waiting"] += 1
            raise RoundNotStarted(f"this peer already has {self._waiting.per_source} streams waiting "
                                  "for rounds that have not started here; ask again shortly")
        # a stream takes over another's slot only if it would hold it as long itself (one that
        # announces a deadline a moment away would otherwise drop a waiter and leave at once,
        # again and again, holding nothing)
        if not admission.admitted or (admission.evict is not None
                                      and wait < self._waiting.evict_after):
            self.counters["streams_refused_all_waiting"] += 1
            raise RoundNotStarted(f"{self._waiting.total} streams already wait for rounds that "
                                  "have not started here; ask again shortly")
        if admission.evict is not None:
            self._release(admission.evict)
            # (a waiter woken by its round or its stream's end holds no slot; one whose wait
            # just timed out still does until its task runs: its future is cancelled then)
            if not admission.evict.woken.done():
                admission.evict.woken.set_result("evicted")
                self.counters["streams_evicted_waiting"] += 1
        waiter = _Waiter(group_id, loop.create_future())
        self._waiting.add(waiter, peer_id, now)
        self._arrivals.setdefault(group_id, {})[waiter] = None
        # the sender may abort the stream meanwhile (or its link end): its slot is free at once
        failure = stream.failure()

        def gone(_: object) -> None:
            self._gone(waiter)

        failure.add_done_callback(gone)
        try:
            async with asyncio.timeout(wait):
                woken = await waiter.woken
        except TimeoutError:
            # (woken in the same turn of the loop as the timeout: the round came in time)
            if not waiter.woken.done() or waiter.woken.cancelled():
                raise PeerFault(f"no round of group {group_id} here (waited {wait:.1f}s)") from None
            woken = waiter.woken.result()
        finally:
            failure.remove_done_callback(gone)
            self._release(waiter)
        if woken == "gone":
            raise PeerFault("the stream ended while it waited for its round")
        if woken == "closed":
            raise PeerFault("the all-reduce service is closing")
        if woken == "evicted":
            raise RoundNotStarted(SLOT_TAKEN)
        round_ = self._rounds.get(group_id)
        if round_ is None:
            raise PeerFault(f"round {group_id} is over here")
        return round_

    def _gone(self, waiter: _Waiter) -> None:
        """The stream of a waiter failed: free its slot and end its wait."""
        self._release(waiter)
        if not waiter.woken.done():
            waiter.woken.set_result("gone")

    def _release(self, waiter: _Waiter) -> None:
        """Free a waiting stream's slot (nothing if it was freed already)."""
        self._waiting.remove(waiter)
        waiters = self._arrivals.get(waiter.group_id)
        if waiters is not None:
            waiters.pop(waiter, None)
            if not waiters:
                del self._arrivals[waiter.group_id]

    def close(self) -> None:
        """Refuse new rounds and streams, end the waits of streams whose rounds will not start
        now, and stop the worker threads (call after the rounds)."""
        self._closed = True
        self.accusations.close()
        self.summaries.close()
        self.withheld.close()
        self.audits.close()
        for waiters in list(self._arrivals.values()):
            for waiter in list(waiters):
                self._release(waiter)
                if not waiter.woken.done():
                    waiter.woken.set_result("closed")
        self._pool.shutdown(wait=False, cancel_futures=True)

    def status(self) -> dict[str, Any]:
        return {"active_rounds": sorted(self._rounds), "counters": dict(self.counters)}


def check_finite(vector: np.ndarray) -> None:
    for start in range(0, vector.size, _FINITE_CHECK_BLOCK):
        try:
            finite_range(vector[start:start + _FINITE_CHECK_BLOCK])
        except CompressionError:
            raise AllReduceError(f"the vector holds NaN or Inf values (at or after element {start})") \
                from None
