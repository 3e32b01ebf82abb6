"""Mapping a caller's shared-memory buffer (by name) as a float32 numpy array, without owning it.

Programs that call `averaging.average` create a POSIX shared-memory object (e.g. Python's
`multiprocessing.shared_memory.SharedMemory`, or `shm_open` in C) and pass its name. On Linux it
is the file /dev/shm/<name>; the daemon maps that file itself, so Python's resource tracker never
learns of it and can never unlink the caller's buffer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .errors import AveragingError

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
DTYPES = {"float32": np.float32}


class SharedBufferError(AveragingError):
    """The named buffer is missing, too small, or of an unsupported dtype (the caller's fault)."""


@contextlib.contextmanager
def attach(name: str, length: int, dtype: str = "float32") -> Iterator[np.ndarray]:
    """The first `length` elements of shared-memory object `name`, as a writable array view.

    Every view of the array must be dropped before the block ends."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME.match(bare):
        raise SharedBufferError(f"{name!r} is not a shared-memory name (letters, digits, '.', '_', '-')")
    if dtype not in DTYPES:
        raise SharedBufferError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if length < 1:
        raise SharedBufferError(f"length must be at least 1, got {length}")
    nbytes = length * np.dtype(DTYPES[dtype]).itemsize
    try:
        fd = os.open(SHM_DIR / bare, os.O_RDWR)
    except FileNotFoundError:
        raise SharedBufferError(f"no shared-memory object named {bare!r}") from None
    except OSError as exc:
        raise SharedBufferError(f"cannot open shared-memory object {bare!r}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise SharedBufferError(f"{bare!r} holds {size} bytes; {length} {dtype} need {nbytes}")
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, dtype=DTYPES[dtype], count=length)
    try:
        yield array
    finally:
        # No explicit close: finished round objects can keep views alive in reference cycles for
        # a moment, and closing under a view raises. The mapping is unmapped when its last view
        # is gone (refcount or the cyclic collector); the shared-memory object stays the caller's.
        del array, mapping
