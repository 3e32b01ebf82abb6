"""Shared settings of the SwAV tests: the resnet18 preset at tiny sizes, small enough for a CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dedloc.plugins.swav.workload import SWAV

# 2 crops of 64 px and 2 of 32 px, batches of 8 synthetic 80-pixel images; 64 prototypes in 16
# dimensions (more prototypes than dimensions, as with SwAV's 3000 in 128).
TINY: dict[str, Any] = {
    "preset": "resnet18", "crops": "2,2", "crop_sizes": "64,32", "batch_size": 8,
    "synthetic_size": 80, "prototypes": 64, "feature_dim": 16, "queue_length": 0,
    "freeze_prototypes_steps": 0, "warmup_steps": 0, "total_steps": 40,
}


@pytest.fixture
def tiny_config() -> dict[str, Any]:
    """The full resolved config of the tiny setting."""
    return SWAV.resolve_config(TINY)


@pytest.fixture
def small_crops_config() -> dict[str, Any]:
    """The tiny setting at half its crop sizes (32 and 16 px of 40-pixel images), 20 steps."""
    return SWAV.resolve_config({**TINY, "crop_sizes": "32,16", "synthetic_size": 40,
                                "total_steps": 20})


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
