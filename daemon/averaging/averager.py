"""One node's averaging: matchmaking, load balancing and the all-reduce, round after round.

`Averager.average` is what both the collaboration and the `averaging.average` RPC call: find the
group for a key, let the leader split the vector by measured bandwidth, run the butterfly
all-reduce in place, learn bandwidth from the transfers, and keep a short history for
`averaging.status`. A round never outlives its deadline; a round that fails keeps nothing.
Peers whose contributions are rejected (screening.py) are banned for a while (bans.py); the bans
and their counters show in `averaging.status` and the node's metrics.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from .. import timebase
from ..dht import DHTNode
from ..net import PeerTransport
from . import corruption
from .aggregation import Aggregation
from .allreduce import AllReduceError, AllReduceReport, AllReduceService, check_finite
from .avoided_leaders import leader_failed_us
from .bandwidth import BandwidthEstimator, PeerRates, measured_rates
from .bans import BanList
from .claims import OVERCLAIM_FACTOR, leader_plan, narrower_link
from .errors import AveragingError
from .group import Group, Member, Role
from .matchmaking import Matchmaker, RoundRequest
from .report import AveragingReport
from .screening import ScreeningPolicy
from .settings import AveragingSettings

log = structlog.get_logger(__name__)

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
MIN_CHUNK_BYTES = 64 << 10
CHUNKS_PER_VECTOR = 16


@dataclass(frozen=True)
class RoundOptions:
    key: str
    weight: float
    role: Role
    deadline: float  # unix time
    compression: str = "none"
    aggregation: Aggregation = "mean"  # how the reducers combine contributions (aggregation.py)
    expected: int | None = None
    window: float | None = None
    min_trainers: int = 1  # matchmaking waits past its window for this many (RoundRequest)
    peers: tuple[str, ...] = ()  # who is expected, when the caller knows (a direct round)
    leaders: tuple[str, ...] = ()  # who may lead first (RoundRequest.leaders)
    represents: int = 1  # trainers this peer's vector stands for (Member.represents)
    max_represents: int = 1  # what any member's claim counts for, at most (Group.averaged)
    max_weight: float | None = None  # the most weight a member may claim (RoundRequest.max_weight)
    # what the round's senders weigh at most together, shared by the trainers each stands for
    # (Group.bounded_weights; None: each as claimed)
    weight_budget: float | None = None
    staged: bool = False  # a later stage's peers may be on their way (RoundRequest.staged)


class NonFiniteVector(AveragingError):
    """The vector holds NaN or Inf; it is not averaged (the caller's fault)."""


class Averager:
    def __init__(self, transport: PeerTransport, dht: DHTNode, config: AveragingSettings, *,
                 reachable: bool = True,
                 caps: Callable[[], tuple[float, float]] | None = None,
                 nonce: Callable[[int], bytes] | None = None) -> None:
        self.config = config
        self.peer_id = transport.peer_id
        self.reachable = reachable
        self._caps = caps  # the volunteer's (upload, download) caps in bytes/s, 0: none
        self.bandwidth = BandwidthEstimator(config.upload_mbps * MBIT, config.download_mbps * MBIT)
        self.peer_rates = PeerRates()  # what our transfers measured of the others (claims.py)
        self._loop: asyncio.AbstractEventLoop | None = None  # the planner counts through it
        self._claim = corruption.claimed_bandwidth_from_environment()  # tests only
        self._claimed_weight = corruption.claimed_weight_from_environment()  # tests only
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=config.history)
        self.counters: collections.Counter[str] = collections.Counter()
        self.policy = ScreeningPolicy(
            max_value=config.max_value, max_norm_ratio=config.max_norm_ratio,
            robust=config.robust_aggregation, clip_radius=config.clip_radius,
            clip_iterations=config.clip_iterations, check_answers=config.check_reducers)
        self.bans = BanList(ban_after=config.ban_after, window=config.offence_window,
                            seconds=config.ban_seconds, counters=self.counters)
        self.allreduce = AllReduceService(transport, policy=self.policy, bans=self.bans,
                                          corruption=corruption.from_environment(),
                                          wrong_answers=corruption.answers_from_environment(),
                                          rng=None if nonce is None else random.Random(nonce(8)))
        self.matchmaker = Matchmaker(transport, dht, self._plan, bans=self.bans,
                                     equivocate=corruption.equivocating_leader_from_environment(),
                                     **({} if nonce is None else {"nonce": nonce}))

    def chunk_elements(self, size: int) -> int:
        """Chunks of `averaging.chunk_bytes`, but at least ~32 per vector so that sending,
        reducing and receiving overlap even for small vectors (not below 64 KiB: smaller chunks
        cost more than they overlap). Depends only on the size and the config, so peers agree."""
        wanted = max(MIN_CHUNK_BYTES, size * 4 // CHUNKS_PER_VECTOR)
        return max(1, min(self.config.chunk_bytes, wanted) // 4)

    async def prepare(self) -> None:
        """Load the load balancer (scipy: ~1 s) in a thread, before the first round needs it,
        so that a run's first epoch does not wait for it. Idle daemons never load it."""
        await asyncio.to_thread(importlib.import_module, f"{__package__}.balancing")

    def _plan(self, members: tuple[Member, ...], size: int, chunk: int) -> tuple[tuple[int, int], ...]:
        """The part ranges of a group we lead (in the matchmaker's thread): the LP over the
        members' claims bounded by the public rule and by what we measured (claims.py)."""
        from .balancing import solve_shares, to_part_bounds, uniform_shares  # scipy: loaded on first use

        rates = self.peer_rates.snapshot(m.peer_id for m in members)
        plan = leader_plan(members, self.peer_id, rates)
        if self._loop is not None and (plan.claims_bounded or plan.claims_cut):
            self._loop.call_soon_threadsafe(self.counters.update, {
                "bandwidth_claims_bounded": plan.claims_bounded,
                "bandwidth_claims_cut": plan.claims_cut})
        if self.config.balancing == "uniform":
            fractions = uniform_shares(members)
        else:
            fractions = solve_shares(plan.members, size * 4, plan.caps).fractions
        log.debug("averaging_plan", members=[m.peer_id[:12] for m in members],
                  claims=[round(narrower_link(m)) for m in members],
                  measured=[round(rates[m.peer_id]) if m.peer_id in rates else None for m in members],
                  figures=[round(m.upload) for m in plan.members],
                  caps=[round(c, 4) for c in plan.caps], fractions=[round(f, 4) for f in fractions])
        return to_part_bounds(fractions, size, chunk)

    def advertised_bandwidth(self) -> tuple[float, float]:
        """(upload, download) in bytes/s for the load balancer: the estimates, at most the caps."""
        upload, download = self.bandwidth.upload, self.bandwidth.download
        if self._claim is not None:  # a test's hostile peer (corruption.py)
            return self._claim, self._claim
        if self._caps is not None:
            cap_up, cap_down = self._caps()
            upload = min(upload, cap_up) if cap_up > 0 else upload
            download = min(download, cap_down) if cap_down > 0 else download
        return upload, download

    def coming(self, keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        """While inside: this peer will average under `keys` soon (a grid round's later stages;
        matchmaking_methods.py tells the peers that wait for it there)."""
        return self.matchmaker.coming(keys)

    def coming_under(self, prefix: str) -> contextlib.AbstractContextManager[None]:
        """While inside: this peer will average under some key starting with `prefix` soon (a
        grid round whose roster it is still agreeing on; matchmaking.py)."""
        return self.matchmaker.coming_under(prefix)

    def round_over(self, prefix: str) -> None:
        """This peer has moved past the round under `prefix` (and its stages): peers that ask
        to join it late are told so, and move on at once (gatherings.py)."""
        self.matchmaker.round_over(prefix)

    async def average(self, vector: np.ndarray, options: RoundOptions) -> AveragingReport:
        """Average `vector` (float32, changed in place) with the peers that average under the same
        key; return the round's report. Peer failures are reported, not raised."""
        if vector.dtype != np.float32 or vector.ndim != 1:
            raise AveragingError("the vector must be one-dimensional float32")
        self._loop = asyncio.get_running_loop()
        started = timebase.now()
        if options.deadline <= started:
            raise AveragingError("the round's deadline has already passed")
        try:
            await asyncio.to_thread(check_finite, vector)
        except AllReduceError as exc:
            self.counters["rejected_nonfinite"] += 1
            raise NonFiniteVector(f"{exc}; nothing was averaged") from None
        role: Role = options.role
        weight = 0.0 if role == "aux" else options.weight
        max_weight = options.max_weight
        budget = options.weight_budget
        if self._claimed_weight is not None and weight > 0:  # a test's hostile peer (corruption.py)
            weight, max_weight = self._claimed_weight, None
        if role != "client" and not self.reachable:
            role = "client"  # nobody can dial us: we send, we do not reduce
        upload, download = self.advertised_bandwidth()
        member = Member(self.peer_id, role, weight, upload, download, reachable=self.reachable,
                        represents=options.represents if weight > 0 else 0)
        window = options.window if options.window is not None else self.config.window
        window = max(0.1, min(window, (options.deadline - started) / 2))
        request = RoundRequest(options.key, member, size=int(vector.size),
                               chunk_elements=self.chunk_elements(int(vector.size)),
                               compression=options.compression,
                               aggregation=options.aggregation,
                               window=window, deadline=options.deadline, expected=options.expected,
                               max_group_size=self.config.max_group_size,
                               min_trainers=options.min_trainers, peers=options.peers,
                               leaders=options.leaders, max_weight=max_weight,
                               staged=options.staged)
        try:
            group = await self.matchmaker.form_group(request)
        except AveragingError:
            self.counters["rounds_not_formed"] += 1
            raise
        matched = timebase.now()
        log.info("averaging_group_ready", key=options.key, group=group.group_id[:12],
                 group_size=len(group.members), part=list(group.part_bounds[group.index_of(self.peer_id)]))
        report: AllReduceReport | None = None
        if len(group.members) > 1:
            report = await self.allreduce.run(group, group.index_of(self.peer_id), vector, weight,
                                              finite_checked=True, weight_budget=budget,
                                              max_represents=options.max_represents)
            self._learn_bandwidth(report)
            self._learn_peer_rates(group, report)
            self._judge_leader(group, report, options.min_trainers)
        finished = timebase.now()
        summary = self._summarise(options, group, report, started, matched, finished,
                                  group.bounded_weights(budget, options.max_represents))
        self.history.append(summary.to_json())
        self.counters["rounds"] += 1
        self.counters["rounds_failed" if summary.failed_parts else "rounds_ok"] += 1
        # Running totals (the history keeps only the last rounds): for /metrics' counters.
        self.counters["round_milliseconds"] += round(1000 * (finished - started))
        self.counters["bytes_sent"] += summary.bytes_sent
        self.counters["bytes_received"] += summary.bytes_received
        if summary.contributions_clipped:
            self.counters["contributions_clipped"] += summary.contributions_clipped
        log.info("averaging_round", key=options.key, group_size=summary.group_size,
                 seconds=summary.seconds, failed_parts=len(summary.failed_parts))
        return summary

    def _judge_leader(self, group: Group, report: AllReduceReport, min_trainers: int) -> None:
        """Count a round its leader failed us in; two in a row and matchmaking ranks that
        leader last for a while (avoided_leaders.py: the hostage attack)."""
        if not group.leader or group.leader == self.peer_id:
            return
        if not leader_failed_us(group, report, min_trainers):
            self.matchmaker.leader_served(group)
            return
        self.matchmaker.leader_failed(group)  # (logs and counts those it now avoids)

    def _learn_bandwidth(self, report: AllReduceReport) -> None:
        if report.seconds > 0:
            self.bandwidth.observe_upload(report.bytes_sent, report.seconds)
            self.bandwidth.observe_download(report.bytes_received, report.seconds)

    def _learn_peer_rates(self, group: Group, report: AllReduceReport) -> None:
        """Keep what this round measured of the others; count the members whose claim was far
        over it (`bandwidth_overclaims`). Counted, not an offence: an honest peer's claim is its
        own moving average and lags a link that just got slower."""
        index = group.index_of(self.peer_id)
        for peer_id, rate in measured_rates(group, index, report).items():
            self.peer_rates.observe(peer_id, rate)
            claim = narrower_link(group.members[group.index_of(peer_id)])
            if claim > OVERCLAIM_FACTOR * rate:
                self.counters["bandwidth_overclaims"] += 1
                log.info("averaging_bandwidth_overclaim", peer=peer_id, claimed=claim,
                         measured=round(rate, 1))

    def _summarise(self, options: RoundOptions, group: Group, report: AllReduceReport | None,
                   started: float, matched: float, finished: float,
                   weights: Sequence[float]) -> AveragingReport:
        index = group.index_of(self.peer_id)
        weight, represented = group.averaged(report.senders_excluded if report else (),
                                             options.max_represents, weights)
        return AveragingReport(
            key=options.key,
            group_id=group.group_id,
            members=tuple(m.peer_id for m in group.members),
            trainers=sum(1 for m in group.members if m.role != "aux"),
            senders=sum(1 for m in group.members if m.sends),
            part=group.part_bounds[index],
            shares=tuple(b - a for a, b in group.part_bounds),
            seconds=round(finished - started, 4),
            matchmaking_seconds=round(matched - started, 4),
            allreduce_seconds=round(finished - matched, 4),
            bytes_sent=report.bytes_sent if report else 0,
            bytes_received=report.bytes_received if report else 0,
            failed_parts=tuple(report.failed_parts) if report else (),
            senders_excluded=dict(report.senders_excluded) if report else {},
            senders_rejected=dict(report.senders_rejected) if report else {},
            finished_at=finished,
            weight=weight, represented=represented,
            part_bounds=tuple(group.part_bounds),
            chunk_elements=group.chunk_elements if report is not None else 0,
            compression=group.compression,
            aggregation=group.aggregation,
            contributions_clipped=report.contributions_clipped if report else 0,
        )

    def status(self) -> dict[str, Any]:
        bans = self.bans.status()  # first: it expires bans (and counts them)
        counters = {**self.counters, "refused_groups": self.matchmaker.refused_groups,
                    "leaders_avoided": self.matchmaker.avoided.times_avoided}
        return {"rounds": list(self.history), "counters": counters, "bans": bans,
                # leaders matchmaking ranks last now (avoided_leaders.py)
                "avoided_leaders": sorted(self.matchmaker.avoided.avoided(timebase.now())),
                "screening": {"max_value": self.policy.max_value,
                              "max_norm_ratio": self.policy.max_norm_ratio,
                              "robust_aggregation": self.policy.robust,
                              "check_reducers": self.policy.check_answers},
                "bandwidth": {"upload_bytes_per_second": self.bandwidth.upload,
                              "download_bytes_per_second": self.bandwidth.download,
                              "samples": self.bandwidth.samples,
                              "peers_measured": len(self.peer_rates),
                              # what the load balancer is told: the estimates, at most the caps
                              "advertised": dict(zip(("upload_bytes_per_second",
                                                      "download_bytes_per_second"),
                                                     self.advertised_bandwidth(), strict=True))}}
