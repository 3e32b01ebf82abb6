"""What a waiting trainer publishes (engine.py, REPUBLISH_UNCHANGED): it looks at the run every
half second, and its report, unchanged, goes out again only after REPUBLISH_UNCHANGED; a change
goes out at once, and a report the board could not store goes out again at the next look.

One trainer on the simulator's virtual clock, with a board of one other trainer at the head (the
target reached) in a run that needs three: the trainer trains one batch, then waits for trainers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

from collab.engine_fakes import CountingTrainer
from collab.scripted_run import RecordingAverager

from dedloc.daemon import timebase
from dedloc.daemon.collab.engine import REPUBLISH_UNCHANGED, STALE_AFTER, RunEngine, RunProgress
from dedloc.daemon.collab.policy import Schedule
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual

LINEAGE = "0" * 32
TARGET = 100


class WaitingBoard:
    """One other trainer at the head with the whole target; what we publish, and when. From
    `served_at` (virtual seconds after the start) on, the trainer is told it served a download
    (its report changes). `stores`: whether each store succeeds."""

    def __init__(self, stores: bool = True) -> None:
        self.stores = stores
        self.published: list[tuple[float, PeerProgress]] = []
        self.reads = 0

    async def publish(self, report: PeerProgress) -> bool:
        self.published.append((asyncio.get_running_loop().time(), report))
        return self.stores

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        self.reads += 1
        now = timebase.now()
        other = PeerProgress("peer-other", 0, TARGET, 10.0, now, now + 30.0, "trainer", TARGET,
                             lineage=LINEAGE)
        return [other], {other.peer_id: now}

    async def leave(self, report: PeerProgress) -> None:
        return None


def run_waiting(board: WaitingBoard, seconds: float = 60.0, served_at: float | None = None,
                ) -> tuple[RunEngine, float]:
    async def main() -> tuple[RunEngine, float]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        engine = RunEngine(peer_id="peer-me", role="trainer",
                           schedule=Schedule(TARGET, min_peers=3), board=board,
                           averaging=RecordingAverager(), trainer=CountingTrainer(),
                           progress=RunProgress(epoch=0, lineage=LINEAGE), parameters=8)
        started = loop.time()
        loop.call_later(seconds, engine.stop)
        if served_at is not None:
            def serve() -> None:
                engine.progress.states_served += 1
            loop.call_later(served_at, serve)
        assert await asyncio.wait_for(engine.run(), timeout=3600) == "stopped"
        return engine, started

    return run_virtual(main())


def test_a_waiting_trainer_publishes_its_unchanged_report_only_every_so_often() -> None:
    board = WaitingBoard()
    engine, started = run_waiting(board)
    assert engine.phase.value == "idle" and engine.progress.accumulated >= 1
    times = [t - started for t, _ in board.published]
    waiting = [t for t, r in board.published if r.planned == r.samples_accumulated]
    assert board.reads >= 60  # it still looks at the run every half second or so
    assert len(times) <= 2 + 60 / REPUBLISH_UNCHANGED  # (its batch, then its wait)
    gaps = [b - a for a, b in itertools.pairwise(waiting)]
    assert gaps and all(REPUBLISH_UNCHANGED - 1e-6 <= gap <= REPUBLISH_UNCHANGED + 1.0
                        for gap in gaps)
    assert REPUBLISH_UNCHANGED + 1.0 < STALE_AFTER / 2  # (each report stays well believable)


def test_a_changed_report_goes_out_at_once() -> None:
    board = WaitingBoard()
    _, started = run_waiting(board, served_at=23.0)
    served = [t - started for t, r in board.published if r.served == 1]
    assert served and 23.0 <= served[0] < 24.0  # (at the next look)


def test_a_report_the_board_could_not_store_goes_out_at_the_next_look() -> None:
    board = WaitingBoard(stores=False)
    run_waiting(board, seconds=20.0)
    assert len(board.published) >= board.reads - 1  # every look publishes
