"""A run engine's part in averaging rounds (the `Average` action of policy.py).

A trainer exports its gradients (or pseudo-gradients), averages them with the peers at the run's
head through the `RoundAverager`, and steps when the round allows it (then averages the state
when due); an aux peer reduces with nothing of its own. This module also says who a round at
the head expects, who leads it first and who holds a grid round's cells, and what one member may
claim as its weight. `RoundTaking` is a part of `RunEngine` (engine.py), which owns the state
it reads; it is kept apart so that looking and deciding (engine.py) and taking part in rounds
(here) can each be read on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import timebase
from ..averaging.compression import get_codec
from ..averaging.error_feedback import unconveyed
from ..averaging.report import AveragingReport
from .errors import RoundSatOut
from .estimate import GlobalProgress, Head
from .lineage import next_lineage
from .pace import EpochPace
from .policy import (
    WEIGHT_BUDGET,
    WEIGHT_SLACK,
    Average,
    RoundResult,
    Schedule,
    Timing,
    Wait,
    needed_trainers,
    round_key,
    state_round_due,
    step_allowed,
)
from .ports import RoundAverager, Trainer
from .progress import Role

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from .run_progress import PhaseCell, RunProgress

__all__ = ["HISTORY", "RoundTaking"]

HISTORY = 200  # epochs kept in `epoch_history` (and losses in `RunProgress.epoch_losses`)


class RoundTaking:
    """The rounds of one run on one peer (module docstring); mixed into `RunEngine`."""

    # the engine's state these methods read and write (set in RunEngine.__init__)
    peer_id: str
    role: Role
    schedule: Schedule
    timing: Timing
    averaging: RoundAverager
    trainer: Trainer | None
    progress: RunProgress
    parameters: int
    compression: str
    aggregation: str
    error_feedback: bool
    overlap: bool
    phase: PhaseCell
    global_progress: GlobalProgress | None
    last_round: AveragingReport | None
    last_state_round: AveragingReport | None
    epoch_history: deque[dict[str, Any]]
    pace: EpochPace
    step_overhead: float | None
    _weight_cap: float | None
    _stop: asyncio.Event
    _left_head: Callable[[], None]
    _failed_at: tuple[Head, float] | None
    _target_reached: tuple[Head, float] | None
    _head_group: tuple[str, ...]
    _stepped_in: Head | None
    _aux_group: tuple[Head | None, tuple[str, ...]]
    _averaged: Head | None
    _epoch_loss: tuple[float, int]
    _checkpoint_every: int
    _log: FilteringBoundLogger
    head: Head
    _schedule_look: Callable[[float], None]
    _wait: Callable[[Wait], Awaitable[None]]
    _settled: Callable[[], tuple[str, ...]]
    _count: Callable[[int, float, float | None], None]
    _save_checkpoint: Callable[[], Awaitable[None]]

    def _weight_ceiling(self) -> float:
        """The most samples a member of this run's gradient rounds may ever claim: an honest
        trainer stops at the target, overshooting by at most one of its batches (WEIGHT_SLACK
        covers a batch of up to 7 targets); a claim of 1e15 is refused, not averaged. The run may
        say (RunManifest.max_weight: a local-update run's epoch is H target batches)."""
        if self._weight_cap is not None:
            return float(self._weight_cap)
        return float(WEIGHT_SLACK * self.schedule.target_batch_size)

    def _weight_budget(self) -> float:
        """What a gradient round's senders weigh at most together, shared by the trainers each
        stands for (Group.bounded_weights): WEIGHT_BUDGET times the epoch's samples (a
        local-update run's H target batches), the same on every peer. An honest round weighs
        about one (up to 3.5 with a tiny target that the trainers overshoot while a round forms:
        the equivalence test), so an honest member of 3 keeps its whole claim up to 5.3 epochs."""
        return float(WEIGHT_BUDGET * self.schedule.target_batch_size)

    async def _average(self, action: Average) -> None:
        """A gradient round at the head, then the step if the round allows it."""
        assert self.trainer is not None
        p = self.progress
        head = action.head
        self.phase.set("averaging")
        vector = await self.trainer.export_gradients()
        # (an honest trainer far ahead of a round that keeps failing would pass the bound)
        weight = min(float(p.accumulated), self._weight_ceiling())
        finite = await asyncio.to_thread(lambda: bool(np.isfinite(vector).all()))
        if not finite:  # take part with nothing: the others' step is ours too
            p.skipped_steps += 1
            self._log.warning("nonfinite_gradients_skipped", epoch=p.epoch)
            await self.trainer.zero_grad()
            p.accumulated = 0
            vector = await self.trainer.export_gradients()
            weight = 0.0
        # what we send, before the round overwrites it with the average (error feedback)
        prepared = (await asyncio.to_thread(vector.copy)) if self.error_feedback and weight > 0 \
            else None
        exported = p.accumulated
        averaged = self.averaging.average(vector, round_key("grad", head), weight=weight,
                                              expected=action.expected, role="trainer",
                                              compression=self.compression,
                                              aggregation=self.aggregation,
                                              min_trainers=needed_trainers(action, self.schedule),
                                              peers=self._round_peers(), leaders=self._leaders(),
                                              cells=self._grid_cells(),
                                              aux=self._aux_peers(),
                                              max_weight=self._weight_ceiling(),
                                              weight_budget=self._weight_budget(),
                                              settled=self._settled())
        try:
            report = await (self._train_while(averaged) if self.overlap and weight > 0
                            else averaged)
        except RoundSatOut as exc:
            # no slice of the grid has room for us (more newcomers than its slices hold): not a
            # failed round (counted as one, it was tried again at once, every half second,
            # until the head moved); the gradients stay ours for the next round
            p.rounds_sat_out += 1
            self._log.info("averaging_round_sat_out", epoch=head.epoch, reason=str(exc))
            await self._wait(Wait(timebase.now() + self.timing.max_look, "sitting a round out"))
            return
        if report is not None:
            self.last_round = report
        result = None if report is None else RoundResult(report.trainers, report.senders,
                                                         len(report.failed_parts))
        if report is None or not step_allowed(result, action, self.schedule):
            p.failed_rounds += 1
            now = timebase.now()
            partial = report is not None and bool(report.failed_parts) and sum(
                end - start for start, end in report.failed_parts) < sum(report.shares)
            # a round that failed again at once at the same head: the peers we asked had most
            # likely stepped past it (RoundOver), and their reports, due after their state
            # round, did not say so yet; retried at once, it failed 2-8 times a second
            if self._failed_again(head, now) or partial:
                self._failed_in_part = (head, now)  # (policy: Local.failed_part_at)
            self._schedule_look(0.0)
            self._log.warning("averaging_round_failed_no_step", epoch=p.epoch,
                              group_size=report and report.group_size,
                              trainers=report and report.trainers, expected=action.trainers,
                              failed_parts=report and len(report.failed_parts))
            return
        self.phase.set("stepping")
        p.lr = await self.trainer.step(p.epoch)
        if prepared is not None:
            await self._settle_residual(prepared, report)
        carried = p.accumulated - exported  # trained during the round (overlap): the next epoch's
        p.accumulated = exported
        self._stepped(report)
        p.accumulated = carried
        if state_round_due(self.schedule, p.epoch, report.trainers):
            await self._average_state(report)
        every = self._checkpoint_every
        if every > 0 and p.epoch % every == 0:
            await self._save_checkpoint()
        self._schedule_look(0.0)  # the others are stepping too: look again now

    def _failed_again(self, head: Head, now: float) -> bool:
        """Note a failed round at `head`; whether the last one there failed within
        `Timing.failed_part_wait` before it (then a look for the others' step comes first)."""
        last, self._failed_at = self._failed_at, (head, now)
        return last is not None and last[0] == head and now - last[1] < self.timing.failed_part_wait

    async def _train_while(self, averaged: Awaitable[AveragingReport | None]
                           ) -> AveragingReport | None:
        """Overlap: train (in chunks of `Timing.max_chunk`) until the round is over; the phase
        stays "averaging" (a donor serves its state after the step)."""
        assert self.trainer is not None
        round_ = asyncio.ensure_future(averaged)
        try:
            while not round_.done() and not self._stop.is_set():
                try:
                    done = await self.trainer.train(self.schedule.target_batch_size,
                                                    self.timing.max_chunk)
                except Exception:
                    # the trainer failed: the round goes on to its end (it has its deadline),
                    # so that the others do not lose the part we reduce, and then we fail
                    with contextlib.suppress(Exception):
                        await round_
                    raise
                self._count(done.samples, done.loss, done.samples_per_second)
            return await round_
        finally:
            if not round_.done():  # cancelled (the run stops): the round is not ours to finish
                round_.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await round_

    async def _settle_residual(self, prepared: np.ndarray, report: AveragingReport) -> None:
        """The new residual: what the codec did not convey of `prepared`, recomputed chunk by
        chunk as the round cut it (the codecs are deterministic). Only a stepped round settles:
        a failed one changed nothing, and the next export adds the same residual again."""
        assert self.trainer is not None
        residual = await asyncio.to_thread(unconveyed, get_codec(report.compression), prepared,
                                           report.part_bounds, report.chunk_elements, report.part)
        await self.trainer.settle_residual(residual)

    def _leaders(self) -> tuple[str, ...]:
        """Who leads a round at our head first: the members of the round that made it, as we
        and every peer that came out of it know them first-hand; none when we do not know them
        (then every peer ranks the same expected peers)."""
        if self.role == "trainer":
            return self._head_group
        # an aux peer knows that list only if it was in the round that made the run's head
        run = self.global_progress
        return self._aux_group[1] if run is not None and self._aux_group[0] == run.head else ()

    def _grid_cells(self) -> tuple[str, ...]:
        """Who holds the cells of a grid round at the run's head: the trainers there that
        report they stepped there in its round, a list every peer reading the board agrees on
        (after a grid round each member knows only the grid it laid out, and those differ where
        views differed); else `_leaders`. (Only for cells: a claim on the board does not make
        a peer lead a one-group round, where a leader that never begins holds its joiners.)"""
        run = self.global_progress
        if run is not None:
            stepped = tuple(sorted(
                p["peer_id"] for p in run.live_peers
                if p["role"] == "trainer" and p.get("stepped") and p["epoch"] == run.epoch
                and p["lineage"] == run.lineage))
            if len(stepped) >= 2:
                return stepped
        return self._leaders()

    def _round_peers(self) -> tuple[str, ...]:
        """Who a round at the run's head expects: the trainers there and the aux peers."""
        run = self.global_progress
        if run is None:
            return ()
        return tuple(sorted({*run.donors, *self._aux_peers()} - {self.peer_id}))

    def _aux_peers(self) -> tuple[str, ...]:
        run = self.global_progress
        if run is None:
            return ()
        return tuple(sorted({p["peer_id"] for p in run.live_peers if p["role"] == "aux"}
                            - {self.peer_id}))

    def _stepped(self, report: AveragingReport) -> None:
        p = self.progress
        epoch, accumulated = p.epoch, p.accumulated
        self._left_head()
        p.epoch = epoch + 1
        p.lineage = next_lineage(p.lineage or "", report.group_id)
        self._head_group = report.members
        self._stepped_in = self.head
        p.accumulated = 0
        p.rounds += 1
        total, count = self._epoch_loss
        if count:
            p.epoch_losses.append(total / count)
            del p.epoch_losses[: max(0, len(p.epoch_losses) - HISTORY)]
        self._epoch_loss = (0.0, 0)
        applied_at = timebase.now()
        self.pace.stepped(p.epoch, timebase.monotonic())
        reached = self._target_reached[1] if self._target_reached is not None else applied_at
        overhead = round(max(0.0, applied_at - reached), 4)
        self.step_overhead = overhead
        self.epoch_history.append({
            "epoch": epoch, "samples": accumulated, "stepped": True, "lineage": p.lineage,
            "target_reached_at": reached, "applied_at": applied_at, "overhead_seconds": overhead,
            "group_size": report.group_size, "trainers": report.trainers,
            "senders": report.senders, "round_seconds": report.seconds,
            "matchmaking_seconds": report.matchmaking_seconds, "stages": report.stages,
            "weight": report.weight,
        })

    async def _average_state(self, round_: AveragingReport) -> None:
        """Average parameters and optimizer state with the trainers of the round just done:
        float drift between devices is folded back in."""
        assert self.trainer is not None
        p = self.progress
        self.phase.set("averaging_state")
        state = await self.trainer.export_state()
        try:
            aux = {p["peer_id"] for p in self.global_progress.live_peers if p["role"] == "aux"} \
                if self.global_progress is not None else set()
            peers = tuple(m for m in round_.members if m != self.peer_id and m not in aux)
            try:
                report = await self.averaging.average(
                    state.buffer.array[: state.numel], round_key("state", self.head),
                    weight=1.0, expected=round_.trainers, role="trainer", peers=peers,
                    aggregation=self.aggregation,
                    leaders=tuple(m for m in round_.members if m not in aux),
                    max_weight=1.0)  # one vote per trainer: an equal-weight mean, by the rule
            except RoundSatOut as exc:
                # no slice of the state round's grid has room for us (its roster left us out):
                # our state is the one we stepped to, which is the run's (to float drift)
                p.failed_state_rounds += 1
                self._log.info("state_averaging_skipped", epoch=p.epoch, reason=str(exc))
                return
            if report is None or report.failed_parts or report.group_size < 2:
                p.failed_state_rounds += 1
                self._log.info("state_averaging_skipped", epoch=p.epoch,
                               group_size=report and report.group_size)
                return
            await self.trainer.load_state(state)
            p.accumulated = 0  # (what an overlapping run trained meanwhile went with the old state)
            p.state_rounds += 1
            self._left_head()
            p.lineage = next_lineage(p.lineage or "", f"state/{report.group_id}")
            self._head_group = report.members
            self._stepped_in = self.head
            self.last_state_round = report
        finally:
            state.close()

    async def _reduce(self, action: Average) -> None:
        """An aux peer's part of a round: it reduces, with nothing of its own."""
        self.phase.set("averaging")
        vector = np.zeros(self.parameters, dtype=np.float32)
        try:
            report = await self.averaging.average(
                vector, round_key("grad", action.head), weight=0.0, expected=action.expected,
                role="aux", compression=self.compression, aggregation=self.aggregation,
                min_trainers=needed_trainers(action, self.schedule),
                peers=self._round_peers(), leaders=self._leaders(), cells=self._grid_cells(),
                aux=self._aux_peers(), max_weight=self._weight_ceiling(),
                weight_budget=self._weight_budget(), settled=self._settled())
        except RoundSatOut as exc:
            # no room for it beside the grid's cells: not a failed round (counted as one, it
            # tried again every second or two); it looks again a while later (a retry of the
            # same head may have room: the head is not marked as averaged)
            self.progress.rounds_sat_out += 1
            self._log.debug("aux_round_sat_out", epoch=action.head.epoch, reason=str(exc))
            await self._wait(Wait(timebase.now() + self.timing.max_look, "sitting a round out"))
            return
        result = None if report is None else RoundResult(report.trainers, report.senders,
                                                         len(report.failed_parts))
        if report is not None and report.group_size > 1:
            self.last_round = report
        if step_allowed(result, action, self.schedule) and report is not None \
                and report.group_size > 1:
            self.progress.rounds += 1
            self._averaged = action.head
            self.pace.stepped(action.head.epoch + 1, timebase.monotonic())
            stepped_to = Head(action.head.epoch + 1,
                              next_lineage(action.head.lineage or "", report.group_id))
            self._aux_group = (stepped_to, report.members)
        else:
            self.progress.failed_rounds += 1
            self._log.info("aux_round_failed", epoch=action.head.epoch,
                           group_size=report and report.group_size,
                           trainers=report and report.trainers, expected=action.trainers,
                           failed_parts=report and len(report.failed_parts))
            # failed again at once at the same head (its trainers stepped past it and answer
            # RoundOver): a look for their step first, as a trainer does (seen: an aux peer
            # retried every 1.4 s, about ten times, with the run's trainers a head on)
            now = timebase.now()
            if self._failed_again(action.head, now):
                await self._wait(Wait(now + self.timing.failed_part_wait,
                                      "the round failed again at once: looking whether the "
                                      "trainers stepped on it"))
                return
        self._schedule_look(0.0)
