"""A trainer settling before a first grid round watches for the round's roster (engine.py).

The engine runs on the simulator's virtual clock with in-memory ports: a board whose trainers
all stand at the run's head with the target reached, and an averager whose groups are smaller
than the swarm (a grid round) and whose roster appears when the test says. What is checked is
what the engine does: when it begins the round, and how often it reads the roster's key.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.engine import RunEngine, RunProgress
from dedloc.daemon.collab.policy import Schedule, Timing
from dedloc.daemon.collab.ports import DownloadedState, Trained
from dedloc.daemon.collab.progress import PeerProgress, Role
from dedloc.daemon.collab.roster_watch import ROSTER_FRESH, ROSTER_POLL, ROSTER_WATCH
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual

LINEAGE = "0" * 32  # the run's first head
TARGET = 120
TIMING = Timing()  # settle 10 s: without a roster, the round begins that long after the head grew


class StandingBoard:
    """Eleven other trainers at epoch 0, 20 samples each: the target is reached."""

    def __init__(self) -> None:
        self.peers = [f"peer-{i:02d}" for i in range(11)]

    async def publish(self, report: PeerProgress) -> None:
        return None

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        now = timebase.now()
        reports = [PeerProgress(peer, 0, 20, 10.0, now, now + 30.0, "trainer", 20, lineage=LINEAGE)
                   for peer in self.peers]
        return reports, {peer: now for peer in self.peers}

    async def leave(self, report: PeerProgress) -> None:
        return None


@dataclass
class GridAverager:
    """Groups of 4 (a round of 12 is a grid round); the roster is out from `roster_at` (virtual
    seconds; None: never). `average` notes when the round began and ends the run."""

    roster_at: float | None
    epoch: int = 0  # the head's, whose round's roster is asked for
    written_before: float = 0.0  # the roster was written this long before it is out (a stale one)
    rounds: int = 1  # the rounds it takes part in (each fails) before it ends the run
    engine: RunEngine | None = None
    roster_reads: list[float] = field(default_factory=list)
    began_at: float | None = None
    tries: list[float] = field(default_factory=list)
    options: dict[str, object] = field(default_factory=dict)

    @property
    def max_group_size(self) -> int:
        return 4

    async def average(self, vector: np.ndarray, key: str, **options: object) -> AveragingReport | None:
        now = asyncio.get_running_loop().time()
        self.began_at = now if self.began_at is None else self.began_at
        self.tries.append(now)
        self.options = options
        assert self.engine is not None
        if len(self.tries) >= self.rounds:
            self.engine.stop()
        await asyncio.sleep(5.0)  # (virtual) a window without the others: the round fails
        return None

    async def roster_published(self, key: str, trainers: Collection[str], *,
                               timeout: float) -> float | None:
        now = asyncio.get_running_loop().time()
        self.roster_reads.append(now)
        assert key.startswith(f"grad/{self.epoch}/") and len(trainers) == 12
        if self.roster_at is None or now < self.roster_at:
            return None
        return timebase.now() - (now - self.roster_at) - self.written_before  # its writer's date


class CountingTrainer:
    """A trainer of 10 samples a second; its gradients are zeros."""

    def __init__(self) -> None:
        self.vector = np.zeros(8, dtype=np.float32)

    async def train(self, samples: int, seconds: float) -> Trained:
        await asyncio.sleep(min(seconds, samples / 10.0))
        return Trained(samples, 1.0, 10.0)

    async def export_gradients(self) -> np.ndarray:
        return self.vector

    async def step(self, epoch: int) -> float | None:
        return 0.1

    async def zero_grad(self) -> None:
        return None

    async def settle_residual(self, residual: np.ndarray) -> None:
        return None

    async def export_state(self) -> DownloadedState:
        raise NotImplementedError("no downloads in this test")


def run_settling(roster_at: float | None) -> tuple[GridAverager, float, str]:
    """Run one trainer's engine until it begins its first grid round; the averager, the virtual
    second the trainer first read the board, and why the engine left."""

    async def main() -> tuple[GridAverager, float, str]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        averager = GridAverager(None if roster_at is None else loop.time() + roster_at)
        role: Role = "trainer"
        engine = RunEngine(peer_id="peer-me", role=role, schedule=Schedule(TARGET),
                           board=StandingBoard(), averaging=averager, trainer=CountingTrainer(),
                           progress=RunProgress(lineage=LINEAGE), parameters=8, timing=TIMING)
        averager.engine = engine
        started = loop.time()
        reason = await asyncio.wait_for(engine.run(), timeout=3600)
        return averager, started, reason

    return run_virtual(main())


def test_a_settling_trainer_begins_once_the_roster_is_out() -> None:
    averager, started, reason = run_settling(roster_at=3.0)
    assert reason == "stopped"
    assert averager.began_at is not None
    # it began on the roster (3 s in, read within ROSTER_POLL), not after settling 10 s
    assert started + 3.0 <= averager.began_at < started + 3.0 + ROSTER_POLL + TIMING.max_chunk
    assert averager.began_at < started + TIMING.settle
    assert averager.options["aggregation"] == "norm_clip"  # a run's default rule, asked for


def test_without_a_roster_it_settles_and_reads_the_key_at_most_once_a_poll() -> None:
    averager, started, reason = run_settling(roster_at=None)
    assert reason == "stopped"
    assert averager.began_at is not None
    assert averager.began_at >= started + TIMING.settle  # the view stayed the same for settle s
    reads = averager.roster_reads
    assert len(reads) >= 5  # it kept watching while it settled ...
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    assert min(gaps) >= ROSTER_POLL - 1e-9  # ... at most once a poll


# --- a later round: a peer whose estimate has the round later begins on the roster -------------

class FillingBoard:
    """Eleven other trainers at epoch 3 (a later round: they stepped there), each 1 sample a
    second from the board's first read: with our 10 a second, 1200 samples take about a minute."""

    def __init__(self) -> None:
        self.peers = [f"peer-{i:02d}" for i in range(11)]
        self.start: float | None = None

    async def publish(self, report: PeerProgress) -> None:
        return None

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        now = timebase.now()
        self.start = now if self.start is None else self.start
        done = int(now - self.start)
        reports = [PeerProgress(peer, 3, done, 1.0, now, now + 30.0, "trainer", 100 + done,
                                lineage=LINEAGE, stepped=True) for peer in self.peers]
        return reports, {peer: now for peer in self.peers}

    async def leave(self, report: PeerProgress) -> None:
        return None


