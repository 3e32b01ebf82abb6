"""The engine of one run on one peer: it looks at the run, asks the policy what to do, does it.

`RunEngine.run()` loops: publish this peer's report and read the others' (the `ProgressBoard`),
fold them into the run's estimate (estimate.py), `decide` (policy.py), and carry the action out
through the ports (ports.py): train the `Trainer`, average through the `RoundAverager` (then step,
and average the state when due), download a state from the `StateSource`, wait, or leave.
Trainers and aux peers, collaborative and local runs are the same engine with other ports.
Looking (the board read, the estimate as far as it is believed, the view) is in looking.py,
taking part in a round (the `Average` action: export, average, step, the state round, an
aux peer's reduction) in round_taking.py, and catching up (a state download checked by
witnesses) in catching_up.py: parts of the engine kept apart; what it has done and its phase
are in run_progress.py.

Its `phase` is awaitable (`PhaseCell.wait_until`): a donor asked for the state mid-round waits
for the round to end on it, nobody polls. Everything this peer has done is in `progress`
(`RunProgress`, checkpointed with the model) and in `epoch_history`; the last rounds are typed
`AveragingReport`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from .. import timebase
from ..averaging.aggregation import DEFAULT_RUN_AGGREGATION
from ..averaging.report import AveragingReport
from .catching_up import CatchingUp
from .donors import DonorChoice
from .errors import StateSyncError
from .estimate import GlobalProgress, Head
from .looking import STALE_AFTER, Looking
from .pace import EpochPace
from .policy import (
    Action,
    Average,
    CatchUp,
    Leave,
    Schedule,
    Timing,
    Train,
    Wait,
    decide,
    round_key,
)
from .ports import DownloadedState, ProgressBoard, RoundAverager, StateSource, Trainer
from .progress import PeerProgress, Role
from .round_hold import RoundHold
from .round_taking import HISTORY, RoundTaking
from .run_progress import IN_ROUND, Phase, PhaseCell, RunProgress

log = structlog.get_logger(__name__)

__all__ = ["IN_ROUND", "STALE_AFTER", "Phase", "PhaseCell", "RunEngine", "RunProgress"]

ROSTER_POLL = 1.0  # seconds between reads of a grid round's roster while settling before it
# While a peer waits (settling before a grid round, following the run, a trainer ready and
# waiting for others), a report that says what its last one said (only its time differs) is
# published again only this long after it: such a peer looked, read the board and published
# every half second, the same report each time, and readers extrapolate an unchanged report to
# the same view (its `planned` caps what they count: what it has). (32 peers in groups of 8:
# 776 of 1854 publications, 42 %, were settling peers' repeats.) A sixth of STALE_AFTER: with a
# look up to `Timing.max_look` (5 s) late, a report is at most 10 s old when the next goes out,
# leaving 20 s of its life for clocks apart and the DHT's delays. Before anything but a wait
# (a round, a download, training) the report goes out whatever it says: nothing is published
# during a round or a download, which may take a minute, so the one on the board is fresh then.
REPUBLISH_UNCHANGED = STALE_AFTER / 6


_NEWS = tuple(f.name for f in dataclasses.fields(PeerProgress) if f.name not in ("time", "expiration"))


def _same_news(a: PeerProgress, b: PeerProgress) -> bool:
    """Whether two reports of this peer say the same, whatever their times."""
    return all(getattr(a, name) == getattr(b, name) for name in _NEWS)


class RunEngine(Looking, RoundTaking, CatchingUp):
    """One run on one peer (see the module docstring). `run()` returns why it left ("finished"
    or "stopped"); an error of a port (a dead worker, a revoked membership) propagates."""

    def __init__(self, *, peer_id: str, role: Role, schedule: Schedule, board: ProgressBoard,
                 averaging: RoundAverager, states: StateSource | None = None,
                 trainer: Trainer | None = None, progress: RunProgress | None = None,
                 parameters: int = 0, compression: str = "none",
                 aggregation: str = DEFAULT_RUN_AGGREGATION, timing: Timing | None = None,
                 blocked: Callable[[], str | None] | None = None,
                 checkpoint: Callable[[], Awaitable[None]] | None = None,
                 checkpoint_every: int = 0, collaborative: bool = True, name: str = "",
                 on_finished: Callable[[], None] | None = None,
                 donors: DonorChoice | None = None, error_feedback: bool = False,
                 overlap: bool = False, max_weight: float | None = None,
                 hands_over_when_finished: bool = False) -> None:
        if role == "trainer" and trainer is None:
            raise ValueError("a trainer run needs a trainer")
        self.peer_id = peer_id
        self.role: Role = role
        self.schedule = schedule
        self.board = board
        self.averaging = averaging
        self.states = states
        self.trainer = trainer
        self.progress = progress or RunProgress()
        self.parameters = parameters
        self.compression = compression
        self.aggregation = aggregation  # the run's (manifest.py): every round's reducers use it
        # a local-update run with a lossy codec: what a round did not convey of this peer's
        # vector goes back to the trainer, which adds it to the next one (_settle_residual)
        self.error_feedback = error_feedback and compression != "none"
        # a local-update run that trains on while its pseudo-gradient is averaged (the worker
        # carries those inner steps over onto the new outer parameters: plugins/worker/outer.py)
        self.overlap = overlap
        self._weight_cap = max_weight  # (default: _weight_ceiling's)
        self.timing = timing or Timing()
        self.collaborative = collaborative
        self._blocked = blocked or (lambda: None)
        self._checkpoint = checkpoint
        self._checkpoint_every = checkpoint_every
        self._on_finished = on_finished
        self.phase = PhaseCell()
        self.global_progress: GlobalProgress | None = None
        self.last_round: AveragingReport | None = None
        self.last_state_round: AveragingReport | None = None
        self.epoch_history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.pace = EpochPace()  # what we saw of the run's pace: the epochs we believe
        self._disbelieved: dict[str, frozenset[str]] = {}  # _note_disbelieved
        self.step_overhead: float | None = None
        self.paused_reason: str | None = None
        self.donors = donors or DonorChoice()
        self._hold = RoundHold()  # our round before a new head ahead (round_hold.py)
        self._held: frozenset[str] = frozenset()  # the peers it holds now
        self.started_at = timebase.now()
        self._stop = asyncio.Event()
        self._next_look = 0.0  # monotonic
        self._reports: list[PeerProgress] = []
        self._received: dict[str, float] = {}
        self._target_reached: tuple[Head, float] | None = None
        # when our last round at this head failed in part, or failed again at once (the others
        # may have stepped on it: the policy looks before a retry)
        self._failed_in_part: tuple[Head, float] | None = None
        self._failed_at: tuple[Head, float] | None = None  # when our last round failed, where
        # the trainers seen at the run's head so far, and when that set last grew (policy: a
        # first grid round waits for it to settle)
        self._head_seen: tuple[Head, frozenset[str], float] | None = None
        self._head_since: dict[str, float] = {}  # each trainer seen at that head: first seen at
        self._finished_at: float | None = None
        self._averaged: Head | None = None  # aux: the head of its last good round
        self._head_group: tuple[str, ...] = ()  # the members of the round that made our head
        self._stepped_in: Head | None = None  # the head we came to by a round (not a download)
        self._roster_seen: Head | None = None  # the head whose grid round's roster we saw
        self._roster_read_at = -ROSTER_POLL  # (monotonic) when we last read a roster's key
        self._aux_group: tuple[Head | None, tuple[str, ...]] = (None, ())  # aux: head it made
        self._promise: tuple[Head | None, int] = (None, 0)  # Local.promised, at that head
        self._farewell_sent = False
        # our last report on the board and when (monotonic) it went out: an unchanged one is
        # published again only after REPUBLISH_UNCHANGED (_publish)
        self._published: tuple[PeerProgress, float] | None = None
        # a finished trainer's report is taken over by its final state's donor (final_state.py):
        # no farewell when it leaves finished (Run._main says farewell should that fail)
        self.hands_over_when_finished = hands_over_when_finished
        self._epoch_loss = (0.0, 0)
        self._log = log.bind(run=name, role=role)

    # --- control ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Leave at the next safe point (after the current worker call)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def in_round(self) -> bool:
        return self.phase.value in IN_ROUND

    @property
    def holds_state(self) -> bool:
        """A trainer's engine that is not leaving serves its state (state_sync.py)."""
        return self.trainer is not None and not self.stopping

    @property
    def lingering(self) -> bool:
        return self.phase.value == "lingering"

    async def run(self) -> str:
        last: tuple[str, str] | None = None
        finished = False
        try:
            while not self._stop.is_set():
                view, read = await self._look()
                action = decide(view)
                what = (type(action).__name__, getattr(action, "reason", ""))
                if what != last:  # (what the engine does, for a log at debug level)
                    self._log.debug("engine_action", action=what[0], reason=what[1],
                                    epoch=self.progress.epoch, run_epoch=view.run.epoch,
                                    ready=view.run.ready)
                    last = what
                if read and view.blocked is None:  # what we do next is in our report
                    await self._publish(action)
                if read and isinstance(action, Train):  # look again when the action says
                    self._schedule_look(action.seconds)
                if isinstance(action, Leave):
                    finished = action.reason == "finished"
                    return action.reason
                if isinstance(action, Train):
                    await self._train(action)
                elif isinstance(action, Average):
                    await (self._average(action) if self.role == "trainer" else self._reduce(action))
                elif isinstance(action, CatchUp):
                    await self._catch_up(action)
                elif isinstance(action, Wait):
                    await self._wait(action)
            return "stopped"
        finally:
            self.phase.set("idle")
            if not (finished and self.hands_over_when_finished):
                await self.farewell()

    async def farewell(self) -> None:
        """Tell the run this peer is gone (once; rounds stop expecting it now)."""
        if self._farewell_sent or not self.collaborative:
            return
        self._farewell_sent = True
        self._published = None  # (the farewell replaces our report: the next one goes out)
        with contextlib.suppress(Exception):  # best effort on the way out; the DHT forgets it
            await self.board.leave(self.own_report())

    # --- looking ------------------------------------------------------------------------------

    def own_report(self, planned: int | None = None) -> PeerProgress:
        """This peer's report; `planned`: the most it will have accumulated by the next one."""
        p = self.progress
        now = timebase.now()
        accumulated = p.accumulated if self.role == "trainer" else 0
        samples = p.samples if self.role == "trainer" else 0
        return PeerProgress(self.peer_id, p.epoch, accumulated, float(p.samples_per_second or 0.0),
                            now, now + STALE_AFTER, self.role, samples, self.step_overhead,
                            started_at=min(self.started_at, now), lineage=p.lineage,
                            planned=None if planned is None else max(planned, accumulated),
                            stepped=self.role == "trainer" and self._stepped_in == self.head,
                            served=p.states_served)

    async def _publish(self, action: Action) -> None:
        accumulated = self.progress.accumulated if self.role == "trainer" else 0
        planned = accumulated + action.samples if isinstance(action, Train) else accumulated
        # what the others may extrapolate us to (they do only with a rate): trained before we
        # average (policy: Local.promised)
        if self._promise[0] != self.head:
            self._promise = (self.head, 0)
        if self.progress.samples_per_second:
            self._promise = (self.head, max(self._promise[1], planned))
        self._farewell_sent = False
        report = self.own_report(planned)
        mono = timebase.monotonic()
        if isinstance(action, Wait) and self._published is not None \
                and mono - self._published[1] < REPUBLISH_UNCHANGED \
                and _same_news(report, self._published[0]):
            return  # (the readers' view of us would not change: see REPUBLISH_UNCHANGED)
        stored = await self.board.publish(report)
        self._published = (report, mono) if stored else None  # (not stored: again next look)

    def _schedule_look(self, seconds: float) -> None:
        self._next_look = timebase.monotonic() + seconds

    # --- actions ------------------------------------------------------------------------------

    async def _train(self, action: Train) -> None:
        assert self.trainer is not None
        remaining = action.samples
        deadline = timebase.monotonic() + action.seconds
        while remaining > 0 and not self._stop.is_set():
            left = deadline - timebase.monotonic()
            if left <= 0:
                break
            self.phase.set("training")
            done = await self.trainer.train(remaining, min(self.timing.max_chunk, left))
            self._count(done.samples, done.loss, done.samples_per_second)
            remaining -= done.samples

    def _count(self, samples: int, loss: float, samples_per_second: float | None) -> None:
        p = self.progress
        if samples <= 0:  # every batch of the call was skipped (NaN or Inf): no loss to show
            return
        p.samples += samples
        p.accumulated += samples
        p.loss_last = loss
        if p.loss_first is None:
            p.loss_first = loss
        p.samples_per_second = samples_per_second
        total, count = self._epoch_loss
        self._epoch_loss = (total + loss * samples, count + samples)

    async def _wait(self, action: Wait) -> None:
        if action.reason.startswith("lingering"):
            self.phase.set("lingering")
        else:
            self.phase.set("paused" if self.paused_reason is not None else "waiting")
        seconds = max(0.0, action.until - timebase.now())
        self._schedule_look(0.0)
        if action.settling:
            await self._settle_until(action.until)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def _settle_until(self, until: float) -> None:
        """Settling before a first grid round: wait until `until` (a short wait: the policy
        looks again soon), having read the round's roster key first if ROSTER_POLL seconds
        have passed since the last read; once a roster is out the policy begins (policy.py)."""
        run = self.global_progress
        left = until - timebase.now()
        if run is not None and left > 0 and timebase.monotonic() >= self._roster_read_at + ROSTER_POLL:
            self._roster_read_at = timebase.monotonic()
            trainers = {*run.donors, *((self.peer_id,) if self.role == "trainer" else ())}
            if await self.averaging.roster_published(round_key("grad", run.head),
                                                     trainers - set(self._aux_peers()),
                                                     timeout=left):
                self._roster_seen = run.head
                return
        left = until - timebase.now()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._stop.wait()

    async def _enter_pause(self, reason: str) -> None:
        if self.paused_reason is None:
            self._log.info("run_paused", reason=reason)
            await self.farewell()
        self.paused_reason = reason
        self.phase.set("paused")

    async def _leave_pause(self) -> None:
        """Back from a pause: the run has moved on, so what was accumulated before is dropped."""
        self.paused_reason = None
        self._farewell_sent = False
        if self.trainer is not None and self.collaborative and self.progress.accumulated:
            await self.trainer.zero_grad()
            self.progress.accumulated = 0
        self._log.info("run_resumed", epoch=self.progress.epoch)

    async def export_state(self) -> DownloadedState:
        """This peer's state, for a peer that downloads it, with the head it is at (read with no
        await after the export: no step can come in between)."""
        if self.trainer is None:
            raise StateSyncError("an aux peer holds no state")
        state = await self.trainer.export_state()
        state.epoch, state.lineage = self.progress.epoch, self.progress.lineage
        state.group = self._head_group
        return state

    async def _save_checkpoint(self) -> None:
        if self._checkpoint is None:
            return
        previous = self.phase.value
        self.phase.set("checkpointing")
        try:
            await self._checkpoint()
        finally:
            self.phase.set(previous)
