"""The `tiny` workload: classify points drawn from a Gaussian mixture with an MLP.

The mixture (one centre per class) is fixed by `data_seed`, so every peer of a run learns the same
task; the run's per-peer `seed` picks which points each peer samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import ConfigField, Split, Workload

CONFIG = {
    "input_dim": ConfigField(int, 16, "Dimension of the input points.", minimum=1, maximum=4096),
    "classes": ConfigField(int, 4, "Number of classes (mixture components).", minimum=2, maximum=1000),
    "hidden": ConfigField(int, 64, "Width of the hidden layers.", minimum=1, maximum=65536),
    "layers": ConfigField(int, 1, "Number of hidden layers.", minimum=1, maximum=16),
    "separation": ConfigField(float, 1.0, "Distance scale between class centres (noise is 1).",
                              minimum=0.0, maximum=100.0),
    "batch_size": ConfigField(int, 64, "Points per batch.", minimum=1, maximum=1 << 20),
    "optimizer": ConfigField(str, "adam", "Optimizer.", choices=("adam", "sgd")),
    "lr": ConfigField(float, 0.01, "Learning rate.", minimum=0.0, maximum=10.0),
    "momentum": ConfigField(float, 0.9, "SGD momentum (sgd only).", minimum=0.0, maximum=1.0),
    "weight_decay": ConfigField(float, 0.0, "Weight decay.", minimum=0.0, maximum=1.0),
    "warmup_steps": ConfigField(int, 0, "Linear learning-rate warm-up over this many steps (0: none).",
                                minimum=0, maximum=1 << 30),
    "data_seed": ConfigField(int, 0, "Seed of the task itself (the class centres); the same on "
                                     "every peer.", minimum=0, maximum=(1 << 63) - 1),
}

_SPLITS = {"train": 1, "eval": 2}


def build_model(config: dict[str, Any], device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    width = config["input_dim"]
    for _ in range(config["layers"]):
        layers += [nn.Linear(width, config["hidden"]), nn.ReLU()]
        width = config["hidden"]
    layers.append(nn.Linear(width, config["classes"]))
    return nn.Sequential(*layers).to(device)


def build_optimizer(model: nn.Module, config: dict[str, Any]
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    optimizer: torch.optim.Optimizer
    if config["optimizer"] == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"],
                                     weight_decay=config["weight_decay"])
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"],
                                    weight_decay=config["weight_decay"])
    warmup = config["warmup_steps"]
    if warmup == 0:
        return optimizer, None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return optimizer, scheduler


def class_centres(config: dict[str, Any]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(config["data_seed"])
    centres = torch.randn(config["classes"], config["input_dim"], generator=generator)
    return centres * config["separation"]


def build_data(config: dict[str, Any], seed: int, split: Split
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    centres = class_centres(config)
    generator = torch.Generator().manual_seed((seed * 4 + _SPLITS[split]) % (1 << 63))
    batch_size = config["batch_size"]
    while True:
        labels = torch.randint(config["classes"], (batch_size,), generator=generator)
        noise = torch.randn(batch_size, config["input_dim"], generator=generator)
        yield centres[labels] + noise, labels


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
         ) -> tuple[torch.Tensor, int]:
    points, labels = batch
    logits = model(points.to(device))
    return F.cross_entropy(logits, labels.to(device)), len(labels)


def metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device
            ) -> dict[str, float]:
    points, labels = batch
    predicted = model(points.to(device)).argmax(dim=1)
    return {"accuracy": (predicted == labels.to(device)).float().mean().item()}


TINY = Workload(
    name="tiny",
    description="An MLP classifying points of a Gaussian mixture generated at run time "
                "(CPU-friendly; for tests and trying a setup).",
    version="1",
    config=CONFIG,
    build_model=build_model,
    build_optimizer=build_optimizer,
    build_data=build_data,
    loss=loss,
    metrics=metrics,
)
