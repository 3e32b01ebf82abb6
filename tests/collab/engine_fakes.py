"""In-memory ports for tests that run one `RunEngine` on the simulator's virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np

from dedloc.daemon.collab.ports import DownloadedState, Trained


class CountingTrainer:
    """A trainer of 10 samples a second that trains a call's samples in at most its seconds;
    its gradients are zeros."""

    def __init__(self) -> None:
        self.vector = np.zeros(8, dtype=np.float32)
        self.loaded: list[tuple[int, str | None]] = []  # the heads of the states it loaded

    async def train(self, samples: int, seconds: float) -> Trained:
        await asyncio.sleep(min(seconds, samples / 10.0))
        return Trained(samples, 1.0, 10.0)

    async def export_gradients(self) -> np.ndarray:
        return self.vector

    async def step(self, epoch: int) -> float | None:
        return 0.1

    async def zero_grad(self) -> None:
        return None

    async def settle_residual(self, residual: np.ndarray) -> None:
        return None

    async def export_state(self) -> DownloadedState:
        raise NotImplementedError("no downloads in this test")

    async def load_state(self, state: DownloadedState) -> None:
        self.loaded.append((state.epoch, state.lineage))


class PacedTrainer(CountingTrainer):
    """A `CountingTrainer` that trains no more than 10 samples a second of the call's time."""

    async def train(self, samples: int, seconds: float) -> Trained:
        done = max(1, min(samples, int(10 * seconds)))
        await asyncio.sleep(done / 10.0)
        return Trained(done, 1.0, 10.0)
