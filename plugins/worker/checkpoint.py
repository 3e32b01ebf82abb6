"""Checkpoint files: a torch.save'd dict, written atomically, read back with its format checked.

Writing goes to a temporary file in the target's directory, which is flushed, fsynced, renamed over
the target and the directory fsynced: a crash leaves the old checkpoint or the new one, never a
torn file.

`save_session` and `load_session` are what a worker's checkpoint holds: the workload, its config
and step, the model's, optimizer's and scheduler's state dicts, and in a local-update run the outer
parameters, momentum, residual and the guard's step norm (outer.py), which count rather than the
model's drifted parameters. Loading checks that the checkpoint is of this workload and config.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, SharedBufferError
from .state import read_step_norm

if TYPE_CHECKING:
    from .session import Session

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


def save_session(session: Session, path: str) -> dict[str, Any]:
    """Write `session`'s checkpoint to `path` (atomically, `save`); its path, size and step."""
    payload = {
        "workload": session.workload.name,
        "workload_version": session.workload.version,
        "config": session.config,
        "step": session.step,
        "model": session.model.state_dict(),
        "optimizer": session.optimizer.state_dict(),
        "scheduler": None if session.scheduler is None else session.scheduler.state_dict(),
    }
    if session.outer is not None:  # the model's parameters may have drifted: the outer ones count
        payload["outer"] = {"parameters": session.outer.params.detach().cpu(),
                            "momentum": session.outer.momentum.detach().cpu(),
                            "residual": session.outer.residual.detach().cpu(),
                            "step_norm": session.outer.step_norm}
    size = save(path, payload)
    return {"path": str(Path(path).absolute()), "bytes": size, "step": session.step}


def load_session(session: Session, path: str) -> dict[str, Any]:
    """Load the checkpoint at `path` into `session`; CheckpointError if it is not one of this
    workload and config, or does not fit its model and optimizer."""
    document = load(path)
    where = {"path": path}
    if document.get("workload") != session.workload.name:
        raise CheckpointError(f"{path} is a checkpoint of workload {document.get('workload')!r}, "
                              f"the loaded workload is {session.workload.name!r}", where)
    if document.get("config") != session.config:
        differing = sorted(key for key in set(session.config) | set(document.get("config") or {})
                           if (document.get("config") or {}).get(key) != session.config.get(key))
        raise CheckpointError(f"{path} was saved with another config of {session.workload.name!r} "
                              f"(keys that differ: {', '.join(differing)})",
                              {**where, "keys": differing})
    model_state = document.get("model")
    current = session.model.state_dict()
    if (not isinstance(model_state, dict) or set(model_state) != set(current)
            or any(tuple(model_state[k].shape) != tuple(v.shape) for k, v in current.items())):
        raise CheckpointError(f"{path}: the model tensors do not match this model", where)
    outer = document.get("outer")
    if session.outer is not None and not (
            isinstance(outer, dict)
            and all(isinstance(outer.get(k), torch.Tensor)
                    and tuple(outer[k].shape) == (session.total_numel,)
                    for k in ("parameters", "momentum"))):
        raise CheckpointError(f"{path} holds no outer parameters and momentum of "
                              f"{session.total_numel} elements; it is not a checkpoint of this "
                              "local-update run", where)
    try:
        session.optimizer.load_state_dict(document["optimizer"])
        if session.scheduler is not None and document.get("scheduler") is not None:
            session.scheduler.load_state_dict(document["scheduler"])
        session.model.load_state_dict(model_state)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{path} does not fit the loaded workload: {exc}", where) from exc
    if session.outer is not None:
        residual = outer.get("residual")
        session.outer.load(outer["parameters"], outer["momentum"],
                           residual if isinstance(residual, torch.Tensor)
                           and tuple(residual.shape) == (session.total_numel,) else None)
        try:
            session.outer.step_norm = read_step_norm(outer.get("step_norm"))
        except SharedBufferError:
            session.outer.step_norm = None  # the guard starts over (from the parameters' norm)
    session.step = int(document.get("step", 0))
    session.zero_grad()  # (a local-update run: back on the outer parameters)
    session.state_numel = session._count_state_numel()
    return {"step": session.step}


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
