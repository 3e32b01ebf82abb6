"""A trainer's run: one workload trained by one worker, epoch by epoch, toward a target batch size.

An epoch is one optimizer step over `target_batch_size` accumulated samples. The worker
accumulates gradients; at the target the daemon takes them through shared memory, checks them,
averages them with the run's other trainers when the run is collaborative (`PeerSync`), and
hands them back for the step at the run's global epoch (which positions the learning-rate
schedule). The run keeps its progress, checkpoints atomically (`CheckpointStore`), and survives
its worker's death: it reports it and can be restarted from its last good checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import structlog

from dedloc.rpc import RpcCallError

from ..errors import RunNotActiveError, WorkerError
from ..workers.buffers import SharedBuffer
from ..workers.process import WorkerProcess
from .availability import Availability
from .checkpoints import CheckpointStore
from .errors import ManifestError
from .manifest import RunManifest
from .membership import MembershipError
from .peer_sync import PeerSync
from .state_sync import StateSnapshot
from .status import run_status

if TYPE_CHECKING:
    from ..network import PeerNetwork

log = structlog.get_logger(__name__)

RunState = Literal["starting", "running", "finished", "stopping", "stopped", "crashed", "failed"]
Phase = Literal["idle", "training", "syncing", "averaging", "stepping", "averaging_state",
                "downloading_state", "checkpointing", "paused", "lingering"]
ACTIVE_STATES = ("starting", "running", "stopping")
WorkerFactory = Callable[[str], Awaitable[WorkerProcess]]
HISTORY = 200
PAUSE_POLL_SECONDS = 2.0
LINGER_SECONDS = 120.0  # a finished run donates its final state to laggards this long at most
LINGER_POLL_SECONDS = 1.0  # how often a paused run checks whether it may train again


@dataclass(frozen=True)
class RunSpec:
    """A run as this peer runs it: the shared manifest plus the local choices."""

    name: str
    manifest: RunManifest
    checkpoint_every: int = 10
    seed: int = 0  # this peer's data order
    device: str = "auto"
    owner_signature: str | None = None  # the owner's signature of the manifest, as published

    @property
    def target_batch_size(self) -> int:
        return self.manifest.target_batch_size

    @property
    def epochs(self) -> int | None:
        return self.manifest.epochs

    @property
    def min_peers(self) -> int:
        return self.manifest.min_peers

    def fingerprint(self) -> str:
        return self.manifest.fingerprint()


@dataclass
class RunProgress:
    epoch: int = 0
    samples: int = 0
    accumulated: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    samples_per_second: float | None = None
    epoch_losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    failed_rounds: int = 0
    state_rounds: int = 0
    failed_state_rounds: int = 0
    state_downloads: int = 0
    failed_state_downloads: int = 0
    restarts: int = 0
    lr: float | None = None  # the learning rate of the last step


class Run:
    role = "trainer"

    def __init__(self, spec: RunSpec, runs_dir: Path, spawn_worker: WorkerFactory,
                 stop_timeout: float, network: PeerNetwork | None = None) -> None:
        self.spec = spec
        self.runs_dir = runs_dir
        self._network = network
        self.sync: PeerSync | None = None
        self._spawn_worker = spawn_worker
        self._stop_timeout = stop_timeout
        self.state: RunState = "starting"
        self.phase: Phase = "idle"
        self.progress = RunProgress()
        self.error: dict[str, Any] | None = None
        self.started_at = time.time()
        self.description: dict[str, Any] = {}
        self.resumed_from: dict[str, Any] | None = None
        self.store: CheckpointStore | None = None
        # One entry per epoch this peer stepped: when the run reached its target, when the step
        # was applied, the round's group and this peer's samples in it.
        self.epoch_history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        # The volunteer's limits (pause, training hours, idle only): set by the run registry.
        self.availability: Availability | None = None
        self.paused_reason: str | None = None
        self._epoch_loss_sum = 0.0
        self._epoch_loss_samples = 0
        self._worker: WorkerProcess | None = None
        self._last_worker: dict[str, Any] | None = None
        self._buffer: SharedBuffer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()
        # Worker calls that touch the model, from the loop and from state donations, one at a time.
        self.model_lock = asyncio.Lock()
        self._log = log.bind(run=spec.name)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def collaborative(self) -> bool:
        return self._network is not None

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.spec.name / self.spec.fingerprint()

    # Lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn and load the worker (errors reach the caller), resume, then train in the background."""
        self.state = "starting"
        self.error = None
        self._stop_requested.clear()
        manifest = self.spec.manifest
        try:
            self._worker = await self._spawn_worker(self.spec.name)
            self.description = await self._worker.call("worker.load", {
                "workload": manifest.workload, "config": manifest.config, "seed": self.spec.seed,
                "init_seed": manifest.init_seed, "device": self.spec.device})
            # The worker fills in the config's defaults: peers that leave out a default and peers
            # that spell it out run the same manifest.
            full = self.description.get("config")
            if isinstance(full, dict) and full != manifest.config:
                manifest = replace(manifest, config=full)
            # What the config cannot pin (a tokenizer): the run's creator sets it, joiners match it.
            task = self.description.get("task_fingerprint")
            if manifest.task is not None and task != manifest.task:
                mismatch = ManifestError(
                    f"this peer's {manifest.workload} task differs from run {self.spec.name!r}'s: "
                    f"the worker here has task fingerprint {task!r}, the run {manifest.task!r}. "
                    "The config is the same, so the files it points to differ on this machine "
                    "(albert: the tokenizer; put the run's tokenizer file at the run's "
                    "tokenizer_path here, or use the same data_dir files and Python version)")
                mismatch.data = {"run": self.spec.name, "task": task, "run_task": manifest.task}
                raise mismatch
            if task is not None and manifest.task is None:
                manifest = replace(manifest, task=task)
            if manifest != self.spec.manifest:
                self.spec = replace(self.spec, manifest=manifest)
            self.store = CheckpointStore(self.run_dir, self.spec.fingerprint())
            await asyncio.to_thread(self.store.prepare)
            await self._resume()
            self._buffer = SharedBuffer(int(self.description["total_numel"]))
            if self._network is not None:
                self.sync = PeerSync(self._network, self.spec, self, int(self.description["total_numel"]))
                await self.sync.collab.prepare()
        except BaseException:
            await self._release(state="failed")
            raise
        self.state = "running"
        self._task = asyncio.create_task(self._train_loop(), name=f"run-{self.spec.name}")
        self._log.info("run_started", workload=manifest.workload, epoch=self.progress.epoch,
                       fingerprint=self.spec.fingerprint(), parameters=self.description.get("total_numel"))

    async def restart(self) -> None:
        if self.state in ACTIVE_STATES:
            raise RunNotActiveError(f"run {self.spec.name!r} is {self.state}; stop it before "
                                    "restarting it")
        self.progress.restarts += 1
        await self.start()

    async def stop(self, checkpoint: bool = True) -> None:
        """Finish the current train call, checkpoint, stop the worker. Safe in any state."""
        if self.lingering and self._task is not None:  # finished, still donating: stop that
            self._stop_requested.set()
            await finish_or_cancel(self._task, self._stop_timeout)
            return
        if self.state not in ACTIVE_STATES:
            return
        self.state = "stopping"
        self._stop_requested.set()
        if self._task is not None:
            await finish_or_cancel(self._task, self._stop_timeout)
        if checkpoint and self._worker is not None and self._worker.exit_code is None:
            with contextlib.suppress(WorkerError, RpcCallError):
                await self.checkpoint()
        await self._release(state="stopped")

    async def _release(self, state: RunState) -> None:
        if self._worker is not None:
            self._last_worker = self._worker.failure_data()
            await self._worker.stop(self._stop_timeout)
            self._last_worker = self._worker.failure_data()
            self._worker = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        if self.state not in ("crashed", "failed", "finished"):
            self.state = state
        self.phase = "idle"
        self._log.info("run_ended", state=self.state, epoch=self.progress.epoch)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def in_round(self) -> bool:
        """In an epoch's averaging or step: the state is about to change (donors wait)."""
        return self.phase in ("averaging", "stepping", "averaging_state")

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    # Training ----------------------------------------------------------------------------

    async def _train_loop(self) -> None:
        try:
            while not self._stop_requested.is_set():
                if self.spec.epochs is not None and self.progress.epoch >= self.spec.epochs:
                    self.state = "finished"
                    await self.checkpoint()
                    if self.sync is not None:
                        await self._linger()
                    break
                if await self._wait_while_blocked():
                    continue
                await self._train_some()
                if self.sync is not None:
                    self.phase = "syncing"
                    await self.sync.sync()
                elif self.progress.accumulated >= self.spec.target_batch_size:
                    await self.step(time.time())
        except WorkerError as exc:
            if self._stop_requested.is_set():
                return
            self.state = "crashed"
            self.error = {"message": str(exc), **(exc.data or {})}
            self._log.error("worker_crashed", error=str(exc), exit_code=self.error.get("exit_code"))
        except RpcCallError as exc:
            self.state = "failed"
            self.error = {"message": exc.message, "code": exc.code, "data": exc.data}
            self._log.error("run_failed", error=str(exc))
        except MembershipError as exc:  # our token of a closed run expired or was revoked
            self.state = "failed"
            self.error = {"message": str(exc)}
            self._log.error("run_membership_lost", error=str(exc))
        finally:
            if self.sync is not None:
                await self.sync.close()
        if self.state in ("crashed", "failed", "finished"):
            await self._release(state=self.state)

    @property
    def lingering(self) -> bool:
        """Finished, but still donating the final state to trainers that are behind."""
        return self.phase == "lingering"

    async def _linger(self) -> None:
        """A finished collaborative run stays visible (its progress at the last epoch) and serves
        its final state for up to LINGER_SECONDS, while some live trainer of the run is behind:
        without it, a trainer that fell behind near the end would wait forever for peers that
        have all finished and left."""
        assert self.sync is not None
        self.phase = "lingering"
        deadline = time.monotonic() + LINGER_SECONDS
        try:
            while not self._stop_requested.is_set() and time.monotonic() < deadline:
                own = self.sync._own()
                await self.sync.collab.publish(own)
                await self.sync.collab.global_progress(own)
                behind = [r for r in self.sync.collab.last_reports
                          if r.role == "trainer" and not r.left and r.peer_id != own.peer_id
                          and r.epoch < self.progress.epoch]
                if not behind:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_requested.wait(), timeout=LINGER_POLL_SECONDS)
        finally:
            self.phase = "idle"

    async def _wait_while_blocked(self) -> bool:
        """Paused by hand, outside the training hours or the machine busy: leave the run's rounds
        (a farewell report) and wait. On resuming, a collaborative run drops the gradients it had
        accumulated (the run has moved on) and catches up. True if it waited."""
        reason = None if self.availability is None else self.availability.blocked()
        if reason is None:
            return False
        self.phase = "paused"
        self.paused_reason = reason
        self._log.info("run_paused", reason=reason)
        if self.sync is not None:
            await self.sync.close()
        while not self._stop_requested.is_set() and reason is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), timeout=PAUSE_POLL_SECONDS)
            reason = None if self.availability is None else self.availability.blocked()
            self.paused_reason = reason or self.paused_reason
        self.paused_reason = None
        if self._stop_requested.is_set():
            return True
        if self.sync is not None and self.progress.accumulated:
            await self.worker_call("worker.zero_grad")
            self.progress.accumulated = 0
        self._log.info("run_resumed", epoch=self.progress.epoch)
        self.phase = "idle"
        return True

    async def _train_some(self) -> None:
        assert self._worker is not None
        self.phase = "training"
        if self.sync is not None:  # train until the next look at the run's progress
            wanted, max_seconds = self.sync.next_chunk()
        else:
            wanted, max_seconds = max(1, self.spec.target_batch_size - self.progress.accumulated), 2.0
        async with self.model_lock:
            result = await self._worker.call("worker.train", {"samples": wanted,
                                                              "max_seconds": max_seconds})
        done, loss = int(result["samples"]), float(result["loss"])
        progress = self.progress
        progress.samples += done
        progress.accumulated += done
        progress.loss_last = loss
        if progress.loss_first is None:
            progress.loss_first = loss
        progress.samples_per_second = result.get("samples_per_second")
        self._epoch_loss_sum += loss * done
        self._epoch_loss_samples += done

    async def worker_call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """A call to this run's worker under the model lock (for PeerSync and state donations)."""
        if self._worker is None:
            raise RunNotActiveError(f"run {self.spec.name!r} has no worker")
        async with self.model_lock:
            return await self._worker.call(method, params)

    async def step(self, target_reached_at: float, expected: int = 1) -> bool:
        """Export the accumulated gradients, average them (collaborative), step; True if stepped."""
        assert self._worker is not None and self._buffer is not None
        buffer = self._buffer
        epoch, accumulated = self.progress.epoch, self.progress.accumulated
        self.phase = "stepping"
        await self.worker_call("worker.export", {"what": "gradients", "buffer": buffer.name,
                                                 "numel": buffer.numel})
        finite = await asyncio.to_thread(lambda: bool(np.isfinite(buffer.array).all()))
        report: dict[str, Any] | None = None
        if finite and self.sync is not None:
            self.phase = "averaging"
            report = await self.sync.average_gradients(buffer.array, epoch, accumulated, expected)
            if report is None:
                # Stepping with partly local gradients would make this peer drift from the others:
                # keep accumulating and join the next round instead.
                self.progress.failed_rounds += 1
                return False
        if not finite:
            self.progress.skipped_steps += 1
            self._log.warning("nonfinite_gradients_skipped", epoch=epoch)
            await self.worker_call("worker.zero_grad")
        else:
            self.phase = "stepping"
            async with self.model_lock:  # the step and the epoch count move together
                applied = await self._worker.call("worker.apply", {
                    "what": "gradients", "buffer": buffer.name, "numel": buffer.numel,
                    "meta": {"step": epoch}})  # the schedule follows the run's epoch
                self.progress.lr = applied.get("lr")
                self.progress.epoch = epoch + 1
        applied_at = time.time()
        self.progress.accumulated = 0
        self._close_epoch_losses()
        self.epoch_history.append({
            "epoch": epoch, "samples": accumulated, "stepped": finite,
            "target_reached_at": target_reached_at, "applied_at": applied_at,
            "overhead_seconds": round(max(0.0, applied_at - target_reached_at), 4),
            "group_size": report["group_size"] if report else 1,
            "trainers": report.get("senders", report["group_size"]) if report else 1,
            "round_seconds": report["seconds"] if report else 0.0,
            "matchmaking_seconds": report["matchmaking_seconds"] if report else 0.0,
        })
        if finite and self.sync is not None:
            await self.sync.after_step(self.progress.epoch, report)
        every = self.spec.checkpoint_every
        if every > 0 and self.progress.epoch % every == 0:
            await self.checkpoint()
        return finite

    def _close_epoch_losses(self) -> None:
        if self._epoch_loss_samples:
            losses = self.progress.epoch_losses
            losses.append(self._epoch_loss_sum / self._epoch_loss_samples)
            del losses[: max(0, len(losses) - HISTORY)]
        self._epoch_loss_sum, self._epoch_loss_samples = 0.0, 0

    async def load_state(self, snapshot: StateSnapshot) -> None:
        """Take a peer's state (a download): the model, optimizer and the run's epoch."""
        assert self._worker is not None
        async with self.model_lock:
            await self._worker.call("worker.apply", {"what": "state", "buffer": snapshot.buffer.name,
                                                     "numel": snapshot.numel, "meta": snapshot.meta})
            await self._worker.call("worker.zero_grad")
            self.progress.epoch = snapshot.epoch
            self.progress.accumulated = 0
            self._epoch_loss_sum, self._epoch_loss_samples = 0.0, 0

    async def export_state(self) -> StateSnapshot:
        """This run's full state in a new shared buffer (the caller closes it), for a peer."""
        if self._worker is None:
            raise RunNotActiveError(f"run {self.spec.name!r} has no worker")
        async with self.model_lock:
            description = await self._worker.call("worker.describe")
            buffer = SharedBuffer(int(description["state_numel"]))
            try:
                result = await self._worker.call("worker.export", {
                    "what": "state", "buffer": buffer.name, "numel": buffer.numel})
            except BaseException:
                buffer.close()
                raise
            return StateSnapshot(buffer, int(result["numel"]), result["meta"], self.progress.epoch)

    # Checkpoints -------------------------------------------------------------------------

    async def checkpoint(self) -> None:
        assert self._worker is not None and self.store is not None
        store = self.store
        previous = self.phase
        self.phase = "checkpointing"
        try:
            async with self.model_lock:
                epoch = self.progress.epoch
                progress = {**asdict(self.progress), "accumulated": 0}
                await self._worker.call("worker.checkpoint_save", {"path": str(store.path_for(epoch))})
            spec = {"name": self.spec.name, "manifest": self.spec.manifest.to_json()}
            await asyncio.to_thread(store.commit, epoch, progress, spec)
        finally:
            self.phase = previous
        self._log.debug("run_checkpointed", epoch=epoch)

    async def _resume(self) -> None:
        """Load the newest intact checkpoint of this manifest, if any."""
        assert self._worker is not None and self.store is not None
        candidates = await asyncio.to_thread(lambda: list(self.store.verified()) if self.store else [])
        for entry, path in candidates:
            try:
                await self._worker.call("worker.checkpoint_load", {"path": str(path)})
            except RpcCallError as exc:
                self.store.rejected += 1
                self._log.warning("checkpoint_not_loaded", path=str(path), error=str(exc))
                continue
            saved = entry.progress
            restarts = self.progress.restarts
            self.progress = RunProgress(**{k: saved[k] for k in saved
                                           if k in RunProgress.__dataclass_fields__})
            self.progress.epoch = entry.epoch
            self.progress.restarts = max(restarts, self.progress.restarts)
            self.resumed_from = {"epoch": entry.epoch, "file": entry.file}
            self._log.info("run_resumed", epoch=entry.epoch, samples=self.progress.samples,
                           file=entry.file)
            return

    # Reporting ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return run_status(self)

    def worker_status(self) -> dict[str, Any]:
        if self._worker is not None:
            return {"state": "running", **self._worker.failure_data()}
        if self._last_worker is not None:
            return {"state": "exited", **self._last_worker}
        return {"state": "none", "pid": None, "exit_code": None, "last_log_lines": []}


async def finish_or_cancel(task: asyncio.Task[None], timeout: float) -> None:
    """Let a run's loop finish its current step for up to `timeout` seconds, then cancel it."""
    done, _ = await asyncio.wait([task], timeout=timeout)
    if not done:
        task.cancel()
        await asyncio.wait([task])
