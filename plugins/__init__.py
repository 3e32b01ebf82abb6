"""dedloc's plugin layer: what workload authors use, and the worker process that runs workloads.

A workload plugin is a module with a `@hookimpl` function `dedloc_workloads()` returning
`Workload`s, registered under the `dedloc.workloads` entry point group
(docs/writing-a-workload.md). Importing this package does not import torch.
"""

from .catalog import CatalogEntry, WorkloadCatalog
from .errors import (
    CheckpointError,
    PluginError,
    PluginLoadError,
    SharedBufferError,
    UnknownWorkloadError,
    WorkerStateError,
    WorkloadConfigError,
    WorkloadError,
)
from .hookspecs import ENTRY_POINT_GROUP, hookimpl, hookspec
from .spec import SUPPORTED_API_VERSIONS, WORKLOAD_API_VERSION, ConfigField, Workload

__all__ = [
    "ENTRY_POINT_GROUP",
    "SUPPORTED_API_VERSIONS",
    "WORKLOAD_API_VERSION",
    "CatalogEntry",
    "CheckpointError",
    "ConfigField",
    "PluginError",
    "PluginLoadError",
    "SharedBufferError",
    "UnknownWorkloadError",
    "WorkerStateError",
    "Workload",
    "WorkloadCatalog",
    "WorkloadConfigError",
    "WorkloadError",
    "hookimpl",
    "hookspec",
]
