"""The `Trainer` port over a worker process: worker-protocol calls and shared-memory buffers.

Every call that touches the model holds `model_lock`, so the engine's calls and state donations
to other peers (state_sync.py) never overlap; a worker refusing a vector or state
(RpcCallError) is `TrainerRefused`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from dedloc.rpc import RpcCallError
from dedloc.rpc.worker_protocol import WorkerMethod

from ..workers.buffers import SharedBuffer
from ..workers.process import WorkerProcess
from .ports import DownloadedState, Trained, TrainerRefused

__all__ = ["WorkerTrainer"]


class WorkerTrainer:
    """A loaded worker as the engine's trainer. `close()` frees the gradient buffer."""

    def __init__(self, worker: WorkerProcess, gradient_numel: int) -> None:
        self.worker = worker
        self.model_lock = asyncio.Lock()
        self._buffer = SharedBuffer(gradient_numel)
        self.inner_step: int | None = None  # a local-update run's, as the worker last said
        self.inner_lr: float | None = None  # a local-update run's last inner step's rate (scaled)
        self.clipped_steps = 0  # a local-update run's outer steps that its guard scaled down
        self.skipped_batches = 0  # batches the worker skipped for a NaN or Inf loss or gradients

    async def call(self, method: WorkerMethod, params: dict[str, Any] | None = None) -> Any:
        async with self.model_lock:
            return await self.worker.call(method, params)

    async def train(self, samples: int, seconds: float) -> Trained:
        result = await self.call(WorkerMethod.TRAIN, {"samples": samples, "max_seconds": seconds})
        inner = result.get("inner_step")
        self.inner_step = inner if isinstance(inner, int) else None
        lr = result.get("inner_lr")
        self.inner_lr = float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) \
            else None
        skipped = result.get("skipped_batches")
        self.skipped_batches = skipped if isinstance(skipped, int) else self.skipped_batches
        return Trained(int(result["samples"]), float(result["loss"]),
                       result.get("samples_per_second"))

    async def export_gradients(self) -> np.ndarray:
        buffer = self._buffer
        await self.call(WorkerMethod.EXPORT, {"what": "gradients", "buffer": buffer.name,
                                              "numel": buffer.numel})
        return buffer.array

    async def step(self, epoch: int) -> float | None:
        buffer = self._buffer
        applied = await self.call(WorkerMethod.APPLY, {
            "what": "gradients", "buffer": buffer.name, "numel": buffer.numel,
            "meta": {"step": epoch}})  # the learning-rate schedule follows the run's epoch
        factor = applied.get("clip_factor")
        if isinstance(factor, int | float) and factor < 1.0:
            self.clipped_steps += 1
        inner = applied.get("inner_step")  # a local-update run: what it carried over
        if self.inner_step is not None or isinstance(inner, int):
            self.inner_step = inner if isinstance(inner, int) else 0
        return applied.get("lr")

    async def zero_grad(self) -> None:
        await self.call(WorkerMethod.ZERO_GRAD)

    async def settle_residual(self, residual: np.ndarray) -> None:
        buffer = self._buffer
        async with self.model_lock:
            await asyncio.to_thread(np.copyto, buffer.array, residual)  # (a whole vector)
            await self.worker.call(WorkerMethod.APPLY, {
                "what": "residual", "buffer": buffer.name, "numel": buffer.numel})

    async def export_state(self) -> DownloadedState:
        async with self.model_lock:
            description = await self.worker.call(WorkerMethod.DESCRIBE)
            buffer = SharedBuffer(int(description["state_numel"]))
            try:
                result = await self.worker.call(WorkerMethod.EXPORT, {
                    "what": "state", "buffer": buffer.name, "numel": buffer.numel})
            except BaseException:
                buffer.close()
                raise
        return DownloadedState(buffer, int(result["numel"]), result["meta"], 0, None)

    async def load_state(self, state: DownloadedState) -> None:
        if not isinstance(state.buffer, SharedBuffer):
            raise TrainerRefused("a worker takes states in shared memory only")
        async with self.model_lock:
            try:
                await self.worker.call(WorkerMethod.APPLY, {
                    "what": "state", "buffer": state.buffer.name, "numel": state.numel,
                    "meta": state.meta})
            except RpcCallError as exc:
                raise TrainerRefused(exc.message) from exc
            await self.worker.call(WorkerMethod.ZERO_GRAD)

    def close(self) -> None:
        self._buffer.close()
