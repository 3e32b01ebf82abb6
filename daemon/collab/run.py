"""A trainer's run on this daemon: one workload trained by one worker, epoch by epoch.

An epoch is one optimizer step over `target_batch_size` accumulated samples (in a local-update
run, one outer step after `inner_steps` target batches of inner steps: manifest.py). `Run` owns the run's
lifecycle: it spawns and loads the worker, checks the run's manifest against it, resumes from the
newest intact checkpoint (`CheckpointStore`), then hands the run to its engine (engine.py), which
trains, averages with the run's other trainers (collaborative runs) or alone (local runs), steps
at the run's global epoch (which positions the learning-rate schedule), downloads the state when
behind, and checkpoints. The run survives its worker's death: it reports it and can be restarted
from its last good checkpoint. An error the engine cannot handle ends the run as `failed` with the
reason; the worker is stopped either way.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog

from dedloc.rpc import RpcCallError
from dedloc.rpc.worker_protocol import WorkerMethod

from .. import timebase
from ..errors import RunNotActiveError, WorkerError
from ..workers.process import WorkerProcess
from .availability import Availability
from .board import DhtProgressBoard, LocalBoard
from .checkpoints import CheckpointStore
from .engine import RunEngine, RunProgress
from .errors import ManifestError, MembershipError
from .final_state import FinalState, FinishedDonor
from .lineage import initial_lineage
from .manifest import RunManifest
from .policy import Schedule
from .rounds import NetworkRounds, SoloRounds
from .state_sync import NetworkStates
from .status import run_status
from .worker_trainer import WorkerTrainer

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..network import PeerNetwork

log = structlog.get_logger(__name__)

RunState = Literal["starting", "running", "finished", "stopping", "stopped", "crashed", "failed"]
ACTIVE_STATES = ("starting", "running", "stopping")

__all__ = ["ACTIVE_STATES", "Run", "RunSpec", "RunState", "finish_or_cancel", "schedule_of"]


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


def schedule_of(manifest: RunManifest) -> Schedule:
    """What the engine's policy follows: an epoch is one step of the run, over the target batch
    (a gradients run) or over `inner_steps` target batches (a local-update run's outer step). A
    local-update run averages no state: its trainers hold the same outer parameters after every
    outer step by construction (and a state round would drop their residuals)."""
    return Schedule(manifest.epoch_samples, manifest.min_peers, manifest.epochs,
                    0 if manifest.local_updates else manifest.average_state_every)


class Run:
    role = "trainer"

    def __init__(self, spec: RunSpec, runs_dir: Path, spawn_worker: Callable[[str], Awaitable[WorkerProcess]],
                 stop_timeout: float, network: PeerNetwork | None = None,
                 availability: Availability | None = None) -> None:
        self.spec = spec
        self.runs_dir = runs_dir
        self._network = network
        self._spawn_worker = spawn_worker
        self._stop_timeout = stop_timeout
        self.availability = availability
        self.state: RunState = "starting"
        self.progress = RunProgress()
        self.error: dict[str, Any] | None = None
        self.checkpoint_failures = 0
        self.last_checkpoint_error: dict[str, Any] | None = None
        self.started_at = timebase.now()
        self.description: dict[str, Any] = {}
        self.resumed_from: dict[str, Any] | None = None
        self.store: CheckpointStore | None = None
        self.engine: RunEngine | None = None
        self.board: DhtProgressBoard | None = None
        self._worker: WorkerProcess | None = None
        self._trainer: WorkerTrainer | None = None
        self._last_worker: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self.final_donor: FinishedDonor | None = None  # finished: its final state, served
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

    @property
    def phase(self) -> str:
        return "idle" if self.engine is None else self.engine.phase.value

    @property
    def inner_step(self) -> int | None:
        """A local-update run: the worker's inner steps since the last outer step."""
        return None if self._trainer is None else self._trainer.inner_step

    @property
    def inner_lr(self) -> float | None:
        """A local-update run: the learning rate of the worker's last inner step (scaled)."""
        return None if self._trainer is None else self._trainer.inner_lr

    @property
    def clipped_steps(self) -> int:
        return 0 if self._trainer is None else self._trainer.clipped_steps

    @property
    def skipped_batches(self) -> int:
        """Batches the worker skipped for a NaN or Inf loss or gradients (since it started)."""
        return 0 if self._trainer is None else self._trainer.skipped_batches

    @property
    def key(self) -> str | None:
        """The run's peer-to-peer key (collaborative runs)."""
        return None if self.board is None else self.board.key

    # Lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn and load the worker (errors reach the caller), resume, then run the engine in
        the background."""
        self.state = "starting"
        self.error = None
        try:
            self._worker = await self._spawn_worker(self.spec.name)
            await self._load(self._worker)
            self.store = CheckpointStore(self.run_dir, self.spec.fingerprint())
            await asyncio.to_thread(self.store.prepare)
            # (a final state left by a daemon that was killed while serving it: a run that
            # starts serves none until it finishes again)
            await asyncio.to_thread(FinalState.remove_from, self.run_dir)
            await self._resume()
            self.engine = self._engine(self._worker)
        except BaseException:
            await self._release(state="failed")
            raise
        self.state = "running"
        self._task = asyncio.create_task(self._main(self.engine), name=f"run-{self.spec.name}")
        self._log.info("run_started", workload=self.spec.manifest.workload,
                       epoch=self.progress.epoch, fingerprint=self.spec.fingerprint(),
                       parameters=self.description.get("total_numel"))

    async def _load(self, worker: WorkerProcess) -> None:
        manifest = self.spec.manifest
        self.description = await worker.call(WorkerMethod.LOAD, {
            "workload": manifest.workload, "config": manifest.config, "seed": self.spec.seed,
            "init_seed": manifest.init_seed, "device": self.spec.device,
            "sync": manifest.worker_sync()})
        # The worker fills in the config's defaults: peers that leave out a default and peers that
        # spell it out run the same manifest.
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

    def _engine(self, worker: WorkerProcess) -> RunEngine:
        spec, network = self.spec, self._network
        parameters = int(self.description["total_numel"])
        self._trainer = WorkerTrainer(worker, parameters)
        if self.progress.lineage is None and self.progress.epoch == 0:
            self.progress.lineage = initial_lineage(spec.fingerprint())
        if network is not None:
            dht, averager, transport = network.dht, network.averager, network.transport
            if dht is None or averager is None or transport is None:
                raise RunNotActiveError("the peer network is not started")
            self.board = DhtProgressBoard(dht, network.identity, network.membership, spec.name,
                                          spec.manifest, "trainer", parameters, spec.owner_signature)
            rounds: NetworkRounds | SoloRounds = NetworkRounds(averager, self.board.key, dht)
            states = NetworkStates(transport, network.membership, self.board.key,
                                   parameters=parameters)
            board: DhtProgressBoard | LocalBoard = self.board
            peer_id = network.identity.peer_id
        else:
            board, rounds, states, peer_id = LocalBoard(), SoloRounds("local"), None, "local"
        availability = self.availability
        return RunEngine(
            peer_id=peer_id, role="trainer", schedule=schedule_of(spec.manifest), board=board,
            averaging=rounds, states=states, trainer=self._trainer, progress=self.progress,
            parameters=parameters, compression=spec.manifest.compression,
            aggregation=spec.manifest.aggregation,
            blocked=None if availability is None else availability.blocked,
            checkpoint=self._periodic_checkpoint, checkpoint_every=spec.checkpoint_every,
            collaborative=network is not None, name=spec.name, on_finished=self._finished,
            error_feedback=spec.manifest.local_updates, overlap=spec.manifest.overlap,
            max_weight=spec.manifest.max_weight, hands_over_when_finished=network is not None)

    def _finished(self) -> None:
        """The manifest's last epoch is reached (the engine may linger, serving its state)."""
        if self.state == "running":
            self.state = "finished"

    async def _main(self, engine: RunEngine) -> None:
        try:
            if isinstance(engine.averaging, NetworkRounds):
                await engine.averaging.prepare()
            reason = await engine.run()
            if reason == "finished":
                self.state = "finished"
                try:
                    await self._keep_final_state(engine)
                except asyncio.CancelledError:  # stopped while writing it: the worker goes all
                    await self._release(state="finished")  # the same
                    raise
        except WorkerError as exc:
            if engine.stopping:
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
        except Exception as exc:  # a bug: the run ends, says why, and the daemon goes on
            self.state = "failed"
            self.error = {"message": f"{type(exc).__name__}: {exc}"}
            self._log.exception("run_failed_unexpectedly")
        if self.state in ("crashed", "failed", "finished"):
            await self._release(state=self.state)

    async def _keep_final_state(self, engine: RunEngine) -> None:
        """Finished: serve the final state from a file once the worker is gone (final_state.py);
        should that fail (a full disk), say farewell as a leaving trainer does. A stop while it
        is written lets the write end (it reads the worker's shared memory) and drops the file."""
        if not engine.hands_over_when_finished or self.board is None:
            return
        writing = asyncio.ensure_future(self._write_final_state(engine))
        try:
            final = await asyncio.shield(writing)
        except asyncio.CancelledError:
            writing.add_done_callback(_drop_written)
            raise
        if final is None:
            await engine.farewell()
            return
        self.final_donor = FinishedDonor(final, peer_id=engine.peer_id, board=self.board,
                                         progress=self.progress, started_at=engine.started_at)
        self.final_donor.start()
        self._log.info("final_state_served", epoch=final.epoch, numel=final.numel)

    async def _write_final_state(self, engine: RunEngine) -> FinalState | None:
        try:
            exported = await engine.export_state()
            try:
                return await asyncio.to_thread(FinalState.write, self.run_dir, exported)
            finally:  # (the thread is done with the buffer: this is never cancelled midway)
                exported.close()
        except Exception as exc:  # (a full disk, a worker gone): the run finished all the same
            self._log.warning("final_state_not_kept", error=f"{type(exc).__name__}: {exc}")
            return None

    async def _stop_serving(self) -> None:
        donor, self.final_donor = self.final_donor, None
        if donor is not None:
            await donor.close()

    async def restart(self) -> None:
        if self.state in ACTIVE_STATES:
            raise RunNotActiveError(f"run {self.spec.name!r} is {self.state}; stop it before "
                                    "restarting it")
        await self.stop()  # finished: its lingering, final state and worker go first
        self.progress.restarts += 1
        await self.start()

    async def stop(self, checkpoint: bool = True) -> None:
        """Finish the current worker call, checkpoint, stop the worker. Safe in any state (a
        finished run stops serving its final state)."""
        if self.state not in ACTIVE_STATES:
            if self._task is not None and not self._task.done() and self.engine is not None:
                self.engine.stop()  # finished, still lingering: stop that
                await finish_or_cancel(self._task, self._stop_timeout)
            await self._stop_serving()
            return
        self.state = "stopping"
        if self.engine is not None:
            self.engine.stop()
        if self._task is not None:
            await finish_or_cancel(self._task, self._stop_timeout)
        try:
            if checkpoint and self._worker is not None and self._worker.exit_code is None:
                await self._periodic_checkpoint()
        except WorkerError as exc:  # the worker died meanwhile: nothing to save
            self._log.warning("checkpoint_at_stop_skipped", error=str(exc))
        finally:  # the worker stops whatever the checkpoint did
            await self._release(state="stopped")

    async def _release(self, state: RunState) -> None:
        if self._worker is not None:
            self._last_worker = self._worker.failure_data()
            await self._worker.stop(self._stop_timeout)
            self._last_worker = self._worker.failure_data()
            self._worker = None
        if self._trainer is not None:
            self._trainer.close()
            self._trainer = None
        if self.state not in ("crashed", "failed", "finished"):
            self.state = state
        self._log.info("run_ended", state=self.state, epoch=self.progress.epoch)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def lingering(self) -> bool:
        """Finished, but still donating the final state to trainers that are behind."""
        return self.engine is not None and self.engine.lingering

    # Checkpoints -------------------------------------------------------------------------

    async def checkpoint(self) -> None:
        """Save and list a checkpoint at this epoch; on failure what was half-written is removed
        (the listed checkpoints are untouched) and the error raised."""
        trainer, store = self._trainer, self.store
        if trainer is None or store is None:
            raise RunNotActiveError(f"run {self.spec.name!r} has no worker")
        epoch = self.progress.epoch
        try:
            async with trainer.model_lock:
                epoch = self.progress.epoch
                # what was accumulated and not stepped on is lost with the worker's gradients
                progress = {**asdict(self.progress), "accumulated": 0,
                            "samples": self.progress.samples - self.progress.accumulated}
                await trainer.worker.call(WorkerMethod.CHECKPOINT_SAVE,
                                          {"path": str(store.path_for(epoch))})
            spec = {"name": self.spec.name, "manifest": self.spec.manifest.to_json()}
            await asyncio.to_thread(store.commit, epoch, progress, spec)
        except BaseException:
            await asyncio.to_thread(store.discard_unlisted, epoch)
            raise
        self._log.debug("run_checkpointed", epoch=epoch)

    async def _periodic_checkpoint(self) -> None:
        """The engine's checkpoints and the one at stop: one that fails (a full disk, a save the
        worker refused) is skipped and reported in run.status; training goes on."""
        try:
            await self.checkpoint()
        except (OSError, RpcCallError) as exc:
            message = exc.message if isinstance(exc, RpcCallError) else f"{type(exc).__name__}: {exc}"
            self.checkpoint_failures += 1
            self.last_checkpoint_error = {"message": message, "epoch": self.progress.epoch,
                                          "at": timebase.now()}
            self._log.warning("checkpoint_failed", epoch=self.progress.epoch, error=message,
                              hint="free disk space under the state directory; training goes on")

    async def _resume(self) -> None:
        """Load the newest intact checkpoint of this manifest, if any."""
        assert self._worker is not None and self.store is not None
        store = self.store
        for entry, path in await asyncio.to_thread(lambda: list(store.verified())):
            try:
                await self._worker.call(WorkerMethod.CHECKPOINT_LOAD, {"path": str(path)})
            except RpcCallError as exc:
                store.rejected += 1
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


def _drop_written(writing: asyncio.Future[FinalState | None]) -> None:
    """A final state written for a run stopped meanwhile: nobody serves it."""
    if not writing.cancelled() and writing.exception() is None and (final := writing.result()):
        final.remove()


async def finish_or_cancel(task: asyncio.Task[None], timeout: float) -> None:
    """Let a run's task finish its current step for up to `timeout` seconds, then cancel it."""
    done, _ = await asyncio.wait([task], timeout=timeout)
    if not done:
        task.cancel()
        await asyncio.wait([task])
