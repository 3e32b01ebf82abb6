"""The learning-rate schedule at a global step: putting a scheduler where the run is.

A peer joins a run mid-way, a gradients run's optimizer step says which global step it is, and a
local-update run's outer step sets the schedule of its inner steps: each time the workload's
scheduler must be where the run's step says, not where its own count of steps is.
`position_scheduler` sets it there in closed form where the scheduler has one, and otherwise
replays its steps (from `scheduler_start`, the fresh scheduler's copy, when it must go back).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import structlog
import torch
from torch.optim import lr_scheduler

from .learning_rate import copy_lr, set_lr

log = structlog.get_logger(__name__)

SchedulerStart = tuple[dict[str, Any], list[Any]]
"""A fresh scheduler's state and its optimizer's learning rates (`scheduler_start`)."""


def scheduler_start(optimizer: torch.optim.Optimizer,
                    scheduler: lr_scheduler.LRScheduler | None) -> SchedulerStart | None:
    """A copy of a fresh scheduler's state and its optimizer's learning rates (None if not copyable)."""
    if scheduler is None:
        return None
    try:
        state = copy.deepcopy(scheduler.state_dict())
    except Exception:  # a custom scheduler whose state cannot be copied: no rewinding by replay
        log.warning("scheduler_state_not_copyable", scheduler=type(scheduler).__name__)
        return None
    return state, [copy_lr(group["lr"]) for group in optimizer.param_groups]


def position_scheduler(scheduler: lr_scheduler.LRScheduler, step: int,
                       start: SchedulerStart | None = None) -> None:
    """Set `scheduler` (and its optimizer's learning rates) as if it had been stepped `step` times.

    The next optimizer step then uses the schedule's learning rate at `step`, and the scheduler's
    next `step()` moves on to `step + 1`. Schedulers with a closed form are set directly:
    LambdaLR (base_lr * lambda(step)), MultiplicativeLR (base_lr * the product of lambda(1..step)),
    those with `_get_closed_form_lr` (StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR,
    PolynomialLR, CosineAnnealingLR) and those whose get_lr only reads `last_epoch` (OneCycleLR,
    CyclicLR, which also set the momentum). Any other (SequentialLR, ChainedScheduler, whose count
    is its first scheduler's, CosineAnnealingWarmRestarts, a custom one) is stepped forward to
    `step`, after rewinding to `start` (see scheduler_start) when it is past `step`.
    ReduceLROnPlateau follows a metric, not a step count, and is left alone.
    """
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        return
    epoch = _scheduler_epoch(scheduler)
    if epoch is None:
        log.warning("scheduler_not_positioned", scheduler=type(scheduler).__name__, step=step,
                    reason="it does not count its steps (no last_epoch)")
        return
    if epoch == step:
        return
    optimizer = scheduler.optimizer
    lrs = _closed_form_lrs(scheduler, step)
    if lrs is None:
        _replay(scheduler, step, start)
        return
    scheduler.last_epoch = step
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        set_lr(group, lr)
    scheduler._last_lr = [copy_lr(group["lr"]) for group in optimizer.param_groups]


def _closed_form_lrs(scheduler: lr_scheduler.LRScheduler, step: int) -> list[Any] | None:
    kind = type(scheduler)
    if isinstance(scheduler, lr_scheduler.LambdaLR) and kind.get_lr is lr_scheduler.LambdaLR.get_lr:
        return [base_lr * lmbda(step)
                for lmbda, base_lr in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    multiplicative = lr_scheduler.MultiplicativeLR
    if isinstance(scheduler, multiplicative) and kind.get_lr is multiplicative.get_lr:
        lrs = []
        for lmbda, base_lr in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True):
            lr = base_lr
            for epoch in range(1, step + 1):  # the initial step keeps base_lr; step k multiplies
                lr = lr * lmbda(epoch)
            lrs.append(lr)
        return lrs
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)
    # Their get_lr reads only last_epoch and the base and max learning rates.
    closed_get_lr = kind.get_lr in (lr_scheduler.OneCycleLR.get_lr, lr_scheduler.CyclicLR.get_lr)
    if closed_form is None and not closed_get_lr:
        return None
    previous = scheduler.last_epoch
    scheduler.last_epoch = step
    try:
        if closed_form is not None:
            return list(closed_form())
        with warnings.catch_warnings():  # "use get_last_lr()": we do want the lr at last_epoch
            warnings.simplefilter("ignore", UserWarning)
            return list(scheduler.get_lr())
    finally:
        scheduler.last_epoch = previous


def _scheduler_epoch(scheduler: Any) -> int | None:
    """How many times `scheduler` was stepped: its last_epoch, or its first chained scheduler's."""
    epoch = getattr(scheduler, "last_epoch", None)
    if isinstance(epoch, int) and not isinstance(epoch, bool):
        return epoch
    children = getattr(scheduler, "_schedulers", None)
    return _scheduler_epoch(children[0]) if children else None


def _replay(scheduler: lr_scheduler.LRScheduler, step: int, start: SchedulerStart | None) -> None:
    epoch = _scheduler_epoch(scheduler)
    if epoch is not None and step < epoch:
        if start is None:
            log.warning("scheduler_not_positioned", scheduler=type(scheduler).__name__, step=step,
                        reason=f"it is at step {epoch} and cannot be rewound")
            return
        state, start_lrs = start
        scheduler.load_state_dict(copy.deepcopy(state))
        for group, lr in zip(scheduler.optimizer.param_groups, start_lrs, strict=True):
            set_lr(group, lr)
        epoch = _scheduler_epoch(scheduler)
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()" and the like
        warnings.simplefilter("ignore", UserWarning)
        while epoch is not None and epoch < step:
            scheduler.step()
            after = _scheduler_epoch(scheduler)
            if after is None or after <= epoch:  # a custom scheduler that does not count its steps
                log.warning("scheduler_not_positioned", scheduler=type(scheduler).__name__, step=step,
                            reason="its step() does not advance last_epoch")
                return
            epoch = after
