"""The worker protocol's server side: the `worker.*` JSON-RPC methods a daemon calls
(names and answer shapes: dedloc.rpc.worker_protocol).

Every call that touches the model runs in a thread, one at a time: a second one while another runs
is refused with RUN_NOT_ACTIVE (the daemon serialises its calls; it may still call
`worker.describe` or `worker.hello` while training runs). docs/worker-protocol.md is the
reference; `rpc.discover` documents the same methods from these signatures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import structlog
import torch

from dedloc import __version__
from dedloc.rpc import ErrorCode, InvalidParams, rpc_method
from dedloc.rpc.worker_protocol import (
    PROTOCOL_VERSION,
    ApplyResult,
    CheckpointSaveResult,
    DescribeResult,
    EvaluateResult,
    ExportResult,
    HelloResult,
    StepResult,
    TrainResult,
    Vector,
    WorkerMethod,
    ZeroGradResult,
)

from ..catalog import WorkloadCatalog
from ..errors import (
    CheckpointError,
    PluginLoadError,
    SharedBufferError,
    UnknownWorkloadError,
    WorkerStateError,
    WorkloadConfigError,
    WorkloadError,
)
from .outer import LocalUpdates
from .replicas import ReplicatedSession, parse_devices
from .session import Session

log = structlog.get_logger(__name__)

IMPLEMENTATION = "dedloc-worker"

ERROR_MAP: dict[type[BaseException], ErrorCode] = {
    UnknownWorkloadError: ErrorCode.UNKNOWN_WORKLOAD,
    WorkloadConfigError: ErrorCode.INVALID_WORKLOAD_CONFIG,
    PluginLoadError: ErrorCode.PLUGIN_ERROR,
    SharedBufferError: ErrorCode.BUFFER_ERROR,
    WorkloadError: ErrorCode.WORKLOAD_ERROR,
    CheckpointError: ErrorCode.CHECKPOINT_ERROR,
    WorkerStateError: ErrorCode.RUN_NOT_ACTIVE,
}

T = TypeVar("T")
What = Annotated[Vector, "Which vector: the mean accumulated "
                 "gradients, the parameters, the full state (parameters, optimizer state, buffers), "
                 "or a local-update run's error-feedback residual."]
BufferName = Annotated[str, "Name of a POSIX shared-memory object the caller created (no leading slash)."]
Numel = Annotated[int, "Size of the buffer in float32 elements.", {"minimum": 1}]


class WorkerService:
    """The state behind the `worker.*` methods: the catalog and at most one loaded session."""

    def __init__(self, catalog: WorkloadCatalog, request_stop: Callable[[], None],
                 duty_cycle: float = 1.0) -> None:
        self.catalog = catalog
        self.duty_cycle = duty_cycle  # the share of the time training computes (Session.train)
        self._request_stop = request_stop
        self._session: Session | None = None
        self._busy: str | None = None
        self._running: asyncio.Future[Any] | None = None
        self._cancel = threading.Event()

    # --- plumbing -------------------------------------------------------------------------------

    def _loaded(self) -> Session:
        if self._session is None:
            raise WorkerStateError("no workload is loaded; call worker.load first")
        return self._session

    async def _exclusive(self, method: str, func: Callable[..., T], *args: Any) -> T:
        """Run blocking `func` in a thread, refusing if another model call is running."""
        if self._busy is not None:
            raise WorkerStateError(f"{self._busy} is still running; call {method} after it answers",
                                   {"busy": self._busy})
        self._busy = method
        self._cancel.clear()
        running = asyncio.ensure_future(asyncio.to_thread(func, *args))
        running.add_done_callback(self._finished)
        self._running = running
        # If our caller is cancelled (its connection closed), the thread runs on and keeps the
        # worker busy until it ends; `close()` asks it to stop early and waits for it.
        return await asyncio.shield(running)

    def _finished(self, running: asyncio.Future[Any]) -> None:
        self._busy = None
        self._running = None
        if not running.cancelled() and running.exception() is not None:
            log.debug("worker_call_failed", error=str(running.exception()))

    async def close(self, timeout: float = 30.0) -> None:
        """Ask a running call to stop at its next batch and wait for it (bounded)."""
        self._cancel.set()
        running = self._running
        if running is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.wait([running])
            if not running.done():
                log.warning("worker_call_still_running", method=self._busy, waited_s=timeout)
        if self._session is not None and (running is None or running.done()):
            await asyncio.to_thread(self._session.close)

    # --- methods --------------------------------------------------------------------------------

    @rpc_method(WorkerMethod.HELLO)
    async def hello(self) -> HelloResult:
        """Who this worker is: protocol version, implementation, its version and process id."""
        return {"protocol": PROTOCOL_VERSION, "implementation": IMPLEMENTATION,
                "version": __version__, "pid": os.getpid()}

    @rpc_method(WorkerMethod.LOAD, errors=(ErrorCode.UNKNOWN_WORKLOAD, ErrorCode.INVALID_WORKLOAD_CONFIG,
                                       ErrorCode.WORKLOAD_ERROR, ErrorCode.RUN_NOT_ACTIVE))
    async def load(
        self,
        workload: Annotated[str, "Name of an installed workload."],
        config: Annotated[dict[str, Any] | None, "Workload config; missing keys take defaults."] = None,
        seed: Annotated[int, "Seed of this peer's data sampling (differs per peer)."] = 0,
        init_seed: Annotated[int, "Seed of the model's initial weights (the same on every peer)."] = 0,
        device: Annotated[str, "auto (cuda if available, else cpu), cpu, cuda or cuda:N; several, "
                          "comma-separated (cuda:0,cuda:1), or cuda:all: one process per device, "
                          "data-parallel, still one worker."] = "auto",
        sync: Annotated[dict[str, Any] | None, "How the run syncs: null or {\"mode\": "
                        "\"gradients\"} (gradients accumulate until exported), or {\"mode\": "
                        "\"local\", \"inner_steps\": H, \"outer_lr\": 0.7, \"outer_momentum\": "
                        "0.9, \"nesterov\": true, \"inner_lr_scale\": 1.0, \"feedback_decay\": 1.0} "
                        "(a local-update run: "
                        "the optimizer steps on every batch at its lr times inner_lr_scale, a "
                        "number or \"auto\" with target_batch_size; export gradients gives outer "
                        "minus local parameters, apply gradients takes one outer step)."] = None,
    ) -> DescribeResult:
        """Build a workload's model, optimizer and data; replaces any loaded one.

        Resets the step counter and the accumulated gradients. Answers as `worker.describe`.
        With several devices the worker starts a replica process per extra device
        (docs/worker-protocol.md, "Several devices").
        """
        entry = self.catalog.get(workload)
        resolved = entry.workload.resolve_config(config or {})
        try:
            names = parse_devices(device)
        except ValueError as exc:
            raise InvalidParams("device", str(exc)) from None
        devices = [_pick_device(name) for name in names]
        local = LocalUpdates.from_json(sync)
        if local is not None and len(devices) > 1:
            raise InvalidParams("sync", "a local-update run trains on one device per worker (the "
                                "inner steps of several replicas are not kept in step yet); give "
                                "one device")
        previous = self._session

        def build() -> Session:
            if previous is not None:
                previous.close()  # a replicated session leaves its process group first
            if len(devices) > 1:
                return ReplicatedSession(entry, resolved, seed, init_seed, devices)
            return Session(entry, resolved, seed, init_seed, devices[0], local)

        session = await self._exclusive("worker.load", build)
        self._session = session
        log.info("workload_loaded", workload=workload, devices=[str(d) for d in devices],
                 total_numel=session.total_numel, plugin=entry.plugin)
        return self._describe(session)

    def _describe(self, session: Session) -> DescribeResult:
        return {**session.describe(), "running": self._busy}  # type: ignore[typeddict-item]

    @rpc_method(WorkerMethod.DESCRIBE, errors=(ErrorCode.RUN_NOT_ACTIVE,))
    async def describe(self) -> DescribeResult:
        """The loaded workload: config, device, parameter layout, sizes, progress and speed.

        `running` names the call in progress (e.g. "worker.train"), or is null.
        """
        return self._describe(self._loaded())

    @rpc_method(WorkerMethod.TRAIN, errors=(ErrorCode.RUN_NOT_ACTIVE, ErrorCode.WORKLOAD_ERROR))
    async def train(
        self,
        samples: Annotated[int, "Train on at least this many samples (whole batches).", {"minimum": 1}],
        max_seconds: Annotated[float | None, "Stop after this long (at least one batch runs).",
                               {"exclusiveMinimum": 0}] = None,
    ) -> TrainResult:
        """Compute and accumulate gradients over whole batches; no optimizer step.

        Accumulated gradients add up across calls until `worker.apply` of gradients or
        `worker.zero_grad`. A NaN/Inf loss or gradient fails the call (WORKLOAD_ERROR); that
        batch's gradients are discarded, earlier batches stay accumulated. In a local-update run
        (`worker.load` sync mode "local") the optimizer steps on every batch instead (an inner
        step; `inner_step` in the answer counts them since the last outer step).
        """
        session = self._loaded()
        return await self._exclusive(  # type: ignore[return-value]
            "worker.train", session.train, samples, max_seconds, self._cancel, self.duty_cycle)

    @rpc_method(WorkerMethod.EXPORT, errors=(ErrorCode.RUN_NOT_ACTIVE, ErrorCode.BUFFER_ERROR,
                                         ErrorCode.WORKLOAD_ERROR))
    async def export(self, what: What, buffer: BufferName, numel: Numel) -> ExportResult:
        """Write a flat float32 vector into the shared-memory buffer; `meta` describes it.

        `numel` is the buffer's capacity; a buffer too small fails with BUFFER_ERROR naming the
        size needed. gradients: mean gradient per accumulated sample (zeros if none). state: the
        parameters, the optimizer's per-parameter tensors and the model's floating buffers; `meta`
        holds the layout and everything else needed by `worker.apply` of state. In a local-update
        run, gradients is the pseudo-gradient (outer minus local parameters) plus the residual,
        state carries the outer parameters and momentum (never the residual: it is this peer's
        own), and residual is the error-feedback residual.
        """
        session = self._loaded()
        return await self._exclusive(  # type: ignore[return-value]
            "worker.export", session.export, what, buffer, numel)

    @rpc_method(WorkerMethod.APPLY, errors=(ErrorCode.RUN_NOT_ACTIVE, ErrorCode.BUFFER_ERROR,
                                        ErrorCode.WORKLOAD_ERROR))
    async def apply(
        self, what: What, buffer: BufferName, numel: Numel,
        meta: Annotated[dict[str, Any] | None, "The meta of the export (needed for state); for "
                        "gradients an optional `step`, the run's global step this optimizer step "
                        "is; for parameters an optional `step` that sets the counter."] = None,
    ) -> ApplyResult:
        """Take a flat float32 vector from the shared-memory buffer.

        gradients: set them as the gradients, step the optimizer and scheduler, clear the
        accumulated gradients; answers the new step and the learning rate this step used. With
        meta.step the worker first moves to that step, LR schedule included, so the learning rate
        is the schedule's at meta.step. parameters: copy them in (and the step from meta.step if
        given). state: restore parameters, optimizer and scheduler state and step, checked against
        meta's layout. A wrong numel, a bad meta.step or a NaN/Inf value fails with BUFFER_ERROR
        and changes nothing. In a local-update run, gradients is the averaged pseudo-gradient: one
        outer step; residual replaces the error-feedback residual (what the codec did not convey
        of the last exported vector).
        """
        session = self._loaded()
        return await self._exclusive(  # type: ignore[return-value]
            "worker.apply", session.apply, what, buffer, numel, meta)

    @rpc_method(WorkerMethod.ZERO_GRAD, errors=(ErrorCode.RUN_NOT_ACTIVE,))
    async def zero_grad(self) -> ZeroGradResult:
        """Forget the accumulated gradients."""
        session = self._loaded()
        await self._exclusive("worker.zero_grad", session.zero_grad)
        return {"accumulated_samples": 0}

    @rpc_method(WorkerMethod.CHECKPOINT_SAVE, errors=(ErrorCode.RUN_NOT_ACTIVE, ErrorCode.CHECKPOINT_ERROR))
    async def checkpoint_save(
        self, path: Annotated[str, "File to write (absolute; its directory must exist)."]
    ) -> CheckpointSaveResult:
        """Save model, optimizer, scheduler, step, workload name and config, atomically."""
        session = self._loaded()
        return await self._exclusive(  # type: ignore[return-value]
            "worker.checkpoint_save", session.save_checkpoint, path)

    @rpc_method(WorkerMethod.CHECKPOINT_LOAD, errors=(ErrorCode.RUN_NOT_ACTIVE, ErrorCode.CHECKPOINT_ERROR))
    async def checkpoint_load(self, path: Annotated[str, "A file written by worker.checkpoint_save."]
                              ) -> StepResult:
        """Restore a checkpoint of the loaded workload and config; clears accumulated gradients.

        A checkpoint of another workload or config, or a missing or corrupt file, fails with
        CHECKPOINT_ERROR and changes nothing.
        """
        session = self._loaded()
        return await self._exclusive(  # type: ignore[return-value]
            "worker.checkpoint_load", session.load_checkpoint, path)

    @rpc_method(WorkerMethod.EVALUATE, errors=(ErrorCode.RUN_NOT_ACTIVE, ErrorCode.WORKLOAD_ERROR))
    async def evaluate(
        self, samples: Annotated[int, "Evaluate on at least this many samples.", {"minimum": 1}] = 256
    ) -> EvaluateResult:
        """Mean loss and metrics on the eval split (the same samples every call); no training."""
        session = self._loaded()
        return await self._exclusive(  # type: ignore[return-value]
            "worker.evaluate", session.evaluate, samples)

    @rpc_method(WorkerMethod.STOP)
    async def stop(self) -> dict[str, Any]:
        """Exit (status 0) right after this answer is sent; a running call stops at its next batch."""
        log.info("worker_stop_requested")
        self._cancel.set()
        asyncio.get_running_loop().call_soon(self._request_stop)
        return {}


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        picked = torch.device(device)
    except (RuntimeError, ValueError):
        raise InvalidParams("device", f"{device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if picked.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidParams("device", "CUDA is not available on this machine")
        if picked.index is not None and picked.index >= torch.cuda.device_count():
            raise InvalidParams("device", f"there is no {picked} (this machine has "
                                          f"{torch.cuda.device_count()} CUDA devices)")
    return picked
