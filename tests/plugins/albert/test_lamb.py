"""LAMB (plugins/optim/lamb.py) against the published update computed by hand, step by step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dedloc.plugins.optim import Lamb, weight_decay_groups
from dedloc.plugins.worker.layout import optimizer_state, rebuild_optimizer_state

LR, BETA1, BETA2, EPS, DECAY = 0.1, 0.9, 0.999, 1e-6, 0.01


def norm(values: list[float]) -> float:
    return math.sqrt(sum(x * x for x in values))


def lamb_by_hand(weights: list[float], grads: list[list[float]], decay: float) -> list[float]:
    """Algorithm 2 of You et al. for one parameter, written out element by element."""
    w = list(weights)
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        m = [BETA1 * mi + (1 - BETA1) * gi for mi, gi in zip(m, g, strict=True)]
        v = [BETA2 * vi + (1 - BETA2) * gi * gi for vi, gi in zip(v, g, strict=True)]
        m_hat = [mi / (1 - BETA1 ** t) for mi in m]
        v_hat = [vi / (1 - BETA2 ** t) for vi in v]
        update = [mh / (math.sqrt(vh) + EPS) + decay * wi for mh, vh, wi in zip(m_hat, v_hat, w, strict=True)]
        w_norm, u_norm = norm(w), norm(update)
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w = [wi - LR * ratio * ui for wi, ui in zip(w, update, strict=True)]
    return w


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.norm = nn.LayerNorm(2)


WEIGHT = [[1.0, -2.0], [0.5, 3.0]]
BIAS = [0.0, 0.0]  # zero norm: trust ratio 1
GAIN = [1.0, 1.0]
GRADS = {  # two steps of gradients per parameter
    "linear.weight": [[0.3, -0.1, 0.2, 0.05], [-0.2, 0.4, 0.1, -0.3]],
    "linear.bias": [[0.1, -0.2], [0.3, 0.0]],
    "norm.weight": [[0.05, 0.5], [-0.1, 0.2]],
    "norm.bias": [[0.0, 0.0], [0.0, 0.0]],  # no gradient signal: the update is 0
}


def test_two_steps_match_the_hand_computed_update() -> None:
    model = Tiny()
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor(WEIGHT))
        model.linear.bias.copy_(torch.tensor(BIAS))
        model.norm.weight.copy_(torch.tensor(GAIN))
        model.norm.bias.zero_()
    groups = weight_decay_groups(model, DECAY)
    assert [len(group["params"]) for group in groups] == [1, 3]  # only the matrix decays
    assert groups[0]["params"][0] is model.linear.weight
    optimizer = Lamb(groups, lr=LR, betas=(BETA1, BETA2), eps=EPS)
    params = dict(model.named_parameters())
    for step in range(2):
        for name, param in params.items():
            param.grad = torch.tensor(GRADS[name][step]).reshape(param.shape)
        optimizer.step()
    expected = {
        "linear.weight": lamb_by_hand([x for row in WEIGHT for x in row], GRADS["linear.weight"], DECAY),
        "linear.bias": lamb_by_hand(BIAS, GRADS["linear.bias"], 0.0),
        "norm.weight": lamb_by_hand(GAIN, GRADS["norm.weight"], 0.0),
        "norm.bias": [0.0, 0.0],
    }
    for name, param in params.items():
        assert param.detach().reshape(-1).tolist() == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    # The first step of the decayed matrix, spelled out: m̂/(√v̂+ε) = sign(g) on step 1.
    w = [x for row in WEIGHT for x in row]
    u = [math.copysign(1.0, g) * (1 / (1 + EPS / abs(g))) + DECAY * wi
         for g, wi in zip(GRADS["linear.weight"][0], w, strict=True)]
    first = [wi - LR * norm(w) / norm(u) * ui for wi, ui in zip(w, u, strict=True)]
    assert lamb_by_hand(w, GRADS["linear.weight"][:1], DECAY) == pytest.approx(first, rel=1e-9)
    assert float(optimizer.state[model.linear.weight]["step"]) == 2.0


def test_without_adaptation_or_bias_correction() -> None:
    param = nn.Parameter(torch.tensor([2.0, -1.0]))
    optimizer = Lamb([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, adapt=False, bias_correction=False)
    param.grad = torch.tensor([0.5, 0.5])
    optimizer.step()
    m, v = 0.1 * 0.5, 0.001 * 0.25
    step = m / (math.sqrt(v) + EPS)
    assert param.detach().tolist() == pytest.approx([2.0 - LR * step, -1.0 - LR * step], rel=1e-6)


def test_gradient_clipping_by_global_norm() -> None:
    first = nn.Parameter(torch.tensor([1.0, 1.0]))
    second = nn.Parameter(torch.tensor([1.0]))
    clipped = Lamb([first, second], lr=LR, max_grad_norm=1.0)
    reference = [nn.Parameter(torch.tensor([1.0, 1.0])), nn.Parameter(torch.tensor([1.0]))]
    plain = Lamb(reference, lr=LR)
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]  # global norm 5
    for params in ([first, second], reference):
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
    clipped.step()
    plain.step()
    # Adam's first step is scale-free, so compare the moments instead: clipped = plain / 5.
    assert torch.allclose(clipped.state[first]["exp_avg"], plain.state[reference[0]]["exp_avg"] / 5)
    assert torch.allclose(clipped.state[second]["exp_avg_sq"], plain.state[reference[1]]["exp_avg_sq"] / 25)


def test_state_travels_through_the_worker_layout() -> None:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = Lamb(weight_decay_groups(model, DECAY), lr=LR)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    keys, tensors, scalars = optimizer_state(optimizer)
    assert {key for _, key in keys} == {"exp_avg", "exp_avg_sq"}
    assert scalars["0"]["step"] == {"value": 1.0, "dtype": "float32"}
    copy = Lamb(weight_decay_groups(Tiny(), DECAY), lr=LR)
    copy.load_state_dict(rebuild_optimizer_state(keys, [t.clone() for t in tensors], scalars,
                                                 optimizer.state_dict()["param_groups"]))
    assert float(copy.state_dict()["state"][0]["step"]) == 1.0


def test_rejects_bad_hyper_parameters() -> None:
    param = nn.Parameter(torch.zeros(1))
    for kwargs in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": -1.0}, {"weight_decay": -0.1},
                   {"max_grad_norm": 0.0}):
        with pytest.raises(ValueError):
            Lamb([param], **kwargs)
