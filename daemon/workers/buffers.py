"""Shared-memory buffers the daemon owns and workers fill: flat float32 vectors as numpy arrays.

The daemon creates, names and unlinks every segment; a worker only maps it. Nothing here imports
torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import structlog

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
_OWNED = re.compile(r"^(?P<prefix>[a-z]+)-(?P<pid>\d+)-[0-9a-f]+$")


class SharedBuffer:
    """A named POSIX shared-memory segment holding `numel` float32 values."""

    DTYPE = np.float32

    def __init__(self, numel: int, prefix: str = "dedloc") -> None:
        if numel <= 0:
            raise ValueError(f"a shared buffer needs at least one element, got {numel}")
        self.numel = numel
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"  # the pid: see sweep_orphans
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


def sweep_orphans(prefix: str = "dedloc", directory: Path = SHM_DIR) -> int:
    """Unlink the segments that a dead daemon left behind (one killed with SIGKILL cannot clean
    up): those named `<prefix>-<pid>-...` whose process is gone. Returns how many went."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            match = _OWNED.match(path.name)
            if match is None or match["prefix"] != prefix or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    if removed:
        log.info("shared_memory_orphans_removed", count=removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
