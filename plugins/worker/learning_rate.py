"""The learning rates in an optimizer's parameter groups: copied and set exactly, and scaled.

A parameter group's `lr` is a number or a tensor (some optimizers take a tensor so that a compiled
step does not recompile when it changes); these helpers keep whichever it is. `scaled_lr` is how a
local-update run's inner step takes the workload's rate times its `inner_lr_scale` for that step
only (outer.py says why); the optimizer's state and the scheduler never see the scaled rate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import WorkloadError


def copy_lr(lr: Any) -> Any:
    """A copy of a parameter group's `lr` that later changes to the group do not touch."""
    return lr.clone() if isinstance(lr, torch.Tensor) else lr


def set_lr(group: dict[str, Any], lr: Any) -> None:
    """Set a parameter group's learning rate to `lr`, in place if the group holds a tensor."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(float(lr))
    else:
        group["lr"] = float(lr) if isinstance(lr, torch.Tensor) else lr


def check_scalable(optimizer: torch.optim.Optimizer, workload: str) -> None:
    """WorkloadError unless every parameter group has a numeric learning rate (a local-update
    run's inner steps scale it by inner_lr_scale)."""
    for index, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, int | float | torch.Tensor):
            raise WorkloadError(f"workload {workload!r}: its optimizer's parameter group {index} "
                                f"has lr {lr!r:.40}, not a number, so inner_lr_scale cannot scale "
                                "it; give the local-update run inner_lr_scale 1 (the workload's "
                                "rate unchanged)")


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[float | None]:
    """Every parameter group's learning rate times `scale` inside the block, put back exactly
    after it (the optimizer's state and a scheduler never see a scaled rate); yields the first
    group's rate as scaled (None if it has no numeric one: then `scale` is 1, see
    `check_scalable`)."""
    groups = optimizer.param_groups
    saved = [copy_lr(group["lr"]) for group in groups]
    try:
        if scale != 1.0:
            for group in groups:
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].mul_(scale)
                else:
                    group["lr"] = group["lr"] * scale
        first = groups[0]["lr"]
        yield float(first) if isinstance(first, int | float | torch.Tensor) \
            and not isinstance(first, bool) else None
    finally:
        for group, lr in zip(groups, saved, strict=True):
            if isinstance(group["lr"], torch.Tensor) and isinstance(lr, torch.Tensor):
                group["lr"].copy_(lr)
            else:
                group["lr"] = lr
