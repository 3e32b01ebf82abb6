"""The installed workloads: plugins found through entry points, loaded with pluggy, validated.

A plugin that fails to import, fails pluggy's hook validation, raises in its hook or returns an
invalid workload is recorded as an error naming the plugin; it never hides the other plugins.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy
import structlog

from . import hookspecs
from .errors import PluginLoadError, UnknownWorkloadError
from .spec import Workload

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    """A valid workload and the plugin that offers it."""

    workload: Workload
    plugin: str

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.workload.name,
            "description": self.workload.description,
            "version": self.workload.version,
            "plugin": self.plugin,
            "config_schema": self.workload.config_schema(),
        }


class WorkloadCatalog:
    """The valid workloads by name, and the errors of the plugins that failed."""

    def __init__(self) -> None:
        self._manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._manager.add_hookspecs(hookspecs)
        self._entries: dict[str, CatalogEntry] = {}
        self.errors: list[dict[str, str]] = []

    @classmethod
    def load(cls, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
             ) -> WorkloadCatalog:
        """Load every plugin of the `dedloc.workloads` entry point group (or those given)."""
        catalog = cls()
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
        seen: set[tuple[str, str]] = set()
        for entry_point in entry_points:
            if (entry_point.name, entry_point.value) in seen:  # one distribution found twice
                continue
            seen.add((entry_point.name, entry_point.value))
            label = plugin_label(entry_point)
            try:
                plugin = entry_point.load()
            except Exception as exc:  # any import failure is the plugin's fault
                catalog._record(PluginLoadError(label, f"import failed: {type(exc).__name__}: {exc}"))
                continue
            catalog.add_plugin(label, plugin)
        return catalog

    @classmethod
    def from_plugins(cls, plugins: Mapping[str, object]) -> WorkloadCatalog:
        """A catalog of the given plugin objects (label -> module or object), for tests and tools."""
        catalog = cls()
        for label, plugin in plugins.items():
            catalog.add_plugin(label, plugin)
        return catalog

    def add_plugin(self, label: str, plugin: object) -> None:
        """Register one plugin object and take its valid workloads; record its errors."""
        try:
            self._manager.register(plugin, name=label)
        except (pluggy.PluginValidationError, ValueError) as exc:
            self._record(PluginLoadError(label, f"not a valid dedloc plugin: {exc}"))
            return
        impls = [impl for impl in self._manager.hook.dedloc_workloads.get_hookimpls()
                 if impl.plugin_name == label]
        if not impls:
            self._record(PluginLoadError(label, "has no @hookimpl dedloc_workloads function"))
            return
        for impl in impls:
            try:
                offered = impl.function()
            except Exception as exc:  # a failing hook is the plugin's fault
                self._record(PluginLoadError(label, f"dedloc_workloads() raised "
                                                    f"{type(exc).__name__}: {exc}"))
                continue
            self._take(label, offered)

    def _take(self, label: str, offered: object) -> None:
        if not isinstance(offered, Sequence) or isinstance(offered, str | bytes):
            self._record(PluginLoadError(label, f"dedloc_workloads() must return a list of "
                                                f"Workload, not {type(offered).__name__}"))
            return
        for index, workload in enumerate(offered):
            if not isinstance(workload, Workload):
                self._record(PluginLoadError(label, f"item {index} of dedloc_workloads() is a "
                                                    f"{type(workload).__name__}, not a Workload"))
                continue
            problems = workload.problems()
            if problems:
                self._record(PluginLoadError(label, f"workload {workload.name!r}: "
                                                    + "; ".join(problems)))
                continue
            existing = self._entries.get(workload.name)
            if existing is not None:
                self._record(PluginLoadError(label, f"workload name {workload.name!r} is already "
                                                    f"taken by plugin {existing.plugin}"))
                continue
            self._entries[workload.name] = CatalogEntry(workload, label)

    def _record(self, error: PluginLoadError) -> None:
        log.warning("workload_plugin_error", plugin=error.plugin, error=error.reason)
        self.errors.append({"plugin": error.plugin, "error": error.reason})

    @property
    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> CatalogEntry:
        """The workload called `name`; UnknownWorkloadError lists the installed ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownWorkloadError(name, self.names) from None

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        """`{"workloads": [...], "errors": [...]}`: what `dedloc-worker --list-workloads` prints."""
        return {
            "workloads": [self._entries[name].describe() for name in self.names],
            "errors": list(self.errors),
        }


def plugin_label(entry_point: importlib.metadata.EntryPoint) -> str:
    """How errors name a plugin: "<entry point name> (<distribution>)"."""
    dist = getattr(entry_point, "dist", None)
    return f"{entry_point.name} ({dist.name if dist is not None else 'unknown distribution'})"
