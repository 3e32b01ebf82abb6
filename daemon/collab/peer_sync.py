"""A trainer's side of a collaborative run: when to look at the run, when to average, when to
catch up.

Between two train calls the trainer publishes its progress and reads the run's (`sync`). The
delay to the next look shrinks geometrically as the run nears its target (`next_report_delay`),
and the worker trains exactly until then (`next_chunk`), so a round starts within about
`MIN_SYNC_DELAY` of the run reaching its target and no peer runs far past it. Then:
- the run is at this peer's epoch and has reached its target, with at least `min_peers` trainers
  at the epoch: average the gradients with every trainer at the epoch (and the aux peers), then
  step; every `average_state_every` epochs, also average parameters and optimizer state;
- the run is ahead: download the state of a trainer at the run's epoch (a random one, avoiding
  donors that failed recently, with backoff between failures);
- this peer is ahead (its round succeeded where others' failed): wait for the run to confirm its
  epoch, and take the run's state if it has not after `STALE_AFTER` seconds.
A round whose result is partial or has fewer than `min_peers` trainers is not stepped on: the
peer keeps accumulating and joins the next round of the same epoch.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from dedloc.rpc import RpcCallError

from .collaboration import STALE_AFTER, Collaboration
from .errors import DonorBusy, StateSyncError
from .progress import GlobalProgress, next_report_delay, should_average
from .state_sync import DonorChoice, download_state

if TYPE_CHECKING:
    from ..network import PeerNetwork
    from .run import Run, RunSpec

log = structlog.get_logger(__name__)

MIN_SYNC_DELAY = 0.02
MAX_SYNC_DELAY = 5.0
MAX_CHUNK_SECONDS = 0.5


class PeerSync:
    def __init__(self, network: PeerNetwork, spec: RunSpec, run: Run, parameters: int) -> None:
        self.collab = Collaboration(network, spec.name, spec.manifest, "trainer", parameters,
                                    spec.owner_signature)
        self.spec = spec
        self.run = run
        self.global_progress: GlobalProgress | None = None
        self.last_round: dict[str, Any] | None = None
        self.last_state_round: dict[str, Any] | None = None
        self.step_overhead: float | None = None
        self.donors = DonorChoice()
        self._next_sync = 0.0  # event-loop time
        self._last_look = time.time()
        self._target_reached: dict[int, float] = {}
        self._ahead_since: float | None = None
        self._log = log.bind(run=spec.name)

    @property
    def key(self) -> str:
        return self.collab.key

    def next_chunk(self) -> tuple[int, float]:
        """How much to train before the next look at the run: (samples, seconds), at least one batch."""
        p = self.run.progress
        remaining = self.spec.target_batch_size - p.accumulated
        gp = self.global_progress
        if gp is not None and gp.epoch == p.epoch:
            remaining = min(remaining, gp.remaining)
        seconds = self._next_sync - asyncio.get_running_loop().time()
        return max(1, remaining), min(MAX_CHUNK_SECONDS, max(MIN_SYNC_DELAY, seconds))

    def _own(self) -> Any:
        p = self.run.progress
        return self.collab.own_progress(p.epoch, p.accumulated, p.samples_per_second, p.samples,
                                        self.step_overhead)

    async def sync(self) -> None:
        loop = asyncio.get_running_loop()
        p = self.run.progress
        if loop.time() < self._next_sync and p.accumulated < self.spec.target_batch_size:
            return
        own = self._own()
        await self.collab.publish(own)
        gp = await self.collab.global_progress(own)
        self.global_progress = gp
        now = time.time()
        self._next_sync = loop.time() + next_report_delay(
            gp, p.samples_per_second or 0.0, min_delay=MIN_SYNC_DELAY, max_delay=MAX_SYNC_DELAY)
        looked_before, self._last_look = self._last_look, now
        if gp.epoch > p.epoch:
            self._ahead_since = None
            await self._catch_up(gp.epoch)
            return
        if gp.live_trainers == 2 and gp.highest_epoch > p.epoch:
            # Two trainers: the run's epoch is the lower one's (no third peer confirms either),
            # and that is us. We are back from a pause, a restart or a failed round, or new: take
            # the other's state rather than train alone from ours while it waits for us.
            self._ahead_since = None
            await self._catch_up(gp.highest_epoch)
            return
        if gp.epoch < p.epoch:
            self._ahead_since = self._ahead_since or now
            # With two trainers the one behind catches up to us (above): never take its state.
            if now - self._ahead_since > STALE_AFTER and gp.trainers_at_epoch > 0 \
                    and gp.live_trainers != 2:
                self._log.info("ahead_of_the_run_taking_its_state", own=p.epoch, run=gp.epoch)
                await self._catch_up(gp.epoch)
            return
        self._ahead_since = None
        if should_average(gp, p.epoch) and p.accumulated > 0 and gp.trainers_at_epoch >= self.spec.min_peers:
            reached = self._target_reached.get(p.epoch)
            if reached is None:  # first seen now; estimate when it happened from the overshoot
                overshoot = max(0, gp.samples_accumulated - gp.target_batch_size)
                rate = gp.samples_per_second
                reached = now - (overshoot / rate if rate > 0 else 0.0)
                reached = max(looked_before, min(now, reached))
                self._target_reached = {p.epoch: reached}
            await self.run.step(reached, expected=gp.trainers_at_epoch + gp.live_aux)

    async def average_gradients(self, vector: np.ndarray, epoch: int, samples: int,
                                expected: int) -> dict[str, Any] | None:
        """Average the gradients of `epoch` weighted by samples; the report, or None if the round
        must not be stepped on (it failed, in part, or had fewer than min_peers trainers)."""
        report = await self.collab.average(vector, f"grad/{epoch}", float(samples), expected,
                                           self.spec.manifest.compression)
        if report is not None:
            self.last_round = report
        if report is None or report["failed_parts"] or report.get("senders", 1) < self.spec.min_peers:
            self._log.warning("averaging_round_failed_no_step", epoch=epoch,
                              group_size=report and report["group_size"],
                              failed_parts=report and report["failed_parts"])
            return None
        return report

    async def after_step(self, epoch: int, report: dict[str, Any] | None) -> None:
        """After the step to `epoch`: note the overhead, average the state when due, and look at
        the run again right away (the others are stepping too)."""
        history = self.run.epoch_history
        if history:
            self.step_overhead = history[-1]["overhead_seconds"]
        every = self.spec.manifest.average_state_every
        trainers = (report or {}).get("senders", 1)
        if every > 0 and epoch % every == 0 and trainers > 1:
            await self._average_state(epoch, trainers)
        self._next_sync = 0.0

    async def _average_state(self, epoch: int, expected: int) -> None:
        """Average parameters and optimizer state with the trainers of the round just done: any
        drift (a partial round, a float mismatch) is folded back in."""
        run = self.run
        run.phase = "averaging_state"
        snapshot = await run.export_state()
        try:
            vector = snapshot.buffer.array[: snapshot.numel]
            report = await self.collab.average(vector, f"state/{epoch}", 1.0, expected)
            if report is None or report["failed_parts"] or report["group_size"] < 2:
                run.progress.failed_state_rounds += 1
                self._log.info("state_averaging_skipped", epoch=epoch,
                               group_size=report and report["group_size"])
                return
            await run.worker_call("worker.apply", {"what": "state", "buffer": snapshot.buffer.name,
                                                   "numel": snapshot.numel, "meta": snapshot.meta})
            run.progress.state_rounds += 1
            self.last_state_round = report
        finally:
            snapshot.buffer.close()

    async def _catch_up(self, run_epoch: int) -> None:
        """Load the state of a trainer at the run's epoch (this peer is new, or fell behind)."""
        run = self.run
        now = time.time()
        donors = [r.peer_id for r in self.collab.last_reports
                  if r.epoch == run_epoch and r.role == "trainer" and r.peer_id != self.collab.peer_id]
        donor = self.donors.pick(donors, now)
        transport = self.collab.network.transport
        if donor is None or transport is None:
            return
        run.phase = "downloading_state"
        try:
            state = await download_state(transport, donor, self.key,
                                         self.collab.network.membership.credential(self.key))
        except DonorBusy as exc:  # mid-round: its state is about to move on; ask again soon
            self._log.debug("state_donor_busy", donor=donor[:12], error=str(exc))
            self._next_sync = 0.0
            return
        except StateSyncError as exc:
            run.progress.failed_state_downloads += 1
            self.donors.failed(donor, now)
            self._log.warning("state_download_failed", donor=donor[:12], error=str(exc),
                              retry_in=round(self.donors.wait(now), 2))
            return
        try:
            await run.load_state(state)
        except RpcCallError as exc:  # the worker refused it: wrong layout, NaN, ...
            run.progress.failed_state_downloads += 1
            self.donors.failed(donor, now)
            self._log.warning("downloaded_state_refused", donor=donor[:12], error=exc.message)
            return
        finally:
            state.buffer.close()
        self.donors.succeeded()
        run.progress.state_downloads += 1
        self._next_sync = 0.0
        self._log.info("state_downloaded", donor=donor[:12], epoch=state.epoch)

    async def close(self) -> None:
        await self.collab.leave(self._own())
