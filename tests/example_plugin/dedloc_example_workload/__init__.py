"""An example dedloc workload plugin: `example-linear`, linear regression on generated data.

The task is y = x·w* + b* + noise with w*, b* fixed by `data_seed` (the same on every peer); each
peer samples its own points from its `seed`. It shows everything a plugin needs: a config schema,
the four functions, optional metrics, and the `dedloc_workloads` hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dedloc.plugins import ConfigField, Workload, hookimpl

CONFIG = {
    "features": ConfigField(int, 8, "Number of input features.", minimum=1, maximum=10_000),
    "noise": ConfigField(float, 0.1, "Standard deviation of the label noise.", minimum=0.0),
    "batch_size": ConfigField(int, 32, "Samples per batch.", minimum=1, maximum=1 << 20),
    "lr": ConfigField(float, 0.1, "SGD learning rate.", minimum=0.0, maximum=10.0),
    "data_seed": ConfigField(int, 0, "Seed of the true weights (same on every peer).", minimum=0),
}


def _truth(config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config["data_seed"])
    weights = torch.randn(config["features"], generator=generator)
    bias = torch.randn((), generator=generator)
    return weights, bias


def build_model(config: dict[str, Any], device: torch.device) -> nn.Module:
    return nn.Linear(config["features"], 1).to(device)


def build_optimizer(model: nn.Module, config: dict[str, Any]) -> tuple[torch.optim.Optimizer, None]:
    return torch.optim.SGD(model.parameters(), lr=config["lr"]), None


def build_data(config: dict[str, Any], seed: int, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    weights, bias = _truth(config)
    generator = torch.Generator().manual_seed(seed * 2 + (split == "eval"))
    while True:
        x = torch.randn(config["batch_size"], config["features"], generator=generator)
        noise = config["noise"] * torch.randn(config["batch_size"], generator=generator)
        yield x, x @ weights + bias + noise


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
         ) -> tuple[torch.Tensor, int]:
    x, y = batch
    prediction = model(x.to(device)).squeeze(-1)
    return nn.functional.mse_loss(prediction, y.to(device)), len(y)


def metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
            ) -> dict[str, float]:
    x, y = batch
    error = model(x.to(device)).squeeze(-1) - y.to(device)
    return {"mean_absolute_error": error.abs().mean().item()}


EXAMPLE_LINEAR = Workload(
    name="example-linear",
    description="Linear regression on points generated at run time (an example plugin).",
    version="0.1.0",
    config=CONFIG,
    build_model=build_model,
    build_optimizer=build_optimizer,
    build_data=build_data,
    loss=loss,
    metrics=metrics,
)


@hookimpl
def dedloc_workloads() -> list[Workload]:
    """The workloads of this plugin."""
    return [EXAMPLE_LINEAR]
