"""Mapping the daemon's shared-memory buffers as float32 torch tensors, without owning them.

The daemon creates every POSIX shared-memory object and unlinks it; a worker only maps one for
the length of a call. On Linux the object is the file /dev/shm/<name>, which we map ourselves so
that Python's resource_tracker never learns of it (in Python 3.11 attaching a
`multiprocessing.shared_memory.SharedMemory` registers it, and the tracker would unlink it when the
worker exits). Elsewhere we attach through `SharedMemory` and unregister it at once.

The tensor is a view on the mapping (no copy). It goes through numpy because a numpy array holds
a buffer export on the mapping: closing the mapping while a view is alive then fails loudly instead
of leaving a dangling pointer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import structlog
import torch

from ..errors import SharedBufferError

log = structlog.get_logger(__name__)

FLOAT32_BYTES = 4
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def check_name(name: str) -> str:
    """The buffer's name without a leading slash; SharedBufferError if it is not a plain name."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME.match(bare):
        raise SharedBufferError(f"{name!r} is not a shared-memory name (letters, digits, '.', '_', "
                                "'-'; no '/')", {"buffer": name})
    return bare


@contextlib.contextmanager
def attach(name: str, numel: int) -> Iterator[torch.Tensor]:
    """Map the first `numel` float32 elements of shared-memory object `name` as a CPU tensor.

    The tensor and every view of it must be dropped before the block ends.
    """
    bare = check_name(name)
    if numel < 1:
        raise SharedBufferError(f"numel must be at least 1, got {numel}", {"buffer": bare})
    nbytes = numel * FLOAT32_BYTES
    mapping, close = _map(bare, nbytes)
    array = np.frombuffer(mapping, dtype=np.float32, count=numel)
    tensor = torch.from_numpy(array)
    try:
        yield tensor
    finally:
        del tensor, array
        del mapping
        try:
            close()
        except BufferError:
            # A view escaped the block; the mapping is released when the last view dies.
            log.warning("shared_buffer_view_outlived_call", buffer=bare)


def check_finite(view: torch.Tensor, buffer: str, what: str) -> None:
    """SharedBufferError unless every element of `view` (mapped from `buffer`) is finite: a
    vector of `what` with a NaN or Inf is refused before anything takes it."""
    if not bool(torch.isfinite(view).all()):
        bad = int((~torch.isfinite(view)).sum())
        raise SharedBufferError(f"buffer {buffer!r} holds {bad} NaN or Inf values; the {what} were "
                                "not applied and nothing changed", {"buffer": buffer, "non_finite": bad})


def _map(name: str, nbytes: int) -> tuple[mmap.mmap | memoryview, Callable[[], None]]:
    if SHM_DIR.is_dir():
        mapping = _map_dev_shm(name, nbytes)
        return mapping, mapping.close
    return _map_posix(name, nbytes)


def _map_dev_shm(name: str, nbytes: int) -> mmap.mmap:
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SharedBufferError(f"no shared-memory object named {name!r}", {"buffer": name}) from None
    except OSError as exc:
        raise SharedBufferError(f"cannot open shared-memory object {name!r}: {exc.strerror}",
                                {"buffer": name}) from exc
    try:
        size = os.fstat(fd).st_size
        _check_size(name, size, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _map_posix(name: str, nbytes: int) -> tuple[mmap.mmap | memoryview, Callable[[], None]]:
    """Attach where there is no /dev/shm (not Linux), keeping the resource_tracker out of it."""
    from multiprocessing import resource_tracker, shared_memory

    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        raise SharedBufferError(f"no shared-memory object named {name!r}", {"buffer": name}) from None
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    try:
        _check_size(name, shm.size, nbytes)
    except SharedBufferError:
        shm.close()
        raise
    return shm.buf, shm.close


def _check_size(name: str, size: int, nbytes: int) -> None:
    if size < nbytes:
        raise SharedBufferError(
            f"shared-memory object {name!r} holds {size // FLOAT32_BYTES} float32 elements "
            f"({size} bytes), fewer than numel={nbytes // FLOAT32_BYTES}",
            {"buffer": name, "bytes": size, "numel": nbytes // FLOAT32_BYTES})
