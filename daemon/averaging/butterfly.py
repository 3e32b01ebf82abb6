"""One member's share of one butterfly all-reduce round (the protocol is in wire.py).

As a sender (sending.py), the member streams part j of its vector to each reducer j and writes the
averaged chunks it gets back straight into its vector. As a reducer (reducing.py), it averages
every sender's chunks of its own part (its own included) chunk by chunk and sends each average
back to every sender (answering.py), so sending, reducing and receiving overlap chunk by chunk.

Ownership: `execute` runs every task of the round in one TaskGroup under one deadline (the
group's); a sender stream served by the transport's handler is adopted into that group. Numpy work
on chunks above `inline_elements` runs in the service's thread pool; those jobs are awaited
shielded (a job that started finishes and its bookkeeping stays right) and drained before
`execute` returns, so nothing touches the vector after the call.

Faults never raise: a sender whose stream fails or stalls, or whose contribution is rejected, is
left out of the chunks not averaged yet (reducing.py); a reducer whose stream fails leaves its
remaining chunks local (sending.py). The report says what failed and why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import structlog

from .. import timebase
from ..identity import Identity
from ..net import PeerTransport, Stream
from .accounts import MisstatedContribution, WrongAverage
from .accusations import Accusations
from .answering import PartAnswers
from .answers import AnswerSummaries
from .audits import OwnAudits
from .bans import BanList
from .compression import get_codec, reply_codec
from .group import Group
from .jobs import ChunkJobs
from .reducing import ReducerRole
from .report import AllReduceReport, TransferLog, build_report
from .screening import ScreeningPolicy
from .sending import PartSender
from .signatures import round_name
from .wire import ChunkPlan, StreamOpen
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
        self.counters = counters
        self._on_open = on_open
        self.bans = bans
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + (group.deadline - timebase.now())
        members = group.members
        self.sends = members[index].sends
        self.plans = {j: ChunkPlan(a, b, group.chunk_elements) for j, (a, b) in enumerate(group.part_bounds)
                      if b > a}
        self.accusations = accusations
        self.audits = audits
        self.summaries = summaries
        self.round_name = round_name(group)  # what signatures name this round by
        # shared
        self.traffic = TransferLog()
        self.jobs = ChunkJobs(pool, inline_elements)
        self.log = log.bind(group_id=group.group_id, peer_id=transport.peer_id, member=index)
        # reducer role (reducing.py) and its answers (answering.py)
        own = self.plans.get(index)
        senders = [i for i, m in enumerate(members) if m.sends]
        self.answers = PartAnswers(group, index, vector, own, self.reply, len(senders), policy,
                                   self.traffic, self._left, identity=identity,
                                   round_name=self.round_name, wrong_answers=wrong_answers)
        self.reducing = ReducerRole(transport.peer_id, group, index, vector, weight, self.weights,
                                    own, senders, codec=self.codec, answers=self.answers,
                                    jobs=self.jobs, traffic=self.traffic, left=self._left,
                                    stall_timeout=stall_timeout, counters=counters, policy=policy,
                                    bans=bans, round_name=self.round_name, log=self.log)
        # sender role (sending.py)
        self.sender = PartSender(transport, group, index, weight, vector, self.codec, self.reply,
                                 self.plans,
                                 self.jobs, self.traffic, self._left, self.reducing.exclude, self.log,
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
        if audits is not None and policy.check_answers and self.reducing.reducer is not None \
                and self.sends:
            audits.keep(group, self.answers.own_kept)

    # --- the round ------------------------------------------------------------------------------
    async def execute(self) -> AllReduceReport:
        started = timebase.monotonic()
        try:
            async with asyncio.timeout_at(self.deadline), asyncio.TaskGroup() as tg:
                self.reducing.open(tg)
                self._on_open(self)
                self.reducing.exclude_banned()
                for j in self.sender.targets:
                    banned = self.bans.banned(self.group.members[j].peer_id)
                    if banned is not None:  # its part stays local here
                        self.bans.refused(self.group.members[j].peer_id, "reducer")
                        self.sender.errors[j] = f"reducer {banned}"
                        continue
                    tg.create_task(self.sender.exchange(j), name=f"allreduce-send-{j}")
                if self.reducing.reducer is not None:
                    if self.sends:
                        tg.create_task(self.reducing.contribute(), name="allreduce-own")
                    tg.create_task(self.reducing.watch_arrivals(), name="allreduce-arrivals")
                tg.create_task(self.reducing.reduced.wait(), name="allreduce-reduced")
        except TimeoutError:
            self.log.info("allreduce_deadline_passed")
        finally:
            self.reducing.close()
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

    async def adopt(self, peer_id: str, stream: Stream, opened: StreamOpen) -> None:
        """Serve a sender's stream in this round's task group; return once it is served
        (reducing.py: refused with a PeerFault)."""
        await self.reducing.adopt(peer_id, stream, opened)

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

    # --- report ---------------------------------------------------------------------------------
    def _report(self, seconds: float) -> AllReduceReport:
        outcomes: dict[str, list[tuple[tuple[int, int], bool, str]]] = {}
        for j, plan in self.plans.items():
            if j == self.index:
                done = [(self.answers.results[c] is not None,
                         self.answers.unaveraged.get(c, "deadline passed")) for c in range(plan.count)]
            else:
                sent = self.sender.outcome(j)
                if sent is None:
                    continue
                done = sent
            outcomes[self.group.members[j].peer_id] = [
                (plan.absolute(c), ok, reason) for c, (ok, reason) in enumerate(done)]
        excluded = {self.group.members[i].peer_id: r for i, r in sorted(self.reducing.excluded.items())}
        rejected = {self.group.members[i].peer_id: k for i, k in sorted(self.reducing.offences.items())}
        return build_report(self.group.group_id, seconds, outcomes, self.traffic, excluded, rejected,
                            self.reducing.clipped)
