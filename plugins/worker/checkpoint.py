"""Checkpoint files: a torch.save'd dict, written atomically, read back with its format checked.

Writing goes to a temporary file in the target's directory, which is flushed, fsynced, renamed over
the target and the directory fsynced: a crash leaves the old checkpoint or the new one, never a
torn file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

FORMAT = "dedloc-worker-checkpoint"
FORMAT_VERSION = 1


def save(path: str | Path, payload: dict[str, Any]) -> int:
    """Write `payload` (tensors and plain values) to `path` atomically; return its size in bytes."""
    target = Path(path).absolute()
    directory = target.parent
    if not directory.is_dir():
        raise CheckpointError(f"cannot write checkpoint {target}: directory {directory} does not exist",
                              {"path": str(target)})
    document = {"format": FORMAT, "format_version": FORMAT_VERSION, **payload}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(document, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}",
                                  {"path": str(target)}) from exc
        raise
    _fsync_directory(directory)
    return target.stat().st_size


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save`; CheckpointError if it is missing, corrupt or foreign."""
    target = Path(path).absolute()
    try:
        document = torch.load(target, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {target}", {"path": str(target)}) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {target}: {exc.strerror or exc}",
                              {"path": str(target)}) from exc
    except Exception as exc:  # torch/pickle raise many types for a corrupt file
        raise CheckpointError(f"{target} is not a readable checkpoint ({type(exc).__name__}: {exc})",
                              {"path": str(target)}) from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f"{target} is not a dedloc worker checkpoint", {"path": str(target)})
    if document.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{target} has checkpoint format version {document.get('format_version')!r}; "
                              f"this worker reads version {FORMAT_VERSION}", {"path": str(target)})
    return document


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
