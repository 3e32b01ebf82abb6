"""A scripted run for tests of one `RunEngine` (test_engine_hold.py, test_engine_rounds_over.py):
a board of other trainers at the trainer's head (epoch 2) that reach the target after a dozen
seconds, and a script of other reports that appear 3 s in; an averager whose rounds fail and a
state source whose donors contradict their reports, each noting what the engine asked of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
from collab.engine_fakes import PacedTrainer

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.engine import RunEngine, RunProgress
from dedloc.daemon.collab.errors import DonorContradicted
from dedloc.daemon.collab.estimate import Head
from dedloc.daemon.collab.policy import Schedule
from dedloc.daemon.collab.ports import DownloadedState
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual

OURS = "a" * 32  # the lineage of the trainer's head, (2, OURS)
THEIRS = "b" * 32  # a head (3, THEIRS) that others come to report
TARGET = 240
APPEAR_AT = 3.0  # virtual seconds after the start: the script's reports appear
GONE_AT = 6.0  # ... and those of the peers the script removes disappear


@dataclass
class ScriptedBoard:
    """`honest` trainers at (2, OURS), 2 samples a second each; from APPEAR_AT on, `ahead`
    report (3, THEIRS) instead (or besides, where they are not among `honest`)."""

    honest: list[str]
    ahead: list[str]
    started: float = 0.0
    gone: list[str] = field(default_factory=list)  # of `honest`: no longer report from GONE_AT

    async def publish(self, report: PeerProgress) -> bool:
        return True

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        now = timebase.now()
        t = asyncio.get_running_loop().time() - self.started
        late = t >= APPEAR_AT
        reports = [PeerProgress(peer, 3, 0, 2.0, now, now + 30.0, "trainer", 1, lineage=THEIRS)
                   for peer in self.ahead if late]
        moved = {r.peer_id for r in reports}
        reports += [PeerProgress(peer, 2, int(2 * t), 2.0, now, now + 30.0, "trainer", 1,
                                 lineage=OURS) for peer in self.honest
                    if peer not in moved and not (t >= GONE_AT and peer in self.gone)]
        return reports, {r.peer_id: now for r in reports}

    async def leave(self, report: PeerProgress) -> None:
        return None


@dataclass
class RecordingAverager:
    """Flat rounds; each fails (a round that nobody stepped on). Notes when each began."""

    rounds: list[tuple[float, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # rounds and downloads, in order

    @property
    def max_group_size(self) -> int:
        return 0

    async def average(self, vector: np.ndarray, key: str, **options: object) -> AveragingReport | None:
        self.rounds.append((asyncio.get_running_loop().time(), key))
        self.events.append("round")
        return None

    def refused(self, peers: object) -> frozenset[str]:
        return frozenset()

    def round_over(self, key: str) -> None:
        pass

    async def roster_published(self, key: str, trainers: Collection[str], *,
                               timeout: float) -> bool:
        return False


@dataclass
class RefusingStates:
    """Every donor offers a state beside the head it reported; the first download ends the run."""

    engine: RunEngine | None = None
    downloads: list[tuple[float, str, Head | None]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    async def download(self, donor: str, expect: Head | None = None,
                       others: int = 0) -> DownloadedState:
        self.downloads.append((asyncio.get_running_loop().time(), donor, expect))
        self.events.append("download")
        assert self.engine is not None
        self.engine.stop()
        raise DonorContradicted(f"{donor} offered another head")

    async def witness(self, peer: str, state: DownloadedState) -> bool | None:
        return None


def run_engine(honest: list[str], ahead: list[str], gone: list[str] | None = None,
               failed_before: list[str] | None = None, *,
               averager: RecordingAverager | None = None, states: RefusingStates | None = None,
               stop_after: float | None = None,
               ) -> tuple[RecordingAverager, RefusingStates, RunEngine, float]:
    """One trainer at (2, OURS) until its first download (or `stop_after` virtual seconds); its
    rounds, its downloads, its engine, and the virtual second it started."""

    async def main() -> tuple[RecordingAverager, RefusingStates, RunEngine, float]:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        board = ScriptedBoard(honest, ahead, started=loop.time(), gone=gone or [])
        rounds = averager or RecordingAverager()
        sources = states or RefusingStates()
        sources.events = rounds.events
        engine = RunEngine(peer_id="peer-me", role="trainer", schedule=Schedule(TARGET),
                           board=board, averaging=rounds, states=sources, trainer=PacedTrainer(),
                           progress=RunProgress(epoch=2, lineage=OURS, rounds=2), parameters=8)
        sources.engine = engine
        for peer in failed_before or []:  # (long ago: no longer avoided)
            engine.donors.failed(peer, loop.time() - 1000.0)
        if stop_after is not None:
            loop.call_later(stop_after, engine.stop)
        assert await asyncio.wait_for(engine.run(), timeout=3600) == "stopped"
        return rounds, sources, engine, board.started

    return run_virtual(main())


HONEST = [f"honest-{i}" for i in range(6)]
LIARS = [f"liar-{i}" for i in range(5)]
