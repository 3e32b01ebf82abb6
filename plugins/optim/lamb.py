"""LAMB: Adam's moments with a per-parameter trust ratio, for large-batch training.

The algorithm of You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
Minutes" (ICLR 2020), Algorithm 2. For a parameter `w` with gradient `g` at step `t` (from 1):

    m = β1·m + (1 − β1)·g                 v = β2·v + (1 − β2)·g²
    m̂ = m / (1 − β1^t)                    v̂ = v / (1 − β2^t)          (bias correction)
    u = m̂ / (√v̂ + ε) + λ·w                                            (weight decay in the update)
    r = ‖w‖ / ‖u‖, or 1 where ‖w‖ = 0 or ‖u‖ = 0                       (trust ratio)
    w ← w − η·r·u

Per parameter group: `lr` (η), `betas`, `eps`, `weight_decay` (λ), `bias_correction` and `adapt`
(False: r = 1, plain AdamW-style update for that group). `max_grad_norm`, when given, first scales
all gradients together so that their global L2 norm is at most that value (as DeDLOC's ALBERT
runs did). `weight_decay_groups` splits a model's parameters the way BERT/ALBERT pre-training
does: biases and normalisation weights get no weight decay.

The state is per parameter: `step` (a 0-d float32 tensor, like torch's Adam), `exp_avg` and
`exp_avg_sq`, so a worker can export and restore it as plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

NO_DECAY_NAMES = ("bias", "LayerNorm", "layer_norm")
"""Parameter-name fragments that `weight_decay_groups` keeps out of weight decay."""


class Lamb(torch.optim.Optimizer):
    """The LAMB optimizer (see the module docstring for the exact update)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, *, bias_correction: bool = True,
                 adapt: bool = True, max_grad_norm: float | None = None) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        if max_grad_norm is not None and max_grad_norm <= 0.0:
            raise ValueError(f"invalid max_grad_norm {max_grad_norm}: must be positive (or None)")
        self.max_grad_norm = max_grad_norm
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "adapt": adapt}
        super().__init__(params, defaults)

    def _clip_scale(self) -> torch.Tensor | None:
        """The factor that brings the global gradient norm down to max_grad_norm (None: no clipping)."""
        if self.max_grad_norm is None:
            return None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float()).to(grads[0].device)
                             for g in grads])
        total = torch.linalg.vector_norm(norms)
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self._clip_scale()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                if scale is not None:
                    grad = grad * scale.to(grad.device, grad.dtype)
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = float(state["step"])
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if group["bias_correction"]:
                    correction1 = 1.0 - beta1 ** step
                    correction2 = 1.0 - beta2 ** step
                else:
                    correction1 = correction2 = 1.0
                denominator = (exp_avg_sq / correction2).sqrt_().add_(group["eps"])
                update = (exp_avg / correction1).div_(denominator)
                if group["weight_decay"] != 0.0:
                    update.add_(param, alpha=group["weight_decay"])
                if group["adapt"]:
                    update.mul_(trust_ratio(param, update))
                param.add_(update, alpha=-group["lr"])
        return loss


def trust_ratio(param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """‖param‖ / ‖update‖ as a 0-d tensor, or 1 where either norm is 0 (no host sync)."""
    weight_norm = torch.linalg.vector_norm(param.float())
    update_norm = torch.linalg.vector_norm(update.float())
    ratio = weight_norm / torch.where(update_norm > 0, update_norm, torch.ones_like(update_norm))
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio)).to(update.dtype)


def weight_decay_groups(model: nn.Module, weight_decay: float,
                        no_decay: Sequence[str] = NO_DECAY_NAMES) -> list[dict[str, Any]]:
    """The model's trainable parameters in two groups: with `weight_decay`, and without it.

    A parameter goes without weight decay when it is a vector (biases, normalisation gains and
    shifts) or its name contains one of `no_decay`. Shared parameters appear once. An empty
    group is left out.
    """
    decay: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.dim() <= 1 or any(fragment in name for fragment in no_decay):
            exempt.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
