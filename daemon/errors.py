"""The daemon's exception hierarchy. Subclasses say whose fault it was; `rpc` maps them to codes."""

from __future__ import annotations

from typing import Any


class DaemonError(Exception):
    """Root of every error the daemon raises on purpose."""

    data: Any = None


class ConfigError(DaemonError):
    """The configuration is wrong; the message names the key and what to do."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config key {key!r}: {reason}")
        self.key = key
        self.reason = reason


class IdentityError(DaemonError):
    """The identity key in the state directory cannot be read or written."""


class ShuttingDownError(DaemonError):
    """The daemon is stopping and takes no new work."""


class RunExistsError(DaemonError):
    """A run of that name is already active (the caller's fault)."""


class UnknownRunError(DaemonError):
    """No run of that name (the caller's fault)."""


class RunNotActiveError(DaemonError):
    """The run is in a state that does not allow this call."""


class WorkerError(DaemonError):
    """A worker process failed: it did not start, died, or answered nonsense.

    `data` holds what the user needs to see: exit code and last log lines.
    """

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.data = data
