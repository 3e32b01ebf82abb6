"""A trainer tells its averaging when it moves past a head (rounds.py, gatherings.py): peers that
ask late to join a round there are then told it is over, and move on at once.

One trainer alone in its run (its rounds are groups of one) on the simulator's virtual clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import numpy as np
from collab.engine_fakes import CountingTrainer
from collab.scripted_run import (
    HONEST,
    LIARS,
    OURS,
    TARGET,
    THEIRS,
    RecordingAverager,
    RefusingStates,
    ScriptedBoard,
    run_engine,
)

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.engine import RunEngine, RunProgress
from dedloc.daemon.collab.estimate import Head
from dedloc.daemon.collab.policy import Schedule, round_key
from dedloc.daemon.collab.ports import DownloadedState
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.collab.rounds import SoloRounds
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual
from dedloc.sim.trainer import ArrayBuffer


class OwnBoard:
    """The board of a run with one trainer: what it published."""

    def __init__(self) -> None:
        self.report: PeerProgress | None = None

    async def publish(self, report: PeerProgress) -> bool:
        self.report = report
        return True

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



def test_a_trainer_says_its_heads_rounds_are_over_as_a_state_round_moves_it_on() -> None:
    # a state round after each step moves the trainer to another lineage of the same epoch:
    # before it does, it says the rounds of the head it stepped to are over
    class StateTrainer(CountingTrainer):
        async def export_state(self) -> DownloadedState:
            return DownloadedState(ArrayBuffer(8), 8, {}, 0, None)

    class PairedStateRounds(RecordingRounds):
        """Rounds alone, but reported as if with another trainer (so a state round is due)."""

        async def average(self, vector: np.ndarray, key: str, **options: object  # type: ignore[override]
                          ) -> AveragingReport | None:
            report = await super().average(vector, key, **options)
            assert report is not None
            return dataclasses.replace(report, members=("peer-me", "peer-other"), trainers=2)

    async def main() -> tuple[list[tuple[str, str, Head]], RunEngine]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        rounds = PairedStateRounds()
        engine = RunEngine(peer_id="peer-me", role="trainer",
                           schedule=Schedule(20, epochs=2, average_state_every=1),
                           board=OwnBoard(), averaging=rounds, trainer=StateTrainer(),
                           progress=RunProgress(epoch=0, lineage="a" * 32), parameters=8)
        rounds.engine = engine
        await asyncio.wait_for(engine.run(), timeout=3600)
        return rounds.events, engine

    events, engine = run_virtual(main())
    assert engine.progress.epoch == 2 and engine.progress.state_rounds == 2
    state_rounds = [(key, head) for kind, key, head in events
                    if kind == "round" and key.startswith("state/")]
    assert len(state_rounds) == 2
    for key, head in state_rounds:  # (the head it stepped to: the state round's own)
        assert key == round_key("state", head)
        after = events[events.index(("round", key, head)) + 1:]
        assert after[:2] == [("over", round_key("grad", head), head),
                             ("over", round_key("state", head), head)]
        # then its lineage moved on (the next event's head, or the engine's at the end)
        assert (after[2][2] if len(after) > 2 else engine.head) != head


class OverAverager(RecordingAverager):
    """`RecordingAverager` that also notes the keys the engine says are over, with its head."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: RunEngine | None = None
        self.over: list[tuple[str, Head]] = []

    def round_over(self, key: str) -> None:
        assert self.engine is not None
        self.over.append((key, self.engine.head))


def test_a_trainer_says_its_heads_rounds_are_over_as_it_loads_a_state_past_it() -> None:
    # 5 of 11 trainers at the trainer's head (2, OURS) report stepping to (3, THEIRS): it
    # downloads their state; before its head moves there it says the rounds of (2, OURS) over,
    # so a newcomer that asks to join them late is told so at once
    class ServingStates(RefusingStates):
        async def download(self, donor: str, expect: Head | None = None,
                           others: int = 0) -> DownloadedState:
            assert self.engine is not None
            averager.engine = self.engine
            self.engine.stop()  # (after this download)
            self.downloads.append((asyncio.get_running_loop().time(), donor, expect))
            return DownloadedState(ArrayBuffer(8), 8, {}, 3, THEIRS)

        async def witness(self, peer: str, state: DownloadedState) -> bool | None:
            return True

    averager = OverAverager()
    _, states, engine, _ = run_engine(HONEST + LIARS, LIARS, averager=averager,
                                      states=ServingStates())
    assert len(states.downloads) == 1 and engine.head == Head(3, THEIRS)
    ours = Head(2, OURS)
    assert averager.over == [(round_key("grad", ours), ours), (round_key("state", ours), ours)]


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
