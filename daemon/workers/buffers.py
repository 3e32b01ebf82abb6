"""Shared-memory buffers the daemon owns and workers fill: flat float32 vectors as numpy arrays.

The daemon creates, names and unlinks every segment; a worker only maps it. Nothing here imports
torch.
"""

from __future__ import annotations

import secrets
from multiprocessing import shared_memory

import numpy as np


class SharedBuffer:
    """A named POSIX shared-memory segment holding `numel` float32 values."""

    DTYPE = np.float32

    def __init__(self, numel: int, prefix: str = "dedloc") -> None:
        if numel <= 0:
            raise ValueError(f"a shared buffer needs at least one element, got {numel}")
        self.numel = numel
        name = f"{prefix}-{secrets.token_hex(6)}"
        nbytes = numel * np.dtype(self.DTYPE).itemsize
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=name, create=True, size=nbytes)
        self.name = self._shm.name
        self.array: np.ndarray = np.ndarray((numel,), dtype=self.DTYPE, buffer=self._shm.buf)

    def close(self) -> None:
        """Unmap and unlink the segment; safe to call twice."""
        if self._shm is None:
            return
        del self.array
        self._shm.close()
        self._shm.unlink()
        self._shm = None

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
