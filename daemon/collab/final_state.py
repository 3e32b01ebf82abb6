"""A finished run's final state, kept for the peers that come late.

A trainer that reaches the manifest's last epoch lingers, with its worker, while it sees a
trainer of the run behind (policy.py). A peer that comes back later than that, a trainer
restarted from an old checkpoint or a newcomer asking for the finished model, found nobody:
every trainer had left, and it waited for trainers forever (seen when a restarted trainer's
worker took longer to load than the two others took to finish the run: they left a second
before its first report).

So a collaborative trainer that finishes writes its final state (what a download carries: the
parameters, the optimizer's slots and buffers) to `final-state.f32` in the run's directory
(the worker's meta and the head stay in memory), stops its worker, and goes on as a donor of
that file (`FinishedDonor`):

- it keeps a report at the final head on the run's board (every `REPORT_EVERY` seconds), so
  that a peer behind sees the run's head and whom to download it from;
- it serves state downloads and witnesses' sketches (state_sync.py) from the file, mapped
  read-only: it holds no copy in memory;
- for `SERVE_SECONDS`, or until the run is stopped or restarted or the daemon stops. Then its
  report becomes a farewell and the file is removed (the checkpoints stay).

A closed run's donor keeps checking its membership as a trainer's reports do (board.py): a
revoked member stops serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from .. import timebase
from .engine import STALE_AFTER
from .errors import MembershipError, StateSyncError
from .ports import DownloadedState, ProgressBoard
from .progress import PeerProgress
from .run_progress import PhaseCell, RunProgress

log = structlog.get_logger(__name__)

__all__ = ["REPORT_EVERY", "SERVE_SECONDS", "FinalState", "FinishedDonor"]

SERVE_SECONDS = 24 * 3600.0  # how long a finished run serves its final state
REPORT_EVERY = 10.0  # seconds between two reports at the final head (each lasts STALE_AFTER)
VALUES_FILE = "final-state.f32"
PARTIAL_FILE = VALUES_FILE + ".partial"


class MappedState:
    """A final state's values, mapped read-only from its file (a `StateBuffer`)."""

    def __init__(self, path: Path, numel: int) -> None:
        self._map: np.ndarray | None = np.memmap(path, dtype=np.float32, mode="r", shape=(numel,))

    @property
    def array(self) -> np.ndarray:
        if self._map is None:
            raise ValueError("the final state's mapping is closed")
        return self._map

    def close(self) -> None:
        """Drop the mapping: it is unmapped once the last view of it goes (a sketch's slice may
        outlive the call; the pages are the file's cache, not the daemon's memory)."""
        self._map = None


@dataclass(frozen=True)
class FinalState:
    """The final state's file and what a download's header says of it (kept in memory: a
    daemon that restarts does not serve it again)."""

    directory: Path
    numel: int
    meta: dict[str, Any]
    epoch: int
    lineage: str | None
    group: tuple[str, ...]

    @property
    def values_path(self) -> Path:
        return self.directory / VALUES_FILE

    @classmethod
    def write(cls, directory: Path, state: DownloadedState) -> FinalState:
        """Write `state` (blocking: call it in a thread); a half-written file never stays."""
        final = cls(directory, state.numel, state.meta, state.epoch, state.lineage, state.group)
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / PARTIAL_FILE
        try:
            with partial.open("wb") as out:
                state.buffer.array[: state.numel].astype(np.float32, copy=False).tofile(out)
            os.replace(partial, final.values_path)
        except BaseException:
            final.remove()
            raise
        return final

    def remove(self) -> None:
        FinalState.remove_from(self.directory)

    @staticmethod
    def remove_from(directory: Path) -> None:
        """Remove the final state's files from a run's directory, if any."""
        for name in (VALUES_FILE, PARTIAL_FILE):
            with contextlib.suppress(OSError):
                (directory / name).unlink()


class FinishedDonor:
    """Serves a finished run's final state and reports it at the run's final head (see the
    module docstring). `progress` is the run's: what it serves is counted there."""

    def __init__(self, final: FinalState, *, peer_id: str, board: ProgressBoard,
                 progress: RunProgress, started_at: float,
                 serve_seconds: float = SERVE_SECONDS) -> None:
        self.final = final
        self.peer_id = peer_id
        self.board = board
        self.progress = progress
        self.started_at = started_at
        self.phase = PhaseCell()  # never in a round: the server never waits on it
        self.until = timebase.now() + serve_seconds
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def holds_state(self) -> bool:
        return not self._stopped.is_set() and timebase.now() < self.until

    async def export_state(self) -> DownloadedState:
        final = self.final
        try:
            buffer = await asyncio.to_thread(MappedState, final.values_path, final.numel)
        except (OSError, ValueError) as exc:  # (removed meanwhile: the serving ended)
            raise StateSyncError(f"this peer no longer serves the run's final state: {exc}") \
                from None
        return DownloadedState(buffer, final.numel, final.meta, final.epoch, final.lineage,
                               final.group)

    def report(self) -> PeerProgress:
        now = timebase.now()
        return PeerProgress(self.peer_id, self.final.epoch, 0, 0.0, now, now + STALE_AFTER,
                            "trainer", self.progress.samples, started_at=min(self.started_at, now),
                            lineage=self.final.lineage, planned=0,
                            served=self.progress.states_served)

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="finished-donor")

    async def _serve(self) -> None:
        try:
            while self.holds_state:
                try:
                    await self.board.publish(self.report())
                except MembershipError as exc:  # a closed run's member no more
                    log.warning("final_state_membership_lost", error=str(exc))
                    break
                except Exception as exc:  # (the board's own failures are logged there)
                    log.warning("final_state_report_failed", error=f"{type(exc).__name__}: {exc}")
                wait = min(REPORT_EVERY, max(0.0, self.until - timebase.now()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), wait)
        finally:
            self._stopped.set()
            with contextlib.suppress(Exception):  # best effort: the report expires anyway
                await self.board.leave(self.report())
            await asyncio.to_thread(self.final.remove)
            log.info("final_state_no_longer_served", epoch=self.final.epoch,
                     served=self.progress.states_served)

    async def close(self) -> None:
        """Stop serving: a farewell on the board, the file removed."""
        self._stopped.set()
        task, self._task = self._task, None
        if task is not None:
            await task
