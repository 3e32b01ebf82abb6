"""LARS: SGD with momentum and a layer-wise trust ratio (You, Gitman & Ginsburg, 2017).

For each parameter tensor `p` of a group that is not excluded, with gradient `g`, weight decay
`wd`, trust coefficient `eta` and momentum `m`:

    ratio = eta * ||p|| / (||g|| + wd * ||p|| + eps)     (1 when ||p|| or ||g|| is 0)
    d     = (g + wd * p) * ratio
    buf   = d                  on the first step, else   buf = m * buf + d
    p     = p - lr * buf

A group with `exclude=True` (biases and normalisation layers: see `lars_param_groups`) takes plain
SGD with momentum: `d = g`, no weight decay, no trust ratio. The learning rate of each group is
the one an LR scheduler sets, as with `torch.optim.SGD`. The state is one `momentum_buffer` per
parameter (absent when `momentum` is 0), like SGD's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose update of each tensor is scaled by its trust ratio (see module doc)."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9,
                 weight_decay: float = 1e-6, trust_coefficient: float = 0.001, eps: float = 1e-8,
                 exclude: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum {momentum} (0 <= momentum < 1)")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight decay {weight_decay}")
        if trust_coefficient <= 0.0:
            raise ValueError(f"invalid trust coefficient {trust_coefficient}")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "eps": eps, "exclude": exclude}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = param.grad
                if not group["exclude"]:
                    update = _adapted(param, update, group["weight_decay"], group["trust_coefficient"],
                                      group["eps"])
                if momentum != 0.0:
                    state = self.state[param]
                    buffer = state.get("momentum_buffer")
                    if buffer is None:
                        buffer = state["momentum_buffer"] = update.detach().clone()
                    else:
                        buffer.mul_(momentum).add_(update)
                    update = buffer
                param.add_(update, alpha=-group["lr"])
        return loss


def _adapted(param: torch.Tensor, grad: torch.Tensor, weight_decay: float, trust: float,
             eps: float) -> torch.Tensor:
    """(g + wd * p) times the trust ratio of `param` (no host synchronisation)."""
    param_norm = torch.linalg.vector_norm(param)
    grad_norm = torch.linalg.vector_norm(grad)
    ratio = trust * param_norm / (grad_norm + weight_decay * param_norm + eps)
    ratio = torch.where((param_norm > 0) & (grad_norm > 0), ratio, torch.ones_like(ratio))
    return grad.add(param, alpha=weight_decay).mul_(ratio)


def lars_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The model's trainable parameters in LARS groups: tensors of 2+ dimensions (weights of
    convolutions and linear layers) adapted and decayed; 1-dimensional ones (biases, the weights
    and biases of BatchNorm and other normalisation layers) in a group with `exclude=True` and
    no weight decay. Empty groups are left out."""
    adapted: list[nn.Parameter] = []
    excluded: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (adapted if param.dim() > 1 else excluded).append(param)
    groups: list[dict[str, Any]] = []
    if adapted:
        groups.append({"params": adapted})
    if excluded:
        groups.append({"params": excluded, "exclude": True, "weight_decay": 0.0})
    return groups
