"""The built-in `swav` workload: SwAV self-supervised pretraining of a ResNet on ImageNet-style images.

Importing this module does not import torchvision (the model and data import it when built).
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..spec import Workload
from .workload import SWAV

__all__ = ["SWAV", "dedloc_workloads"]


@hookimpl
def dedloc_workloads() -> list[Workload]:
    """The workloads of the built-in `swav` plugin."""
    return [SWAV]
