"""Scripted swarms and what users need of them, measured.

Each scenario starts a `Swarm`, follows a script of joins, leaves, partitions and liars on
virtual time, watches every peer (`Observer`) and returns a `Result`:
- `split_brain`: two peers stepped the same epoch into different states (two lineages from one
  epoch, or one lineage with different parameters; after a grid round, collab/grid.py, only two
  lineages: its slices' averages agree up to float rounding, see `parameter_spread`); in
  `partition`, only outside the partition;
- `min_round_participation`: the lowest share, over the rounds, of the live trainers that had
  synced with the run before the round (stepped or downloaded once), or had been live for
  `SYNC_GRACE` without ever syncing, and stepped in it (honest trainers only: the others rightly
  leave a liar that claims another epoch out of their rounds); `lowest_round` says which round
  that was, with those of its trainers counted, the live ones, and `others` (trainers that
  stepped in it without having synced before its target was reached: they count in neither,
  so that they cannot stand in for a live trainer that was missing);
- `max_epoch_spread`: the largest gap between the epochs of such trainers, sampled every second;
  `widest_spread` says when it was first seen (simulated seconds from the start, as the log's
  `t`) and what the trainers at the lowest epoch were doing then (where a spread beyond one
  comes from);
- `newcomer_epochs_to_contribute`: for peers that joined a running run, the most epochs between
  the run's epoch when they joined and the first epoch they contributed samples to;
- `max_donor_load_ratio`: the most state downloads one donor served over the mean of those that
  served any;
- `memory_growth`: resident memory per live peer at the end over the same after the first
  epochs (flat: about 1);
- `parameter_spread`: over the live trainers at the end, the largest deviation of a parameter
  from their mean, over the largest mean parameter (relative); trainers one epoch apart count
  too, so it includes one step's difference;
- `step_spread`: the same over the trainers that stepped one epoch on one lineage, each taken
  right after its step (a grid round's slices: 0 where every slice averaged everyone, more
  where a slice lost a member), the largest over the epochs; a step whose state round came
  before the next sample (the same simulated second) is not measured: `state_round_spread`
  has it;
- `state_round_spread`: the same over the trainers that averaged their state at one epoch, each
  taken right after that round, the largest over the epochs ("parameters agree after state
  averaging");
- `spread_by_epoch`: both, per epoch (as strings), each followed by the number of states it was
  measured over;
- `max_round_weight`: the most weight (samples) a round an honest trainer stepped on averaged,
  in target batches (about 1; a liar's claimed weight would show);
- `board_reads`: how many times the peers read the progress board, and `board_read_seconds`:
  how long those reads took on the virtual clock (p50, p90, max; a read ends at its deadline,
  5 s, with what had come by then): at 256 peers these reads took seconds, and the trainers
  decided that an epoch's target was reached up to 20 s apart;
- `parameters_digest`: a digest of every live trainer's parameters at the end, bit for bit:
  two runs of one command (one seed) give the same (the simulator is deterministic: loop.py,
  and `python -m dedloc.sim --trace` to find where two runs part if they do not);
- `partition` also: `epochs_to_reconcile` (after the heal, epochs until every live trainer holds
  the same parameters) and `epoch_went_backwards`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dedloc.daemon.averaging.accounts import MAX_ACCOUNT_SENDERS
from dedloc.daemon.collab.policy import Timing

from .loop import START
from .network import LinkProfile
from .swarm import Lie, PeerSpec, RunSpec, SimPeer, Swarm

__all__ = ["SCENARIOS", "Result", "run_scenario"]

EPOCH_SECONDS = 20.0  # what a run's target batch takes its trainers, in simulated seconds
# a trainer that has been live this long and never stepped or downloaded a state counts as one
# that should be in the rounds (one that never syncs would otherwise never count against the
# participation)
SYNC_GRACE = 4 * EPOCH_SECONDS
TICK = 1.0
FINAL_SAMPLES = 5  # seconds sampled after a scenario's goal is reached


@dataclass
class Result:
    scenario: str
    peers: int
    aux: int
    seed: int
    epochs: int = 0
    split_brain: bool = False
    min_round_participation: float = 1.0
    lowest_round: dict[str, Any] | None = None  # that round: epoch, trainers in it and live then
    max_epoch_spread: int = 0
    # when max_epoch_spread was first seen, the epochs then, and the trainers at the lowest one
    widest_spread: dict[str, Any] | None = None
    newcomer_epochs_to_contribute: int = 0
    newcomers: int = 0
    max_donor_load_ratio: float = 0.0
    state_downloads: int = 0
    failed_rounds: int = 0
    reports_beyond_pace: int = 0  # peers' far epochs the others did not believe (pace.py)
    reports_unserved: int = 0  # peers ahead passed over once their state failed (estimate.py)
    memory_growth: float = 1.0
    rss_per_peer_bytes: int = 0
    simulated_seconds: float = 0.0
    wall_seconds: float = 0.0
    epochs_to_reconcile: int | None = None
    epoch_went_backwards: bool | None = None
    parameter_spread: float = 0.0  # relative, over live trainers at the end
    step_spread: float = 0.0  # relative, over the trainers of one step, the largest
    state_round_spread: float = 0.0  # relative, over the trainers of one state round, the largest
    # the most weight a round an honest trainer stepped on averaged, in target batches
    max_round_weight: float = 0.0
    board_reads: int = 0
    board_read_seconds: dict[str, float] = field(default_factory=dict)  # p50, p90, max
    # epoch -> [step spread, trainers measured, state round spread, trainers measured]: where
    # in a run the trainers drew apart (a hidden split in the first round, or every epoch)
    spread_by_epoch: dict[str, list[float]] = field(default_factory=dict)
    parameters_digest: str = ""  # of every live trainer's parameters at the end, bit for bit
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.scenario != "partition":
            data.pop("epochs_to_reconcile")
            data.pop("epoch_went_backwards")
        return data


def _digest(peer: SimPeer) -> bytes:
    assert peer.trainer is not None
    return hashlib.blake2b(peer.trainer.parameters.tobytes(), digest_size=8).digest()


def _spread(states: Sequence[Any]) -> float:
    """The largest deviation of a parameter from the states' mean, over the largest mean
    parameter (relative)."""
    if len(states) < 2:
        return 0.0
    import numpy as np
    stacked = np.stack(states)
    mean = stacked.mean(axis=0)
    return float(np.abs(stacked - mean).max() / max(1e-12, np.abs(mean).max()))


def _rss() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Observer:
    """Samples every peer each simulated second and collects every step it took."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.steps: dict[int, dict[str, set[bytes]]] = defaultdict(lambda: defaultdict(set))
        # per round (epoch, lineage): the honest trainers that stepped in it, and those that
        # should have (live, synced before the round's target was reached: `_record_step`)
        self.participants: dict[tuple[int, str], set[int]] = defaultdict(set)
        self.live_at_round: dict[tuple[int, str], set[int]] = {}
        self.max_spread = 0
        self.widest: dict[str, Any] | None = None  # Result.widest_spread
        self.max_round_weight = 0.0  # samples
        self.backwards = False
        self.excluded_epochs: set[int] = set()  # stepped during a partition: not split brain
        self.excluding = False
        self._seen_rounds: dict[int, int] = {}
        self._last_epoch: dict[int, int] = {}
        self._first_contribution: dict[int, int] = {}
        self._seen_state_rounds: dict[int, int] = {}
        # parameters right after a step (epoch, lineage) and right after a state round (epoch)
        self.stepped: dict[tuple[int, str], list[Any]] = defaultdict(list)
        self.state_averaged: dict[int, list[Any]] = defaultdict(list)
        self._step_spread = 0.0  # of the steps folded (their states dropped)
        self._state_round_spread = 0.0
        self.by_epoch: dict[int, list[float]] = {}  # Result.spread_by_epoch
        self.rss: list[tuple[float, int]] = []
        # memory per peer is compared with the sample at this index (a scenario that grows the
        # swarm moves it past the growth: a peer's links grow with the swarm, not with time)
        self.rss_baseline = 2

    async def watch(self) -> None:
        """Sample every TICK for the whole scenario: while its script waits, and while it adds
        peers (a swarm's start takes minutes of simulated time at 128 peers, and the first
        peers step meanwhile)."""
        while True:
            await asyncio.sleep(TICK)
            self.sample()

    def established(self) -> list[SimPeer]:
        return [p for p in self.swarm.live if p.spec.role == "trainer" and p.synced_at is not None]

    def sample(self) -> None:
        now = self.swarm.loop.time()
        for peer in self.swarm.live:
            engine = peer.engine
            if engine is None or peer.spec.role != "trainer":
                continue
            progress = engine.progress
            if peer.synced_at is None and (progress.rounds or progress.state_downloads):
                peer.synced_at = now
            previous = self._last_epoch.get(peer.index)
            if previous is not None and progress.epoch < previous:
                self.backwards = True
            self._last_epoch[peer.index] = progress.epoch
            new = progress.rounds - self._seen_rounds.get(peer.index, 0)
            state_new = progress.state_rounds - self._seen_state_rounds.get(peer.index, 0)
            if new > 0:
                history = list(engine.epoch_history)[-new:]
                for entry in history:
                    self._record_step(peer, entry, state_averaged=state_new > 0)
                self._seen_rounds[peer.index] = progress.rounds
            if state_new > 0:
                # a state round follows its step: the parameters are the round's if nothing
                # else happened since the last sample
                if state_new == 1 and new <= 1 and peer.trainer is not None:
                    self.state_averaged[progress.epoch].append(peer.trainer.parameters.copy())
                self._seen_state_rounds[peer.index] = progress.state_rounds
        self._fold(max(self._last_epoch.values(), default=0) - 3)
        live = self.established()
        if live and not self.excluding:
            epochs = [p.engine.progress.epoch for p in live if p.engine is not None]
            if epochs and max(epochs) - min(epochs) > self.max_spread:
                self.max_spread = max(epochs) - min(epochs)
                self.widest = self._describe_spread(live, now)
        if int(now) % 10 == 0:
            self.rss.append((now, _rss() // max(1, len(self.swarm.live))))

    def _describe_spread(self, live: list[SimPeer], now: float) -> dict[str, Any]:
        """The epochs of the established trainers and what those at the lowest were doing."""
        epochs = [p.engine.progress.epoch for p in live if p.engine is not None]
        low = min(epochs)
        laggards = []
        for peer in live:
            engine = peer.engine
            if engine is None or engine.progress.epoch != low:
                continue
            progress = engine.progress
            laggards.append({
                "peer": peer.index, "phase": engine.phase.value,
                "started": round(peer.started_at - START, 1),
                "synced": None if peer.synced_at is None else round(peer.synced_at - START, 1),
                "rounds": progress.rounds, "failed_rounds": progress.failed_rounds,
                "state_downloads": progress.state_downloads,
                "failed_state_downloads": progress.failed_state_downloads,
                "accumulated": progress.accumulated})
        return {"at": round(now - START, 1), "low": low, "high": max(epochs),
                "by_epoch": {str(e): epochs.count(e) for e in sorted(set(epochs))},
                "laggards": laggards[:16]}

    def _record_step(self, peer: SimPeer, entry: dict[str, Any], *, state_averaged: bool) -> None:
        epoch, lineage = entry["epoch"], entry["lineage"]
        assert peer.trainer is not None
        # the parameters the step produced: the trainer's at the time of this sample only if it
        # has not moved on since; a later step's state is recorded by that step
        current = peer.engine is not None and peer.engine.progress.epoch == epoch + 1
        digest = _digest(peer) if current else b""
        if current and not state_averaged:
            self.stepped[(epoch, lineage)].append(peer.trainer.parameters.copy())
        # a grid round's slices average in another order: the same state up to float rounding,
        # not to the bit (parameter_spread measures it)
        self.steps[epoch][lineage].add(digest if entry.get("stages", 1) == 1 else b"")
        if self.excluding:
            self.excluded_epochs.add(epoch)
        # (participation is the honest trainers': a liar whose reports the others rightly
        # disbelieve is left out of their rounds)
        key = (epoch, lineage)
        if peer.spec.lie is None:
            self.participants[key].add(peer.index)
        if key not in self.live_at_round:
            reached = entry["target_reached_at"] - _unix_offset(self.swarm)
            self.live_at_round[key] = {
                p.index for p in self.swarm.live if p.spec.role == "trainer" and p.spec.lie is None and (
                    (p.synced_at is not None and p.synced_at <= reached)
                    # one that had time to sync and never did counts too (not only those in)
                    or (p.synced_at is None and p.started_at <= reached - SYNC_GRACE))}
        if peer.spec.lie is None:
            self.max_round_weight = max(self.max_round_weight, float(entry.get("weight", 0.0)))
        if entry["samples"] > 0 and peer.index not in self._first_contribution:
            self._first_contribution[peer.index] = epoch

    def split_brain(self) -> bool:
        for epoch, lineages in self.steps.items():
            if epoch in self.excluded_epochs:
                continue
            if len(lineages) > 1:
                return True
            if any(len({d for d in digests if d}) > 1 for digests in lineages.values()):
                return True
        return False

    def _fold(self, before: int) -> None:
        """Measure the steps and state rounds of epochs before `before` and drop their states
        (memory stays flat)."""
        for key in [k for k in self.stepped if k[0] < before]:
            states = self.stepped.pop(key)
            spread = _spread(states)
            self._step_spread = max(self._step_spread, spread)
            entry = self.by_epoch.setdefault(key[0], [0.0, 0, 0.0, 0])
            entry[0], entry[1] = max(entry[0], spread), entry[1] + len(states)
        for epoch in [e for e in self.state_averaged if e < before]:
            states = self.state_averaged.pop(epoch)
            spread = _spread(states)
            self._state_round_spread = max(self._state_round_spread, spread)
            entry = self.by_epoch.setdefault(epoch, [0.0, 0, 0.0, 0])
            entry[2], entry[3] = max(entry[2], spread), entry[3] + len(states)

    def step_spread(self) -> float:
        self._fold(2**62)
        return self._step_spread

    def state_round_spread(self) -> float:
        self._fold(2**62)
        return self._state_round_spread

    def min_participation(self) -> float:
        lowest = self.lowest_round()
        return 1.0 if lowest is None else lowest["share"]

    def lowest_round(self) -> dict[str, Any] | None:
        """The round with the lowest share of the live trainers in it (epoch, lineage's first
        characters, the live trainers in it, the trainers live then, and `others`: trainers
        that stepped in it though they had not synced before its target was reached, counted
        in neither), or None if no round was measured."""
        lowest: dict[str, Any] | None = None
        for key, live in sorted(self.live_at_round.items()):
            if key[0] in self.excluded_epochs or not live:
                continue
            inside = self.participants[key] & live
            share = len(inside) / len(live)
            if lowest is None or share < lowest["share"]:
                lowest = {"epoch": key[0], "lineage": key[1][:8], "share": share,
                          "participants": len(inside), "live": len(live),
                          "others": len(self.participants[key] - live)}
        return lowest

    def newcomer_delay(self) -> tuple[int, int]:
        worst, count = 0, 0
        for peer in self.swarm.peers:
            if peer.run_epoch_at_join is None or peer.spec.role != "trainer":
                continue
            count += 1
            first = self._first_contribution.get(peer.index)
            if first is None:
                if peer.alive:  # never contributed while it was there
                    current = max((p.engine.progress.epoch for p in self.swarm.live
                                   if p.engine is not None), default=0)
                    worst = max(worst, current - peer.run_epoch_at_join)
                continue
            worst = max(worst, first - peer.run_epoch_at_join)
        return worst, count


def _unix_offset(swarm: Swarm) -> float:
    from .clock import UNIX_START
    return UNIX_START


async def _run_for(swarm: Swarm, seconds: float,
                   until: Callable[[], bool] | None = None) -> None:
    """Let the swarm run for `seconds`, or until `until()` (the observer samples meanwhile)."""
    end = swarm.loop.time() + seconds
    while swarm.loop.time() < end:
        await asyncio.sleep(TICK)
        if until is not None and until():
            # the round that got there ends on its other members a moment later: record them
            # (else the last round's participation is what the first sample caught of it)
            await asyncio.sleep(FINAL_SAMPLES * TICK)
            return


def _run_epoch(swarm: Swarm) -> int:
    return max((p.engine.progress.epoch for p in swarm.live
                if p.engine is not None and p.spec.role == "trainer"), default=0)


def _all_at(swarm: Swarm, epoch: int) -> bool:
    """Every live trainer has stepped to `epoch` (a scenario ends between rounds, not in one)."""
    return all(p.engine.progress.epoch >= epoch for p in swarm.live
               if p.engine is not None and p.spec.role == "trainer")


def _spec(swarm: Swarm, rng_speed: bool = True) -> PeerSpec:
    rng = swarm.rng
    speed = rng.uniform(50.0, 150.0) if rng_speed else 100.0
    link = LinkProfile(upload=rng.choice((2.5e6, 5e6, 12.5e6)), download=12.5e6,
                       latency=rng.uniform(0.005, 0.05))
    return PeerSpec("trainer", speed, link, skew=rng.uniform(-3.0, 3.0))


def _run_spec(peers: int, **overrides: Any) -> RunSpec:
    spec = RunSpec(size=overrides.pop("size", 512),
                   target_batch_size=int(peers * 100 * EPOCH_SECONDS),
                   max_group_size=overrides.pop("max_group_size", MAX_ACCOUNT_SENDERS), **overrides)
    return spec


Script = Callable[[Swarm, Observer, Result], Awaitable[None]]


async def _start(swarm: Swarm, peers: int, aux: int, observer: Observer,
                 liars: int = 0, lies: Sequence[Lie] = ("epoch", "samples")) -> None:
    for index in range(peers):
        spec = _spec(swarm)
        if index < liars:
            spec = PeerSpec(spec.role, spec.samples_per_second, spec.link, spec.skew,
                            lie=lies[index % len(lies)])
        await swarm.add(spec)
    for _ in range(aux):
        await swarm.add(PeerSpec("aux", link=LinkProfile(upload=12.5e6, download=12.5e6)))
    swarm.running = True
    # (memory per peer is compared with a sample after the start: a peer's links grow with the
    # swarm, not with time)
    observer.rss_baseline = len(observer.rss) + 2
    await _run_for(swarm, 2 * EPOCH_SECONDS)


async def _steady(swarm: Swarm, observer: Observer, result: Result, epochs: int) -> None:
    await _start(swarm, result.peers, result.aux, observer)
    start = _run_epoch(swarm)
    await _run_for(swarm, epochs * EPOCH_SECONDS * 3,
                   until=lambda: _all_at(swarm, start + epochs))


async def _flash_crowd(swarm: Swarm, observer: Observer, result: Result, epochs: int,
                       joiners: int = 100) -> None:
    await _start(swarm, result.peers, result.aux, observer)
    await _run_for(swarm, 2 * EPOCH_SECONDS)
    await asyncio.gather(*(swarm.add(_spec(swarm)) for _ in range(joiners)))
    start = _run_epoch(swarm)
    await _run_for(swarm, 2 * EPOCH_SECONDS)
    observer.rss_baseline = len(observer.rss)
    # (ends between rounds, every trainer stepped: the parameters are compared at the end)
    await _run_for(swarm, epochs * EPOCH_SECONDS * 3,
                   until=lambda: _all_at(swarm, start + epochs))


async def _churn(swarm: Swarm, observer: Observer, result: Result, epochs: int,
                 period: float = 600.0, share: float = 0.2, joiners: int = 100) -> None:
    await _start(swarm, result.peers, result.aux, observer)
    rounds = max(1, math.ceil(epochs * EPOCH_SECONDS / period))
    for turn in range(rounds):
        await _run_for(swarm, period / 2)
        if turn == 0:  # a flash crowd, then it thins out again with the churn
            await asyncio.gather(*(swarm.add(_spec(swarm)) for _ in range(joiners)))
            await _run_for(swarm, 2 * EPOCH_SECONDS)
            observer.rss_baseline = len(observer.rss)
            await _run_for(swarm, max(0.0, period / 2 - 2 * EPOCH_SECONDS))
        else:
            await _run_for(swarm, period / 2)
        trainers = [p for p in swarm.live if p.spec.role == "trainer"]
        leaving = swarm.rng.sample(trainers, int(share * result.peers))
        await asyncio.gather(*(p.stop(crash=swarm.rng.random() < 0.5) for p in leaving))
        await asyncio.gather(*(swarm.add(_spec(swarm)) for _ in leaving))
    # ends between rounds, once the last replacements stepped too (ending on a fixed time, the
    # last round was measured over whichever of its members the final sample caught)
    start = _run_epoch(swarm)
    await _run_for(swarm, 8 * EPOCH_SECONDS, until=lambda: _all_at(swarm, start + 2))


async def _partition(swarm: Swarm, observer: Observer, result: Result, epochs: int,
                     seconds: float = 300.0) -> None:
    await _start(swarm, result.peers, result.aux, observer)
    await _run_for(swarm, 2 * EPOCH_SECONDS)
    hosts = [p.host.index for p in swarm.live]
    half = set(hosts[: len(hosts) // 2])
    observer.excluding = True
    swarm.network.partition(half, set(hosts) - half)
    await _run_for(swarm, seconds)
    swarm.network.heal()
    healed_at = _run_epoch(swarm)
    # the stale reports of the other side go first: steps in the first epochs after the heal
    # still belong to the partition
    await _run_for(swarm, 2 * EPOCH_SECONDS)
    observer.excluding = False

    def reconciled() -> bool:
        trainers = [p for p in swarm.live if p.spec.role == "trainer" and p.trainer is not None]
        heads = {(p.engine.progress.epoch, _digest(p)) for p in trainers if p.engine is not None}
        return len(heads) == 1

    await _run_for(swarm, epochs * EPOCH_SECONDS * 3, until=reconciled)
    result.epochs_to_reconcile = _run_epoch(swarm) - healed_at if reconciled() else None
    await _run_for(swarm, 2 * EPOCH_SECONDS)


async def _liars(swarm: Swarm, observer: Observer, result: Result, epochs: int,
                 lies: Sequence[Lie] = ("epoch", "samples"), share: float = 0.05,
                 arrive_after: int = 0) -> None:
    """`share` of the trainers (5 %) lie, in turn as `lies` says: "epoch" (far ahead,
    colluding), "next" (the epoch after their own, on a lineage of their own, colluding),
    "samples" (a full batch, fast), "weight" (WEIGHT_LIE_TARGETS target batches in rounds); from the
    start, or arriving once the run has stepped `arrive_after` epochs."""
    liars = max(1, round(share * result.peers))
    if arrive_after > 0:
        await _start(swarm, result.peers - liars, result.aux, observer)
        await _run_for(swarm, (arrive_after + 2) * EPOCH_SECONDS * 3,
                       until=lambda: _all_at(swarm, arrive_after))
        for index in range(liars):
            spec = _spec(swarm)
            await swarm.add(PeerSpec(spec.role, spec.samples_per_second, spec.link, spec.skew,
                                     lie=lies[index % len(lies)]))
    else:
        await _start(swarm, result.peers, result.aux, observer, liars=liars, lies=lies)
    start = _run_epoch(swarm)
    await _run_for(swarm, epochs * EPOCH_SECONDS * 3,
                   until=lambda: _run_epoch(swarm) >= start + epochs)


SCENARIOS: dict[str, Callable[..., Awaitable[None]]] = {
    "steady": _steady, "churn": _churn, "flash-crowd": _flash_crowd, "partition": _partition,
    "liars": _liars,
}


async def run_scenario(name: str, peers: int, *, aux: int | None = None, seed: int = 0,
                       epochs: int = 10, script: dict[str, Any] | None = None,
                       **run: Any) -> Result:
    """Run scenario `name` with `peers` trainers (and `aux` aux peers) on virtual time.
    `script`: the scenario's own knobs (flash-crowd: `joiners`; churn: `period`, `share`,
    `joiners`; partition: `seconds`); `run`: RunSpec fields (e.g. `max_group_size`)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")
    aux = max(1, peers // 16) if aux is None else aux
    loop = asyncio.get_running_loop()
    wall, start = time.monotonic(), loop.time()
    swarm = Swarm(_run_spec(peers, **run), seed=seed, timing=Timing())
    observer = Observer(swarm)
    result = Result(name, peers, aux, seed)
    watching = asyncio.create_task(observer.watch())
    try:
        await SCENARIOS[name](swarm, observer, result, epochs, **(script or {}))
        if watching.done():  # the observer failed: its error, not the figures it left
            watching.result()
        watching.cancel()
        _finish(swarm, observer, result)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await swarm.close()
    result.simulated_seconds = round(loop.time() - start, 1)
    result.wall_seconds = round(time.monotonic() - wall, 1)
    return result


def _finish(swarm: Swarm, observer: Observer, result: Result) -> None:
    result.epochs = _run_epoch(swarm)
    result.split_brain = observer.split_brain()
    result.min_round_participation = round(observer.min_participation(), 3)
    lowest = observer.lowest_round()
    result.lowest_round = None if lowest is None else {**lowest, "share": round(lowest["share"], 3)}
    result.max_epoch_spread = observer.max_spread
    result.widest_spread = observer.widest
    result.newcomer_epochs_to_contribute, result.newcomers = observer.newcomer_delay()
    served = [s for p in swarm.peers
              if (s := p.sharing.served if p.sharing is not None else p.served)]
    result.max_donor_load_ratio = round(max(served) / (sum(served) / len(served)), 2) if served else 0.0
    progress = [p.progress for p in swarm.peers if p.progress is not None]
    result.state_downloads = sum(g.state_downloads for g in progress)
    result.failed_rounds = sum(g.failed_rounds for g in progress)
    result.reports_unserved = sum(g.reports_unserved for g in progress)
    result.reports_beyond_pace = sum(g.reports_beyond_pace for g in progress)
    if len(observer.rss) >= 2:
        first = observer.rss[min(observer.rss_baseline, len(observer.rss) - 1)][1]
        result.memory_growth = round(observer.rss[-1][1] / max(1, first), 2)
        result.rss_per_peer_bytes = observer.rss[-1][1]
    result.epoch_went_backwards = observer.backwards if result.scenario == "partition" else None
    result.max_round_weight = round(observer.max_round_weight / swarm.run.target_batch_size, 3)
    result.parameter_spread = _spread([p.trainer.parameters for p in swarm.live
                                       if p.trainer is not None])
    ends = hashlib.blake2b(digest_size=16)
    for peer in sorted(swarm.live, key=lambda p: p.index):
        if peer.trainer is not None:
            ends.update(peer.trainer.parameters.tobytes())
    result.parameters_digest = ends.hexdigest()
    result.step_spread = observer.step_spread()
    result.state_round_spread = observer.state_round_spread()
    result.spread_by_epoch = {
        str(epoch): [float(f"{v:.3g}") if i % 2 == 0 else v for i, v in enumerate(entry)]
        for epoch, entry in sorted(observer.by_epoch.items())}
    reads = sorted(swarm.board_reads)
    result.board_reads = len(reads)
    if reads:
        result.board_read_seconds = {
            "p50": round(reads[len(reads) // 2], 3), "p90": round(reads[int(0.9 * len(reads))], 3),
            "max": round(reads[-1], 3)}
    result.errors = [f"peer {p.index}: {p.error!r}" for p in swarm.peers if p.error is not None]
