"""LARS (plugins/optim/lars.py) against two steps computed by hand on a tiny model.

For a tensor p that is adapted (2+ dimensions), with gradient g:
    ratio = eta * ||p|| / (||g|| + wd * ||p|| + eps)      (1 if ||p|| or ||g|| is 0)
    d = (g + wd * p) * ratio;  buf = d (first step) or m * buf + d;  p = p - lr * buf
For an excluded tensor (biases, BatchNorm): d = g (no decay, no ratio), same momentum.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dedloc.plugins.optim.lars import LARS, lars_param_groups

LR, MOMENTUM, WD, ETA, EPS = 0.5, 0.9, 0.01, 0.001, 1e-8


def norm(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def adapted_step(p: list[float], g: list[float], buf: list[float] | None
                 ) -> tuple[list[float], list[float]]:
    """One LARS step of an adapted tensor, element by element: (new p, new momentum buffer)."""
    ratio = ETA * norm(p) / (norm(g) + WD * norm(p) + EPS)
    d = [(gi + WD * pi) * ratio for pi, gi in zip(p, g, strict=True)]
    buf = d if buf is None else [MOMENTUM * bi + di for bi, di in zip(buf, d, strict=True)]
    return [pi - LR * bi for pi, bi in zip(p, buf, strict=True)], buf


def excluded_step(p: list[float], g: list[float], buf: list[float] | None
                  ) -> tuple[list[float], list[float]]:
    """One step of an excluded tensor: SGD with momentum, no weight decay, no trust ratio."""
    buf = list(g) if buf is None else [MOMENTUM * bi + gi for bi, gi in zip(buf, g, strict=True)]
    return [pi - LR * bi for pi, bi in zip(p, buf, strict=True)], buf


def tiny_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]))
        model[0].bias.copy_(torch.tensor([0.1, -0.2]))
        model[1].weight.copy_(torch.tensor([1.0, 0.8]))
        model[1].bias.copy_(torch.tensor([0.05, 0.0]))
    return model


GRADS = [  # per step: weight, linear bias, BN weight, BN bias
    ([[0.02, -0.01, 0.03], [0.0, 0.04, -0.02]], [0.3, -0.1], [0.2, 0.05], [-0.4, 0.1]),
    ([[-0.01, 0.02, 0.01], [0.03, -0.02, 0.0]], [0.1, 0.2], [-0.1, 0.3], [0.2, -0.05]),
]


def test_defaults_are_swavs() -> None:
    optimizer = LARS([nn.Parameter(torch.ones(2, 2))], lr=1.0)
    assert optimizer.defaults["momentum"] == 0.9
    assert optimizer.defaults["weight_decay"] == 1e-6
    assert optimizer.defaults["trust_coefficient"] == 0.001
    assert optimizer.defaults["exclude"] is False


def test_groups_exclude_biases_and_batchnorm() -> None:
    model = tiny_model()
    groups = lars_param_groups(model)
    assert [len(group["params"]) for group in groups] == [1, 3]
    assert groups[0]["params"][0] is model[0].weight and "exclude" not in groups[0]
    assert groups[1]["params"] == [model[0].bias, model[1].weight, model[1].bias]
    assert groups[1]["exclude"] is True and groups[1]["weight_decay"] == 0.0


def test_two_steps_match_the_hand_computation() -> None:
    model = tiny_model()
    optimizer = LARS(lars_param_groups(model), lr=LR, momentum=MOMENTUM, weight_decay=WD,
                     trust_coefficient=ETA, eps=EPS)
    params = [model[0].weight, model[0].bias, model[1].weight, model[1].bias]
    expected = [p.detach().flatten().tolist() for p in params]
    buffers: list[list[float] | None] = [None] * 4
    for grads in GRADS:
        for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
            param.grad = torch.tensor(grad, dtype=torch.float64)
            flat = [v for row in grad for v in row] if index == 0 else list(grad)
            step = adapted_step if index == 0 else excluded_step
            expected[index], buffers[index] = step(expected[index], flat, buffers[index])
        optimizer.step()
        for param, values in zip(params, expected, strict=True):
            torch.testing.assert_close(param.detach().flatten(), torch.tensor(values, dtype=torch.float64),
                                       rtol=1e-12, atol=1e-15)
    state = optimizer.state_dict()["state"]
    assert sorted(state) == [0, 1, 2, 3] and all(set(s) == {"momentum_buffer"} for s in state.values())


def test_a_zero_gradient_gets_ratio_one() -> None:
    weight = nn.Parameter(torch.tensor([[3.0, 4.0]], dtype=torch.float64))  # ||w|| = 5
    optimizer = LARS([weight], lr=LR, momentum=0.0, weight_decay=WD)
    weight.grad = torch.zeros_like(weight)
    optimizer.step()
    # ratio 1 (not eta / wd): the update is lr * wd * w.
    expected = torch.tensor([[3.0, 4.0]], dtype=torch.float64) * (1 - LR * WD)
    torch.testing.assert_close(weight.detach(), expected)


def test_rejects_bad_hyperparameters() -> None:
    with pytest.raises(ValueError, match="momentum"):
        LARS([nn.Parameter(torch.ones(2))], lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="trust"):
        LARS([nn.Parameter(torch.ones(2))], lr=0.1, trust_coefficient=0.0)
