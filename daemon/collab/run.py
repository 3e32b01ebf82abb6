"""A run: one workload trained by one worker, epoch by epoch, toward a target batch size.

An epoch is one optimizer step over `target_batch_size` accumulated samples. The worker
accumulates gradients; at the target the daemon takes them through shared memory (where the
collaboration's averaging will sit), checks them, and hands them back for the step. The run keeps
its progress, checkpoints atomically, and survives its worker's death: it reports it and can be
restarted from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
import structlog

from dedloc.rpc import RpcCallError

from ..errors import RunNotActiveError, WorkerError
from ..workers.buffers import SharedBuffer
from ..workers.process import WorkerProcess
from .collaboration import Collaboration
from .errors import StateSyncError
from .progress import GlobalProgress, next_report_delay, should_average
from .state_sync import StateSnapshot, download_state

log = structlog.get_logger(__name__)

RunState = Literal["starting", "running", "finished", "stopping", "stopped", "crashed", "failed"]
ACTIVE_STATES = ("starting", "running", "stopping")
WorkerFactory = Callable[[str], Awaitable[WorkerProcess]]


@dataclass(frozen=True)
class RunSpec:
    """What to train and how; the run's identity for checkpoints."""

    name: str
    workload: str
    config: dict[str, Any]
    target_batch_size: int
    epochs: int | None = None
    checkpoint_every: int = 10
    seed: int = 0
    init_seed: int = 0
    device: str = "auto"
    min_peers: int = 1  # a collaborative run takes no step before this many trainers are present

    def fingerprint(self) -> str:
        """Identifies the training problem: a checkpoint of another one is never loaded."""
        essence = {"workload": self.workload, "config": self.config,
                   "target_batch_size": self.target_batch_size, "init_seed": self.init_seed,
                   "min_peers": self.min_peers}
        return hashlib.sha256(orjson.dumps(essence, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


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
    state_downloads: int = 0
    failed_state_downloads: int = 0
    restarts: int = 0


class Run:
    def __init__(self, spec: RunSpec, run_dir: Path, spawn_worker: WorkerFactory,
                 stop_timeout: float, history: int = 200,
                 collaboration: Collaboration | None = None) -> None:
        self.spec = spec
        self.collaboration = collaboration
        self.global_progress: GlobalProgress | None = None
        self.last_round: dict[str, Any] | None = None
        self.run_dir = run_dir
        self._spawn_worker = spawn_worker
        self._stop_timeout = stop_timeout
        self.state: RunState = "starting"
        self.progress = RunProgress()
        self.error: dict[str, Any] | None = None
        self.started_at = time.time()
        self.description: dict[str, Any] = {}
        self._history = history
        self._epoch_loss_sum = 0.0
        self._epoch_loss_samples = 0
        self._worker: WorkerProcess | None = None
        self._last_worker: dict[str, Any] | None = None
        self._buffer: SharedBuffer | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()
        self._next_sync = 0.0
        # Worker calls that touch the model, from the loop and from state donations, one at a time.
        self._model_lock = asyncio.Lock()
        self._log = log.bind(run=spec.name)

    # Lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn and load the worker (errors reach the caller), resume, then train in the background."""
        self.state = "starting"
        self.error = None
        self._stop_requested.clear()
        try:
            self._worker = await self._spawn_worker(self.spec.name)
            self.description = await self._worker.call("worker.load", {
                "workload": self.spec.workload, "config": self.spec.config, "seed": self.spec.seed,
                "init_seed": self.spec.init_seed, "device": self.spec.device})
            await self._resume()
            self._buffer = SharedBuffer(int(self.description["total_numel"]))
        except BaseException:
            await self._release(state="failed")
            raise
        self.state = "running"
        self._task = asyncio.create_task(self._train_loop(), name=f"run-{self.spec.name}")
        self._log.info("run_started", workload=self.spec.workload, epoch=self.progress.epoch,
                       parameters=self.description.get("total_numel"))

    async def restart(self) -> None:
        if self.state in ACTIVE_STATES:
            raise RunNotActiveError(f"run {self.spec.name!r} is {self.state}; stop it before "
                                    "restarting it")
        self.progress.restarts += 1
        await self.start()

    async def stop(self, checkpoint: bool = True) -> None:
        """Finish the current train call, checkpoint, stop the worker. Safe in any state."""
        if self.state not in ACTIVE_STATES:
            return
        self.state = "stopping"
        self._stop_requested.set()
        if self._task is not None:
            done, _ = await asyncio.wait([self._task], timeout=self._stop_timeout)
            if not done:
                self._task.cancel()
                await asyncio.wait([self._task])
        if checkpoint and self._worker is not None and self._worker.exit_code is None:
            with contextlib.suppress(WorkerError, RpcCallError):
                await self._checkpoint()
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
        self._log.info("run_ended", state=self.state, epoch=self.progress.epoch)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    # Training ----------------------------------------------------------------------------

    async def _train_loop(self) -> None:
        try:
            while not self._stop_requested.is_set():
                if self.spec.epochs is not None and self.progress.epoch >= self.spec.epochs:
                    self.state = "finished"
                    await self._checkpoint()
                    break
                await self._train_some()
                if self.collaboration is not None:
                    await self._sync_with_peers()
                elif self.progress.accumulated >= self.spec.target_batch_size:
                    await self._step()
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
        if self.state in ("crashed", "failed", "finished"):
            await self._release(state=self.state)

    async def _train_some(self) -> None:
        assert self._worker is not None
        wanted = max(1, self.spec.target_batch_size - self.progress.accumulated)
        max_seconds = 0.5 if self.collaboration is not None else 2.0
        async with self._model_lock:
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

    async def _sync_with_peers(self) -> None:
        """Publish our progress, read the run's, and take the collaborative step once the run's
        samples reach the target."""
        collaboration = self.collaboration
        assert collaboration is not None
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_sync and self.progress.accumulated < self.spec.target_batch_size:
            return
        p = self.progress
        own = collaboration.own_progress(p.epoch, p.accumulated, p.samples_per_second, p.samples)
        await collaboration.publish(own)
        progress = await collaboration.global_progress(own)
        self.global_progress = progress
        self._next_sync = loop.time() + next_report_delay(
            progress, p.samples_per_second or 0.0, min_delay=0.05, max_delay=5.0)
        if progress.epoch > p.epoch:
            await self._catch_up(progress.epoch)
        elif (should_average(progress, p.epoch) and p.accumulated > 0
                and progress.live_trainers >= self.spec.min_peers):
            await self._step(expected=progress.live_trainers)

    async def _catch_up(self, run_epoch: int) -> None:
        """Behind the run (new, or a round failed): load the state of a peer at the run's epoch."""
        collaboration = self.collaboration
        assert collaboration is not None and self._worker is not None
        donors = [r.peer_id for r in collaboration.last_reports
                  if r.epoch == run_epoch and r.role == "trainer" and r.peer_id != collaboration.peer_id]
        transport = collaboration.network.transport
        if not donors or transport is None:
            return
        donor = random.choice(donors)  # newcomers spread over the donors
        try:
            state = await download_state(transport, donor, collaboration.key)
        except StateSyncError as exc:
            self.progress.failed_state_downloads += 1
            self._log.warning("state_download_failed", donor=donor[:12], error=str(exc))
            return
        try:
            async with self._model_lock:
                await self._worker.call("worker.apply", {"what": "state", "buffer": state.buffer.name,
                                                         "numel": state.numel, "meta": state.meta})
                await self._worker.call("worker.zero_grad")
                self.progress.epoch = state.epoch
                self.progress.accumulated = 0
                self._epoch_loss_sum, self._epoch_loss_samples = 0.0, 0
        finally:
            state.buffer.close()
        self.progress.state_downloads += 1
        self._next_sync = 0.0
        self._log.info("state_downloaded", donor=donor[:12], epoch=state.epoch)

    async def export_state(self) -> StateSnapshot:
        """This run's full state in a new shared buffer (the caller closes it), for a peer."""
        if self._worker is None:
            raise RunNotActiveError(f"run {self.spec.name!r} has no worker")
        async with self._model_lock:
            description = await self._worker.call("worker.describe")
            buffer = SharedBuffer(int(description["state_numel"]))
            try:
                result = await self._worker.call("worker.export", {
                    "what": "state", "buffer": buffer.name, "numel": buffer.numel})
            except BaseException:
                buffer.close()
                raise
            return StateSnapshot(buffer, int(result["numel"]), result["meta"], self.progress.epoch)

    async def _step(self, expected: int = 1) -> None:
        assert self._worker is not None and self._buffer is not None
        buffer = self._buffer
        async with self._model_lock:
            await self._worker.call("worker.export", {"what": "gradients", "buffer": buffer.name,
                                                      "numel": buffer.numel})
        finite = await asyncio.to_thread(lambda: bool(np.isfinite(buffer.array).all()))
        if finite and self.collaboration is not None:
            report = await self.collaboration.average_gradients(
                buffer.array, self.progress.epoch, float(self.progress.accumulated), expected)
            self.last_round = report
            if report is None or report["failed_parts"] or report["group_size"] < self.spec.min_peers:
                # Stepping with partly local gradients would make this peer drift from the others:
                # keep accumulating and join the next round instead.
                self.progress.failed_rounds += 1
                self._log.warning("averaging_round_failed_no_step", epoch=self.progress.epoch,
                                  report=report and report["failed_parts"])
                return
        if not finite:
            self.progress.skipped_steps += 1
            self._log.warning("nonfinite_gradients_skipped", epoch=self.progress.epoch)
            async with self._model_lock:
                await self._worker.call("worker.zero_grad")
        else:
            async with self._model_lock:  # the step and the epoch count move together
                await self._worker.call("worker.apply", {"what": "gradients", "buffer": buffer.name,
                                                         "numel": buffer.numel})
                self.progress.epoch += 1
        self.progress.accumulated = 0
        if self._epoch_loss_samples:
            losses = self.progress.epoch_losses
            losses.append(self._epoch_loss_sum / self._epoch_loss_samples)
            del losses[: max(0, len(losses) - self._history)]
        self._epoch_loss_sum, self._epoch_loss_samples = 0.0, 0
        every = self.spec.checkpoint_every
        if every > 0 and self.progress.epoch % every == 0:
            await self._checkpoint()

    # Checkpoints -------------------------------------------------------------------------

    @property
    def _checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    @property
    def _record_path(self) -> Path:
        return self.run_dir / "run.json"

    async def _checkpoint(self) -> None:
        assert self._worker is not None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        async with self._model_lock:
            await self._worker.call("worker.checkpoint_save", {"path": str(self._checkpoint_path)})
        record = {"fingerprint": self.spec.fingerprint(), "spec": asdict(self.spec),
                  "progress": {**asdict(self.progress), "accumulated": 0}}
        await asyncio.to_thread(_write_atomically, self._record_path, orjson.dumps(record))
        self._log.debug("run_checkpointed", epoch=self.progress.epoch)

    async def _resume(self) -> None:
        assert self._worker is not None
        try:
            record = orjson.loads(self._record_path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, orjson.JSONDecodeError) as exc:
            self._log.warning("run_record_unreadable", path=str(self._record_path), error=str(exc))
            return
        if record.get("fingerprint") != self.spec.fingerprint():
            self._log.info("checkpoint_of_other_config_ignored", path=str(self._record_path))
            return
        try:
            await self._worker.call("worker.checkpoint_load", {"path": str(self._checkpoint_path)})
        except RpcCallError as exc:
            self._log.warning("checkpoint_not_loaded", error=str(exc))
            return
        saved = record["progress"]
        restarts = self.progress.restarts
        self.progress = RunProgress(**{k: saved[k] for k in saved if k in RunProgress.__dataclass_fields__})
        self.progress.restarts = max(restarts, self.progress.restarts)
        self._log.info("run_resumed", epoch=self.progress.epoch, samples=self.progress.samples)

    # Reporting ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        worker: dict[str, Any]
        if self._worker is not None:
            worker = {"state": "running", **self._worker.failure_data()}
        elif self._last_worker is not None:
            worker = {"state": "exited", **self._last_worker}
        else:
            worker = {"state": "none", "pid": None, "exit_code": None, "last_log_lines": []}
        p = self.progress
        return {
            "name": self.spec.name,
            "workload": self.spec.workload,
            "config": self.description.get("config", self.spec.config),
            "state": self.state,
            "epoch": p.epoch,
            "epochs": self.spec.epochs,
            "samples": p.samples,
            "accumulated": p.accumulated,
            "target_batch_size": self.spec.target_batch_size,
            "loss_first": p.loss_first,
            "loss": p.loss_last,
            "epoch_losses": list(p.epoch_losses),
            "samples_per_second": p.samples_per_second,
            "skipped_steps": p.skipped_steps,
            "failed_rounds": p.failed_rounds,
            "state_downloads": p.state_downloads,
            "collaborative": self.collaboration is not None,
            "run_peers": None if self.global_progress is None else self.global_progress.live_trainers,
            "run_samples_accumulated": (None if self.global_progress is None
                                        else self.global_progress.samples_accumulated),
            "run_eta_seconds": None if self.global_progress is None else self.global_progress.eta_seconds,
            "contributions": {} if self.global_progress is None else self.global_progress.contributions,
            "last_round": self.last_round,
            "restarts": p.restarts,
            "device": self.description.get("device"),
            "parameters": self.description.get("total_numel"),
            "started_at": self.started_at,
            "error": self.error,
            "worker": worker,
        }


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
