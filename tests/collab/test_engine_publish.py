"""What a waiting trainer publishes (engine.py, REPUBLISH_UNCHANGED): it looks at the run every
half second, and its report, unchanged, goes out again only after REPUBLISH_UNCHANGED; a change
goes out at once, and a report the board could not store goes out again at the next look.

One trainer on the simulator's virtual clock, with a board of one other trainer at the head (the
target reached) in a run that needs three: the trainer trains one batch, then waits for trainers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping

import numpy as np
from collab.engine_fakes import CountingTrainer
from collab.scripted_run import RecordingAverager

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.engine import REPUBLISH_UNCHANGED, STALE_AFTER, RunEngine, RunProgress
from dedloc.daemon.collab.policy import Schedule
from dedloc.daemon.collab.progress import PeerProgress, Role
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual

LINEAGE = "0" * 32
TARGET = 100


class WaitingBoard:
    """One other trainer at the head with the whole target (and a third from `third_at`
    virtual seconds on: the run has its three); what we publish, and when. `stores`: whether
    each store succeeds."""

    def __init__(self, stores: bool = True, third_at: float | None = None) -> None:
        self.stores = stores
        self.third_at = third_at
        self.published: list[tuple[float, PeerProgress]] = []
        self.left: list[float] = []  # when we said farewell
        self.reads = 0
        self.started = 0.0

    async def publish(self, report: PeerProgress) -> bool:
        self.published.append((asyncio.get_running_loop().time(), report))
        return self.stores

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        self.reads += 1
        now = timebase.now()
        others = ["peer-other"]
        if self.third_at is not None \
                and asyncio.get_running_loop().time() - self.started >= self.third_at:
            others.append("peer-third")
        reports = [PeerProgress(peer, 0, TARGET, 10.0, now, now + 30.0, "trainer", TARGET,
                                lineage=LINEAGE) for peer in others]
        return reports, {peer: now for peer in others}

    async def leave(self, report: PeerProgress) -> None:
        self.left.append(asyncio.get_running_loop().time())


class LongRound(RecordingAverager):
    """Rounds of 25 s (a large model's), that fail."""

    async def average(self, vector: np.ndarray, key: str, **options: object) -> AveragingReport | None:
        self.rounds.append((asyncio.get_running_loop().time(), key))
        await asyncio.sleep(25.0)
        return None


def run_waiting(board: WaitingBoard, seconds: float = 60.0, served_at: float | None = None,
                averager: RecordingAverager | None = None,
                blocked: Callable[[float], str | None] | None = None,
                role: Role = "trainer") -> tuple[RunEngine, float]:
    """One trainer (or aux peer) against `board` for `seconds`; `blocked`: its pause, by the
    virtual seconds since the start."""
    async def main() -> tuple[RunEngine, float]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        started = board.started = loop.time()
        engine = RunEngine(peer_id="peer-me", role=role,
                           schedule=Schedule(TARGET, min_peers=3), board=board,
                           averaging=averager or RecordingAverager(),
                           trainer=CountingTrainer() if role == "trainer" else None,
                           progress=RunProgress(epoch=0, lineage=LINEAGE), parameters=8,
                           blocked=None if blocked is None
                           else (lambda: blocked(loop.time() - started)))
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
    # (a look at most max_look late: a report is at most 10 s old when the next goes out)
    assert REPUBLISH_UNCHANGED + engine.timing.max_look <= STALE_AFTER / 3


def test_a_changed_report_goes_out_at_once() -> None:
    board = WaitingBoard()
    _, started = run_waiting(board, served_at=23.0)
    served = [t - started for t, r in board.published if r.served == 1]
    assert served and 23.0 <= served[0] < 24.0  # (at the next look)


def test_a_report_the_board_could_not_store_goes_out_at_the_next_look() -> None:
    board = WaitingBoard(stores=False)
    run_waiting(board, seconds=20.0)
    assert len(board.published) >= board.reads - 1  # every look publishes


def test_before_a_round_the_report_goes_out_whatever_it_says() -> None:
    # nothing is published during a round (or a download), which may take a minute: the report
    # that was on the board when it began must outlive it. A third trainer comes 9.5 s in and
    # the round of 25 s begins; the waiting trainer's unchanged report had gone out at the start
    board, averager = WaitingBoard(third_at=9.5), LongRound()
    _, started = run_waiting(board, seconds=40.0, averager=averager)
    began = averager.rounds[0][0]
    assert began - started >= 9.5  # (it waited for the third)
    last = max(t for t, _ in board.published if t <= began)
    assert began - last < 1.0  # (published right before it)
    assert began + 25.0 < last + STALE_AFTER


def test_back_from_a_short_pause_the_report_goes_out_at_once() -> None:
    # an aux peer following the run, paused from 1 s to 2.5 s: its farewell is the board's
    # last word on it, so its report, the same as before the pause (out at 0 s), goes out as
    # soon as it is back (at its next look, 3 s), not REPUBLISH_UNCHANGED after the last one
    board = WaitingBoard()
    _, started = run_waiting(board, seconds=14.0, role="aux",
                             blocked=lambda t: "paused" if 1.0 <= t < 2.5 else None)
    assert 1.0 <= board.left[0] - started < 2.0  # (and once more as it stops, at 14 s)
    assert board.published[0][0] - started < 1.0
    back = [t - started for t, _ in board.published if t > board.left[0]]
    assert back and back[0] < 4.0 < REPUBLISH_UNCHANGED
