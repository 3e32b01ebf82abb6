"""A trainer made of vectors, for the simulator: the engine's `Trainer` port without torch.

`VectorTrainer` minimises a quadratic, `0.5 * |x - optimum|^2`, with SGD: a sample's gradient is
`x - optimum` plus noise drawn from the peer's own data stream, so peers that average their
gradients step exactly like one machine with the whole batch (what collaboration promises), and
peers that diverge show it in their parameters. Training takes virtual time: `samples_per_second`
of the simulated device.
"""

from __future__ import annotations

import asyncio

import numpy as np

from dedloc.daemon.collab.ports import DownloadedState, Trained, TrainerRefused

__all__ = ["ArrayBuffer", "VectorTrainer"]


class ArrayBuffer:
    """A state in plain memory (a worker would take shared memory)."""

    def __init__(self, numel: int) -> None:
        self.array = np.zeros(numel, dtype=np.float32)

    def close(self) -> None:
        self.array = np.zeros(0, dtype=np.float32)


class VectorTrainer:
    """See the module docstring. `parameters` is the model (float32); `optimum` is shared by all
    peers of a run (it comes from the run's seed), the noise is each peer's own."""

    def __init__(self, size: int, *, samples_per_second: float, run_seed: int = 0, data_seed: int = 1,
                 lr: float = 0.1, noise: float = 0.5, batch: int = 4) -> None:
        init = np.random.default_rng(run_seed)
        self.optimum = init.standard_normal(size).astype(np.float32)
        self.parameters = np.zeros(size, dtype=np.float32)
        self.samples_per_second = samples_per_second
        self.lr = lr
        self.noise = noise
        self.batch = batch
        self.steps = 0
        self._rng = np.random.default_rng(data_seed)
        self._sum = np.zeros(size, dtype=np.float64)
        self._count = 0
        self._vector = np.zeros(size, dtype=np.float32)
        self._busy = asyncio.Lock()

    @property
    def loss(self) -> float:
        return float(0.5 * np.square(self.parameters - self.optimum).sum())

    async def train(self, samples: int, seconds: float) -> Trained:
        async with self._busy:
            affordable = int(seconds * self.samples_per_second) // self.batch * self.batch
            count = max(self.batch, min(samples + (-samples % self.batch), affordable))
            await asyncio.sleep(count / self.samples_per_second)
            error = (self.parameters - self.optimum).astype(np.float64)
            self._sum += count * error + self._rng.standard_normal(error.size) * (
                self.noise * np.sqrt(count))
            self._count += count
            return Trained(count, self.loss, self.samples_per_second)

    async def export_gradients(self) -> np.ndarray:
        async with self._busy:
            if self._count:
                np.divide(self._sum, self._count, out=self._vector, casting="unsafe")
            else:
                self._vector.fill(0.0)
            return self._vector

    async def step(self, epoch: int) -> float | None:
        async with self._busy:
            self.parameters -= self.lr * self._vector
            self.steps = epoch + 1
            self._sum.fill(0.0)
            self._count = 0
            return self.lr

    async def zero_grad(self) -> None:
        async with self._busy:
            self._sum.fill(0.0)
            self._count = 0

    async def export_state(self) -> DownloadedState:
        async with self._busy:
            buffer = ArrayBuffer(self.parameters.size)
            buffer.array[:] = self.parameters
            return DownloadedState(buffer, self.parameters.size, {"steps": self.steps}, 0, None)

    async def load_state(self, state: DownloadedState) -> None:
        async with self._busy:
            values = state.buffer.array[: state.numel]
            if state.numel != self.parameters.size or not np.isfinite(values).all():
                raise TrainerRefused(f"a state of {state.numel} values does not fit "
                                     f"{self.parameters.size} parameters, or is not finite")
            self.parameters[:] = values
            self._sum.fill(0.0)
            self._count = 0
