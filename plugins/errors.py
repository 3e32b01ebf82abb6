"""The errors of the plugins layer: one root, subclasses that say whose fault it was.

Each error carries `data`, a JSON value that the worker's JSON-RPC service sends as the error's
`data` member; the mapping to error codes lives in `dedloc.plugins.worker.service`.
"""

from __future__ import annotations

from typing import Any


class PluginError(Exception):
    """Root of every error of `dedloc.plugins`."""

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class PluginLoadError(PluginError):
    """A workload plugin failed to import, or returned something that is not a valid workload.

    The plugin's fault; `plugin` names it as "<entry point> (<distribution>)".
    """

    def __init__(self, plugin: str, reason: str) -> None:
        super().__init__(f"workload plugin {plugin}: {reason}", {"plugin": plugin, "error": reason})
        self.plugin = plugin
        self.reason = reason


class WorkloadConfigError(PluginError, ValueError):
    """A workload config has an unknown key or a wrong value (the caller's fault)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"workload config key {key!r}: {reason}", {"key": key, "reason": reason})
        self.key = key
        self.reason = reason


class UnknownWorkloadError(PluginError, LookupError):
    """No installed workload has that name (the caller's fault)."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"no workload named {name!r}; installed: {', '.join(known) or 'none'}",
                         {"workload": name, "installed": known})
        self.name = name


class SharedBufferError(PluginError):
    """A shared-memory buffer is missing, too small, of the wrong layout or holds NaN/Inf."""


class CheckpointError(PluginError):
    """A checkpoint could not be written, read, or does not belong to the loaded workload."""


class WorkloadError(PluginError):
    """The workload's own code failed (raised, or produced a NaN/Inf loss)."""


class WorkerStateError(PluginError):
    """The call does not fit the worker's state: nothing loaded yet, or another call is running."""
