"""The built-in `tiny` workload: an MLP classifying points of a Gaussian mixture made at run time.

Small enough to train on a CPU in milliseconds per step; used by the tests and to try a setup.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..spec import Workload
from .workload import TINY

__all__ = ["TINY", "dedloc_workloads"]


@hookimpl
def dedloc_workloads() -> list[Workload]:
    """The workloads of the built-in `tiny` plugin."""
    return [TINY]
