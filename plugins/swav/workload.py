"""The `swav` workload: self-supervised ResNet pretraining with SwAV on ImageNet-style images.

Model and loss: plugins/swav/model.py. Data: plugins/swav/data.py (an ImageFolder tree from
`data_dir`, or synthetic shapes generated at run time). Optimizer: LARS (plugins/optim/lars.py;
biases and BatchNorm excluded from adaptation and weight decay) with a linear warm-up then a cosine
decay, as a LambdaLR of the step, so the worker positions it at the run's global step.

The defaults follow SwAV's 200-epoch ImageNet recipe for a global batch of 4096 (313 steps an
epoch): 2x224 + 6x96 crops, 3000 prototypes, lr 4.8 down to 0.0048 after a 10-epoch warm-up from
0.3. Codes are computed on each peer's own batch, which is small next to 3000 prototypes, so the
queue (3840 embeddings) is on from step `queue_start_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ..optim.lars import LARS, lars_param_groups
from ..spec import ConfigField, Split, Workload
from .data import MultiCrop, multicrop_batches
from .model import PRESETS, SwAV, assignment_stats

_BIG = (1 << 31) - 1

CONFIG = {
    # model
    "preset": ConfigField(str, "resnet50", "Trunk: a torchvision ResNet without its classifier.",
                          choices=tuple(PRESETS)),
    "hidden_dim": ConfigField(int, 0, "Hidden width of the projection head (0: the trunk's width, "
                                      "2048 for resnet50, 512 for resnet18).", minimum=0, maximum=65536),
    "feature_dim": ConfigField(int, 128, "Dimension of the L2-normalised embeddings.",
                               minimum=1, maximum=65536),
    "prototypes": ConfigField(int, 3000, "Number of prototypes.", minimum=1, maximum=1 << 20),
    "temperature": ConfigField(float, 0.1, "Softmax temperature of the swapped prediction.",
                               minimum=1e-4, maximum=10.0),
    "epsilon": ConfigField(float, 0.05, "Entropic regularisation of Sinkhorn-Knopp.",
                           minimum=1e-3, maximum=10.0),
    "sinkhorn_iterations": ConfigField(int, 3, "Sinkhorn-Knopp iterations (row then column "
                                               "normalisation each).", minimum=1, maximum=1000),
    "assign_crops": ConfigField(int, 2, "The first N crops get codes (SwAV's crops_for_assign: the "
                                        "large crops).", minimum=1, maximum=64),
    "queue_length": ConfigField(int, 3840, "Embeddings of earlier batches per assignment crop added to "
                                           "Sinkhorn-Knopp's batch (0: no queue).",
                                minimum=0, maximum=1 << 20),
    "queue_start_step": ConfigField(int, 4695, "Global step from which the queue is filled and used.",
                                    minimum=0, maximum=_BIG),
    "freeze_prototypes_steps": ConfigField(int, 313, "The prototypes get no gradient before this "
                                                     "global step.", minimum=0, maximum=_BIG),
    "mixed_precision": ConfigField(bool, True, "bfloat16 autocast for trunk and head on CUDA "
                                               "(Sinkhorn-Knopp and the loss stay float32); CPU "
                                               "always runs float32."),
    # optimizer and schedule
    "lr": ConfigField(float, 4.8, "Peak learning rate (after the warm-up).", minimum=0.0, maximum=100.0),
    "warmup_start_lr": ConfigField(float, 0.3, "Learning rate at step 0, rising linearly to lr.",
                                   minimum=0.0, maximum=100.0),
    "min_lr": ConfigField(float, 0.0048, "Learning rate at the end of the cosine decay.",
                          minimum=0.0, maximum=100.0),
    "warmup_steps": ConfigField(int, 3130, "Linear warm-up steps.", minimum=0, maximum=_BIG),
    "total_steps": ConfigField(int, 62600, "Steps of the whole schedule (warm-up included); min_lr "
                                           "after it.", minimum=1, maximum=_BIG),
    "momentum": ConfigField(float, 0.9, "LARS momentum.", minimum=0.0, maximum=0.999),
    "weight_decay": ConfigField(float, 1e-6, "Weight decay (not on biases and BatchNorm).",
                                minimum=0.0, maximum=1.0),
    "trust_coefficient": ConfigField(float, 0.001, "LARS trust coefficient.", minimum=1e-6, maximum=1.0),
    # data
    "batch_size": ConfigField(int, 64, "Images per batch (each seen as all the crops).",
                              minimum=2, maximum=1 << 16),
    "crops": ConfigField(str, "2,6", "Crops per image in each group, comma-separated (large first)."),
    "crop_sizes": ConfigField(str, "224,96", "Side in pixels of each group's crops."),
    "crop_min_scales": ConfigField(str, "0.14,0.05", "Smallest area of each group's crops (fraction "
                                                     "of the image)."),
    "crop_max_scales": ConfigField(str, "1.0,0.14", "Largest area of each group's crops."),
    "color_jitter": ConfigField(float, 1.0, "Colour distortion strength s (jitter 0.8s, 0.8s, 0.8s, "
                                            "0.2s, applied with probability 0.8).", minimum=0.0, maximum=4.0),
    "blur_prob": ConfigField(float, 0.5, "Probability of a Gaussian blur (sigma 0.1 to 2).",
                             minimum=0.0, maximum=1.0),
    "solarize_prob": ConfigField(float, 0.0, "Probability of solarisation.", minimum=0.0, maximum=1.0),
    "data_dir": ConfigField(str, "", "ImageFolder tree (root/<class>/<image>; labels ignored; train/ "
                                     "and val/ used when present). Empty: synthetic images."),
    "data_workers": ConfigField(int, 0, "DataLoader processes decoding and augmenting (0: in the "
                                        "worker; use about 8 for ImageNet on a GPU).",
                                minimum=0, maximum=256),
    "synthetic_images": ConfigField(int, 10000, "Images in the synthetic set (each split).",
                                    minimum=1, maximum=1 << 30),
    "synthetic_size": ConfigField(int, 256, "Side in pixels of the synthetic images.",
                                  minimum=16, maximum=2048),
    "data_seed": ConfigField(int, 0, "Seed of the synthetic task (palette and images); the same on "
                                     "every peer.", minimum=0, maximum=(1 << 63) - 1),
}


def build_model(config: dict[str, Any], device: torch.device) -> nn.Module:
    MultiCrop.from_config(config)  # a bad crop config fails at load, not at the first batch
    model = SwAV(
        config["preset"], hidden_dim=config["hidden_dim"], feature_dim=config["feature_dim"],
        prototypes=config["prototypes"], temperature=config["temperature"],
        epsilon=config["epsilon"], sinkhorn_iterations=config["sinkhorn_iterations"],
        assign_crops=config["assign_crops"], queue_length=config["queue_length"],
        queue_start_step=config["queue_start_step"],
        freeze_prototypes_steps=config["freeze_prototypes_steps"],
        mixed_precision=config["mixed_precision"])
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def lr_factor(step: int, config: dict[str, Any]) -> float:
    """The learning rate of global step `step` over `lr`: linear warm-up, then cosine decay."""
    peak = config["lr"]
    if peak <= 0:
        return 0.0
    warmup, total = config["warmup_steps"], config["total_steps"]
    if step < warmup:
        start = config["warmup_start_lr"] / peak
        return start + (1.0 - start) * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    final = config["min_lr"] / peak
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, config: dict[str, Any]) -> tuple[LARS, LambdaLR]:
    if not isinstance(model, SwAV):
        raise TypeError(f"the swav workload trains a SwAV model, not a {type(model).__name__}")
    optimizer = LARS(lars_param_groups(model), lr=config["lr"], momentum=config["momentum"],
                     weight_decay=config["weight_decay"], trust_coefficient=config["trust_coefficient"])
    schedule = {key: config[key] for key in ("lr", "warmup_start_lr", "min_lr", "warmup_steps",
                                             "total_steps")}
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, schedule))
    # The scheduler counts the run's global steps (the worker positions it before each step and
    # it travels with the state to peers that join), so the model reads its step from there.
    model.step_source = lambda: scheduler.last_epoch
    return optimizer, scheduler


def build_data(config: dict[str, Any], seed: int, split: Split) -> Iterator[list[torch.Tensor]]:
    return multicrop_batches(config, seed, split)


def _to_device(batch: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == "cuda":
        return [crop.to(device, non_blocking=True, memory_format=torch.channels_last) for crop in batch]
    return [crop.to(device) for crop in batch]


def loss(model: nn.Module, batch: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    assert isinstance(model, SwAV)
    return model.swav_loss(_to_device(batch, device)), int(batch[0].shape[0])


def metrics(model: nn.Module, batch: list[torch.Tensor], device: torch.device) -> dict[str, float]:
    assert isinstance(model, SwAV)
    model.swav_loss(_to_device(batch, device))
    return assignment_stats(model)


SWAV = Workload(
    name="swav",
    description="SwAV self-supervised pretraining of a ResNet (resnet50; resnet18 for tests) with "
                "multi-crop augmentations, Sinkhorn-Knopp codes and LARS, on an ImageFolder tree or "
                "synthetic shapes generated at run time.",
    version="1",
    config=CONFIG,
    build_model=build_model,
    build_optimizer=build_optimizer,
    build_data=build_data,
    loss=loss,
    metrics=metrics,
)
