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
from collab.engine_fakes import CountingTrainer

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.engine import ROSTER_POLL, RunEngine, RunProgress
from dedloc.daemon.collab.policy import Schedule, Timing
from dedloc.daemon.collab.ports import DownloadedState
from dedloc.daemon.collab.progress import PeerProgress, Role
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual

LINEAGE = "0" * 32  # the run's first head
TARGET = 120
TIMING = Timing()  # settle 10 s: without a roster, the round begins that long after the head grew


class StandingBoard:
    """Eleven other trainers at epoch 0, 20 samples each: the target is reached."""

    def __init__(self) -> None:
        self.peers = [f"peer-{i:02d}" for i in range(11)]

    async def publish(self, report: PeerProgress) -> bool:
        return True

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
    engine: RunEngine | None = None
    roster_reads: list[float] = field(default_factory=list)
    began_at: float | None = None
    options: dict[str, object] = field(default_factory=dict)

    @property
    def max_group_size(self) -> int:
        return 4

    async def average(self, vector: np.ndarray, key: str, **options: object) -> AveragingReport | None:
        self.began_at = asyncio.get_running_loop().time()
        self.options = options
        assert self.engine is not None
        self.engine.stop()
        return None

    def refused(self, peers: object) -> frozenset[str]:
        return frozenset()

    def round_over(self, key: str) -> None:
        pass

    async def roster_published(self, key: str, trainers: Collection[str], *,
                               timeout: float) -> bool:
        now = asyncio.get_running_loop().time()
        self.roster_reads.append(now)
        assert key.startswith("grad/0/") and len(trainers) == 12
        return self.roster_at is not None and now >= self.roster_at


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


def test_a_trainer_a_grid_round_has_no_room_for_sits_it_out_and_keeps_its_samples() -> None:
    # RoundSatOut (a newcomer beyond the slices' room): no failed round tried again at once
    # (it was, every half second, until the head moved), but a look's wait, its samples kept
    from dedloc.daemon.collab.errors import RoundSatOut

    @dataclass
    class NoRoom(GridAverager):
        calls: list[tuple[float, int]] = field(default_factory=list)

        async def average(self, vector: np.ndarray, key: str,
                          **options: object) -> AveragingReport | None:
            assert self.engine is not None
            self.calls.append((asyncio.get_running_loop().time(),
                               self.engine.progress.accumulated))
            if len(self.calls) == 1:
                raise RoundSatOut(f"no slice of grid round {key} has room for this trainer")
            self.engine.stop()
            return None

    async def main() -> tuple[NoRoom, RunEngine]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        averager = NoRoom(roster_at=0.0)
        engine = RunEngine(peer_id="peer-me", role="trainer", schedule=Schedule(TARGET),
                           board=StandingBoard(), averaging=averager, trainer=CountingTrainer(),
                           progress=RunProgress(lineage=LINEAGE), parameters=8, timing=TIMING)
        averager.engine = engine
        assert await asyncio.wait_for(engine.run(), timeout=3600) == "stopped"
        return averager, engine

    averager, engine = run_virtual(main())
    assert len(averager.calls) == 2, averager.calls
    (first, samples), (second, kept) = averager.calls
    assert samples > 0 and kept >= samples  # its samples go to the next round
    assert second - first >= TIMING.max_look  # a look later, not at once
    assert engine.progress.rounds_sat_out == 1 and engine.progress.failed_rounds == 1  # the 2nd


def test_a_state_round_with_no_room_for_this_trainer_is_skipped_not_fatal() -> None:
    # a state round's roster may leave a trainer of the step out (its writer had not seen it):
    # RoundSatOut there ended the run as failed; now the state round is skipped and it trains on
    from dedloc.daemon.collab.errors import RoundSatOut

    class StateTrainer(CountingTrainer):
        async def export_state(self) -> DownloadedState:
            class Buffer:
                array = np.zeros(8, np.float32)

            class State:
                numel, buffer = 8, Buffer()

                def close(self) -> None:
                    return None
            return State()  # type: ignore[return-value]

    @dataclass
    class StateNoRoom(GridAverager):
        keys: list[str] = field(default_factory=list)

        async def average(self, vector: np.ndarray, key: str,
                          **options: object) -> AveragingReport | None:
            assert self.engine is not None
            self.keys.append(key)
            if key.startswith("state/"):
                self.engine.stop()  # (it ends once the state round is over, if it survives it)
                raise RoundSatOut(f"no slice of grid round {key} has room for this trainer")
            members = ("peer-me", *StandingBoard().peers)
            return AveragingReport(
                key=key, group_id="grid/" + key, members=members, trainers=12, senders=12,
                part=(0, 8), shares=(8,), seconds=1.0, matchmaking_seconds=0.1,
                allreduce_seconds=0.1, bytes_sent=0, bytes_received=0, failed_parts=(),
                senders_excluded={}, senders_rejected={}, finished_at=timebase.now(),
                weight=240.0, represented=12, stages=2)

    async def main() -> tuple[StateNoRoom, RunEngine, str]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        averager = StateNoRoom(roster_at=0.0)
        engine = RunEngine(peer_id="peer-me", role="trainer",
                           schedule=Schedule(TARGET, average_state_every=1),
                           board=StandingBoard(), averaging=averager, trainer=StateTrainer(),
                           progress=RunProgress(lineage=LINEAGE), parameters=8, timing=TIMING)
        averager.engine = engine
        reason = await asyncio.wait_for(engine.run(), timeout=3600)
        return averager, engine, reason

    averager, engine, reason = run_virtual(main())
    assert reason == "stopped"
    assert [k.split("/")[0] for k in averager.keys] == ["grad", "state"], averager.keys
    assert engine.progress.failed_state_rounds == 1 and engine.progress.rounds == 1
