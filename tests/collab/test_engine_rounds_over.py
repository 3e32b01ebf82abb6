"""A trainer tells its averaging when it moves past a head (rounds.py, gatherings.py): peers that
ask late to join a round there are then told it is over, and move on at once.

One trainer alone in its run (its rounds are groups of one) on the simulator's virtual clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np
from collab.engine_fakes import CountingTrainer
from collab.test_engine_hold import OURS, TARGET, RecordingAverager, ScriptedBoard, run_engine

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.engine import RunEngine, RunProgress
from dedloc.daemon.collab.estimate import Head
from dedloc.daemon.collab.policy import Schedule, round_key
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.collab.rounds import SoloRounds
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual


class OwnBoard:
    """The board of a run with one trainer: what it published."""

    def __init__(self) -> None:
        self.report: PeerProgress | None = None

    async def publish(self, report: PeerProgress) -> None:
        self.report = report

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        if self.report is None:
            return [], {}
        return [self.report], {self.report.peer_id: timebase.now()}

    async def leave(self, report: PeerProgress) -> None:
        return None


class RecordingRounds(SoloRounds):
    """Rounds alone; notes each round's key and each head the engine says it moved past, in
    the order they came, with the engine's head at that moment."""

    def __init__(self) -> None:
        super().__init__("peer-me")
        self.engine: RunEngine | None = None
        self.events: list[tuple[str, str, Head]] = []

    async def average(self, vector: np.ndarray, key: str, **options: object  # type: ignore[override]
                      ) -> AveragingReport | None:
        assert self.engine is not None
        self.events.append(("round", key, self.engine.head))
        return await super().average(vector, key, **options)  # type: ignore[arg-type]

    def round_over(self, key: str) -> None:
        assert self.engine is not None
        self.events.append(("over", key, self.engine.head))


def test_a_trainer_says_each_round_is_over_as_it_steps_past_its_head() -> None:
    async def main() -> tuple[list[tuple[str, str, Head]], RunEngine]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        rounds = RecordingRounds()
        engine = RunEngine(peer_id="peer-me", role="trainer", schedule=Schedule(20, epochs=3),
                           board=OwnBoard(), averaging=rounds, trainer=CountingTrainer(),
                           progress=RunProgress(epoch=0, lineage="a" * 32), parameters=8)
        rounds.engine = engine
        await asyncio.wait_for(engine.run(), timeout=3600)
        return rounds.events, engine

    events, engine = run_virtual(main())
    assert engine.progress.epoch == 3
    grad_rounds = [(key, head) for kind, key, head in events if kind == "round"]
    assert [head.epoch for _, head in grad_rounds] == [0, 1, 2]
    for key, head in grad_rounds:
        # after its round, before its head moved on, the trainer said both rounds of the head over
        after = events[events.index(("round", key, head)) + 1:]
        assert after[:2] == [("over", round_key("grad", head), head),
                             ("over", round_key("state", head), head)]



class CappedAverager(RecordingAverager):
    """Rounds that fail at once (as for a trainer whose peers all answer `RoundOver`); past
    `cap` of them it raises (a hot loop never lets virtual time pass: the test would not end)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    async def average(self, vector: np.ndarray, key: str, **options: object) -> AveragingReport | None:
        if len(self.rounds) >= self.cap:
            raise AssertionError(f"{self.cap} rounds: failed rounds retried in a hot loop")
        return await super().average(vector, key, **options)


def test_a_round_that_fails_again_at_once_is_retried_only_after_a_look_for_the_others_step() -> None:
    # a board of 6 trainers at our head that never shows them step (their reports are due
    # after their state round); every round of ours fails at once. Retried at once each time,
    # the trainer ran its rounds in a hot loop; now after two quick failures it looks at the run
    # for `failed_part_wait` before the next
    averager = CappedAverager(cap=60)
    rounds, _, engine, started = run_engine([f"peer-{i}" for i in range(6)], [],
                                            averager=averager, stop_after=40.0)
    times = [t - started for t, _ in rounds.rounds]
    assert len(times) >= 4  # (it took rounds, and retried them)
    wait = engine.timing.failed_part_wait
    assert all(later - earlier >= wait - 1e-6 for earlier, later in zip(times, times[2:], strict=False))


def test_an_aux_peers_round_that_fails_again_at_once_waits_before_the_next() -> None:
    # the same for an aux peer: its view a head behind the trainers, every round of it fails at
    # once (seen in the 64-peer churn simulation: one retried every 1.4 s, about ten times)
    averager = CappedAverager(cap=60)

    async def main() -> tuple[list[float], RunEngine, float]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        board = ScriptedBoard([f"peer-{i}" for i in range(6)], [], started=loop.time())
        engine = RunEngine(peer_id="peer-aux", role="aux", schedule=Schedule(TARGET),
                           board=board, averaging=averager, trainer=None,
                           progress=RunProgress(epoch=2, lineage=OURS), parameters=8)
        loop.call_later(40.0, engine.stop)
        assert await asyncio.wait_for(engine.run(), timeout=3600) == "stopped"
        return [t for t, _ in averager.rounds], engine, board.started

    times, engine, _ = run_virtual(main())
    assert len(times) >= 4
    wait = engine.timing.failed_part_wait
    assert all(later - earlier >= wait - 1e-6 for earlier, later in zip(times, times[2:], strict=False))