class PacedTrainer(CountingTrainer):
    """10 samples a second, however many it is asked for."""

    async def train(self, samples: int, seconds: float) -> Trained:
        done = max(1, min(samples, int(10 * seconds)))
        await asyncio.sleep(done / 10.0)
        return Trained(done, 1.0, 10.0)


def run_later_round(roster_at: float | None, *, written_before: float = 0.0,
                    rounds: int = 1) -> tuple[GridAverager, float]:
    async def main() -> tuple[GridAverager, float]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        averager = GridAverager(None if roster_at is None else loop.time() + roster_at, epoch=3,
                                written_before=written_before, rounds=rounds)
        engine = RunEngine(peer_id="peer-me", role="trainer", schedule=Schedule(1200),
                           board=FillingBoard(), averaging=averager, trainer=PacedTrainer(),
                           progress=RunProgress(epoch=3, lineage=LINEAGE), parameters=8,
                           timing=TIMING)
        averager.engine = engine
        started = loop.time()
        await asyncio.wait_for(engine.run(), timeout=3600)
        return averager, started

    return run_virtual(main())


def test_a_peer_at_the_head_begins_a_later_grid_round_once_its_roster_is_out() -> None:
    alone, started = run_later_round(roster_at=None)
    assert alone.began_at is not None
    due = alone.began_at - started  # when its own estimate had the target reached
    assert due > ROSTER_WATCH + 10.0
    # it read the key only in the last ROSTER_WATCH seconds before that, at most once a poll
    reads = alone.roster_reads
    assert reads and reads[0] >= started + due - ROSTER_WATCH - TIMING.max_look
    assert min(b - a for a, b in itertools.pairwise(reads)) >= ROSTER_POLL - 1e-9
    # with the roster out 8 s before that, it begins then (the others have begun)
    early, started = run_later_round(roster_at=due - 8.0)
    assert early.began_at is not None
    assert started + due - 8.0 <= early.began_at < started + due - 8.0 + ROSTER_POLL + TIMING.max_look


def test_a_stale_roster_or_one_of_a_failed_try_does_not_start_a_round() -> None:
    """A roster stays in the DHT for minutes: one its writer dated long ago (an earlier try of the
    round, which failed) says nobody is in a round now; and once a try of its own on a roster
    failed, the peer trains to its own estimate again instead of trying again at once."""
    alone, started = run_later_round(roster_at=None)
    assert alone.began_at is not None
    due = alone.began_at - started  # when its own estimate had the round due
    stale, started = run_later_round(roster_at=0.0, written_before=ROSTER_FRESH + 60.0)
    assert stale.began_at == started + due  # as without a roster
    # a fresh roster 8 s early: it begins then, the round fails (the others are not there) ...
    failing, started = run_later_round(roster_at=due - 8.0, rounds=3)
    assert len(failing.tries) == 3
    assert failing.tries[0] < started + due - 6.0
    # ... and it does not try again at once: it trains on until its own estimate has it due
    assert failing.tries[1] >= started + due - 1.0
