"""The built-in `albert` workload: ALBERT pre-training with LAMB, the DeDLOC paper's language task.

Importing this module imports torch and `tokenizers`, not transformers (that is imported when a
model is built), so listing workloads stays cheap.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..spec import Workload
from .workload import ALBERT, PRESETS

__all__ = ["ALBERT", "PRESETS", "dedloc_workloads"]


@hookimpl
def dedloc_workloads() -> list[Workload]:
    """The workloads of the built-in `albert` plugin."""
    return [ALBERT]
