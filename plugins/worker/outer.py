"""Local-update runs (the DiLoCo family): the outer parameters and the outer optimizer of a worker.

In a run whose manifest says `sync = "local"`, the workload's own optimizer is the *inner* one: it
steps on every batch, so the model's parameters drift away from the *outer* parameters, the ones
every peer of the run holds alike. When the swarm has trained `inner_steps` global batches, the
daemon exports each trainer's pseudo-gradient (outer minus local parameters), averages it over the
trainers weighted by their samples, and applies the average here as one step of the outer
optimizer (SGD with Nesterov momentum, as DiLoCo): every trainer then holds the same new outer
parameters and starts its next inner steps from them.

    momentum = mu * momentum + delta
    outer   -= lr * (delta + mu * momentum)   # nesterov; plain momentum: lr * momentum

With lr 1 and mu 0 the outer step is the weighted mean of the peers' local parameters.

**The outer step's guard** (`outer_clip`, kappa): the averaged pseudo-gradient goes straight into
the outer parameters, so one peer that claims a large weight and sends a huge vector could set
them to anything in one round (no inner optimizer normalises it, as Adam or LAMB do a gradient).
Before the step, delta is scaled down to at most kappa times `step_norm`, a running mean (0.9)
of the norms of the steps taken so far; the first step, with no history, to at most
`FIRST_STEP_RATIO` of the outer parameters' norm. Every trainer computes the same factor: the
norms are float64 sums on the CPU over the same vectors, the factor is rounded to 7 significant
digits, and `step_norm` travels in the downloaded state and in checkpoints. An honest run's
steps grow and shrink slowly, so the guard rarely bites; an attacker can still move the run by
up to kappa times its recent steps per round (what remains: docs/security.md).

**The inner learning rate** (`inner_lr_scale`): the workload's learning rate is set for the run's
global batch, but an inner step takes one trainer's batch. Each inner step multiplies every
parameter group's learning rate by the scale for the duration of that `optimizer.step()` only:
a number, or "auto", the batch's size over the run's `target_batch_size` (the linear scaling
rule: the same lr per sample as the global batch). The optimizer's and the scheduler's own
state never hold a scaled rate, so states, checkpoints and the schedule's positioning carry
the workload's rates and nothing can be scaled twice.

**Overlap** (`overlap`, a one-step-delayed outer step): the trainer keeps training while its
pseudo-gradient is being averaged. The export remembers where the model was (the *anchor*);
when the average comes back, the outer step is taken as above and the inner steps made since
the export are carried over onto the new outer parameters: local = new outer + (local - anchor).
Every inner step still goes into exactly one exchange (the next one), and the exchange costs no
training time; the price is that those inner steps started from parameters one outer step old.

**Error feedback** (a lossy codec such as topk): the daemon hands back the *residual*, what the
codec did not convey of the last export, and the next pseudo-gradient carries it (times
`feedback_decay`, beta): with beta 1 nothing is lost, only late; with beta < 1 (SparseLoCo's
recipe for topk, with no outer momentum) the residual is a decaying sum of the past
pseudo-gradients, which stands in for the outer momentum.

`OuterState` keeps both vectors flat (float32, on the model's device); the worker's state export
carries them (the outer parameters in the parameters' slots, the momentum after everything else),
and so do checkpoints. A worker in a local-update run never gives out its drifted local parameters
as "the state": a newcomer starts from the outer parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from dedloc.rpc import InvalidParams
from dedloc.rpc.worker_protocol import INNER_LR_SCALE_AUTO, MAX_INNER_LR_SCALE, MIN_INNER_LR_SCALE

from .layout import Slot, gather, scatter_views

__all__ = ["LocalUpdates", "OuterState"]


@dataclass(frozen=True)
class LocalUpdates:
    """What `worker.load`'s `sync` says about a local-update run (see the module docstring).
    `inner_steps` is the run's H: the outer step t positions the workload's learning-rate
    schedule at t * H inner steps, so that every peer's schedule agrees at each outer boundary."""

    inner_steps: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    overlap: bool = False  # train on while the pseudo-gradient is averaged (module docstring)
    clip: float = 4.0  # the outer step's guard, kappa (module docstring; 0: none)
    # a lossy codec's residual x this before it joins the next pseudo-gradient (SparseLoCo's beta)
    feedback_decay: float = 1.0
    # the inner steps' learning rate x this, or "auto": x batch / target_batch_size (module docstring)
    inner_lr_scale: float | Literal["auto"] = 1.0
    target_batch_size: int | None = None  # the run's; needed by "auto"

    def __post_init__(self) -> None:
        if self.inner_lr_scale == INNER_LR_SCALE_AUTO and self.target_batch_size is None:
            raise ValueError('inner_lr_scale "auto" needs the run\'s target_batch_size')

    def lr_scale(self, batch_size: int) -> float:
        """What an inner step on a batch of `batch_size` samples multiplies the learning rate by."""
        if self.inner_lr_scale == INNER_LR_SCALE_AUTO:
            assert self.target_batch_size is not None  # (__post_init__)
            return batch_size / self.target_batch_size
        return float(self.inner_lr_scale)

    @classmethod
    def from_json(cls, sync: Mapping[str, Any] | None) -> LocalUpdates | None:
        """None for a gradients run (`sync` null or mode "gradients"); InvalidParams if malformed."""
        if sync is None:
            return None
        if not isinstance(sync, Mapping):
            raise InvalidParams("sync", "must be an object such as {\"mode\": \"local\", "
                                "\"inner_steps\": 100}")
        mode = sync.get("mode", "gradients")
        if mode == "gradients":
            if set(sync) - {"mode"}:
                raise InvalidParams("sync", "a gradients run takes no other sync settings")
            return None
        if mode != "local":
            raise InvalidParams("sync.mode", f"must be \"gradients\" or \"local\", not {mode!r:.40}")
        unknown = set(sync) - {"mode", "inner_steps", "outer_lr", "outer_momentum", "nesterov",
                               "overlap", "clip", "inner_lr_scale", "target_batch_size",
                               "feedback_decay"}
        if unknown:
            raise InvalidParams("sync", f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
        steps = sync.get("inner_steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1_000_000:
            raise InvalidParams("sync.inner_steps", f"must be an integer from 1 to 1000000, not "
                                f"{steps!r:.40}")
        lr = _number(sync, "outer_lr", 0.7, 0.0, 10.0)
        momentum = _number(sync, "outer_momentum", 0.9, 0.0, 0.999)
        clip = _number(sync, "clip", 4.0, 0.0, 1000.0)
        decay = _number(sync, "feedback_decay", 1.0, 0.0, 1.0)
        flags = []
        for key, default in (("nesterov", True), ("overlap", False)):
            flag = sync.get(key, default)
            if not isinstance(flag, bool):
                raise InvalidParams(f"sync.{key}", f"must be a boolean, not {flag!r:.40}")
            flags.append(flag)
        target = sync.get("target_batch_size")
        if target is not None and (isinstance(target, bool) or not isinstance(target, int)
                                   or target < 1):
            raise InvalidParams("sync.target_batch_size", f"must be an integer >= 1, not "
                                f"{target!r:.40}")
        scale = sync.get("inner_lr_scale", 1.0)
        if scale == INNER_LR_SCALE_AUTO:
            if target is None:
                raise InvalidParams("sync.target_batch_size", "is needed with inner_lr_scale "
                                    "\"auto\" (each inner step's lr is scaled by its batch "
                                    "over the run's target batch size)")
        else:
            scale = _number(sync, "inner_lr_scale", 1.0, MIN_INNER_LR_SCALE, MAX_INNER_LR_SCALE,
                            also='"auto" or ')
        return cls(steps, lr, momentum, *flags, clip=clip, feedback_decay=decay,
                   inner_lr_scale=scale, target_batch_size=target)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"mode": "local", "inner_steps": self.inner_steps, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
                "overlap": self.overlap, "clip": self.clip, "inner_lr_scale": self.inner_lr_scale,
                "feedback_decay": self.feedback_decay}
        if self.target_batch_size is not None:
            data["target_batch_size"] = self.target_batch_size
        return data


def _number(sync: Mapping[str, Any], key: str, default: float, low: float, high: float,
            also: str = "") -> float:
    value = sync.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise InvalidParams(f"sync.{key}", f"must be {also}a number from {low} to {high}, not "
                            f"{value!r:.40}")
    return float(value)


FIRST_STEP_RATIO = 0.1  # the first outer step: at most this fraction of the parameters' norm
STEP_NORM_DECAY = 0.9
_CLIP_DIGITS = 7


def cpu_norm(vector: torch.Tensor) -> float:
    """The L2 norm as a float64 sum on the CPU: the same on every peer for the same vector."""
    flat = vector.detach().reshape(-1).to("cpu", torch.float32).numpy()
    return float(np.sqrt(np.dot(flat.astype(np.float64), flat.astype(np.float64))))


class OuterState:
    """The outer parameters and the outer optimizer's momentum (flat float32 vectors)."""

    def __init__(self, settings: LocalUpdates, slots: Sequence[Slot],
                 params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.settings = settings
        self.slots = list(slots)
        numel = self.slots[-1].end
        self.params = torch.empty(numel, dtype=torch.float32, device=device)
        self.momentum = torch.zeros(numel, dtype=torch.float32, device=device)
        # error feedback (a lossy codec): what the exchanges did not convey yet; the daemon
        # computes it (it knows the codec) and hands it back after each outer step
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        # overlap: the local parameters at the last export, and the samples and inner steps
        # trained by then (what the exchange under way carries)
        self.anchor: torch.Tensor | None = None
        self.anchor_samples = 0
        self.anchor_inner_steps = 0
        # the guard's running mean of the outer steps' norms (None: no step yet)
        self.step_norm: float | None = None
        self.clipped_steps = 0
        self.take(params)

    @property
    def numel(self) -> int:
        return int(self.params.numel())

    def take(self, params: Sequence[torch.Tensor]) -> None:
        """The outer parameters become the model's current ones (at load: the initial weights)."""
        with torch.no_grad():
            gather(self.slots, params, self.params)

    def restore(self, params: Sequence[torch.Tensor]) -> None:
        """The model's parameters go back to the outer ones (inner progress dropped)."""
        with torch.no_grad():
            for param, value in zip(params, scatter_views(self.slots, self.params), strict=True):
                param.copy_(value)

    def pseudo_gradient(self, params: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """out = outer - local parameters (what the inner steps moved, with the sign of a
        gradient), plus the error-feedback residual times `feedback_decay`."""
        with torch.no_grad():
            gather(self.slots, params, out)
            out.neg_().add_(self.params.to(out.device)).add_(
                self.residual.to(out.device), alpha=self.settings.feedback_decay)

    def remember(self, params: Sequence[torch.Tensor], samples: int, inner_steps: int) -> None:
        """Overlap: an export; training goes on from here while it is averaged."""
        if not self.settings.overlap:
            return
        if self.anchor is None:
            self.anchor = torch.empty_like(self.params)
        with torch.no_grad():
            gather(self.slots, params, self.anchor)
        self.anchor_samples, self.anchor_inner_steps = samples, inner_steps

    def forget(self) -> None:
        self.anchor = None
        self.anchor_samples = self.anchor_inner_steps = 0

    def carry_over(self, params: Sequence[torch.Tensor]) -> bool:
        """Overlap, after an outer step: move the inner steps made since the export onto the
        new outer parameters (local = outer + local - anchor). False if there is no export to
        carry over from (the model then goes back to the outer parameters)."""
        anchor = self.anchor
        if anchor is None:
            return False
        with torch.no_grad():
            shift = self.params - anchor
            for param, value in zip(params, scatter_views(self.slots, shift), strict=True):
                param.add_(value.to(param.dtype))
        return True

    def guard(self, delta_norm: float) -> float:
        """The factor (at most 1) the averaged pseudo-gradient of norm `delta_norm` is scaled by
        (module docstring), and the running norm updated with the step taken."""
        kappa = self.settings.clip
        factor = 1.0
        if kappa > 0 and math.isfinite(delta_norm) and delta_norm > 0:
            bound = kappa * self.step_norm if self.step_norm is not None \
                else FIRST_STEP_RATIO * cpu_norm(self.params)
            if bound > 0 and delta_norm > bound:  # (no bound yet: zero parameters, zero steps)
                factor = float(f"{bound / delta_norm:.{_CLIP_DIGITS}g}")
                self.clipped_steps += 1
        taken = float(f"{delta_norm * factor:.{_CLIP_DIGITS}g}")
        self.step_norm = taken if self.step_norm is None \
            else float(f"{STEP_NORM_DECAY * self.step_norm + (1 - STEP_NORM_DECAY) * taken:.{_CLIP_DIGITS}g}")
        return factor

    def step(self, delta: torch.Tensor, delta_norm: float | None = None) -> float:
        """One outer optimizer step with the averaged pseudo-gradient `delta` (flat), through
        the guard (`delta_norm`: its norm as `cpu_norm` computes it, if known); the factor the
        guard scaled it by."""
        settings = self.settings
        factor = self.guard(cpu_norm(delta) if delta_norm is None else delta_norm)
        delta = delta.to(self.params.device, dtype=torch.float32)
        if factor < 1.0:
            delta = delta * factor
        with torch.no_grad():
            if settings.outer_momentum > 0:
                self.momentum.mul_(settings.outer_momentum).add_(delta)
                direction = delta.add(self.momentum, alpha=settings.outer_momentum) \
                    if settings.nesterov else self.momentum
            else:
                direction = delta
            self.params.add_(direction, alpha=-settings.outer_lr)
        return factor

    def load(self, params: torch.Tensor, momentum: torch.Tensor,
             residual: torch.Tensor | None = None) -> None:
        """Take outer parameters and momentum from a state or checkpoint (flat, checked by the
        caller); the residual from a checkpoint of this peer, else zero (a downloaded state's
        owner keeps its own residual: taking it would send that mass twice)."""
        with torch.no_grad():
            self.params.copy_(params.reshape(-1))
            self.momentum.copy_(momentum.reshape(-1))
            if residual is None:
                self.residual.zero_()
            else:
                self.residual.copy_(residual.reshape(-1))
