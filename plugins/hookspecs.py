"""The pluggy hooks of dedloc's workload plugins (project name "dedloc").

A plugin is any module or object with a `@hookimpl`-marked `dedloc_workloads` function, found
through the `dedloc.workloads` entry point group (see docs/writing-a-workload.md).
"""

from __future__ import annotations

import pluggy

from .spec import Workload

PROJECT_NAME = "dedloc"
ENTRY_POINT_GROUP = "dedloc.workloads"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def dedloc_workloads() -> list[Workload]:  # type: ignore[empty-body]
    """Return the workloads this plugin offers (a list of `dedloc.plugins.Workload`).

    Called once when the worker builds its catalog. Each workload must have a unique name, an
    `api_version` this dedloc supports (`WORKLOAD_API_VERSION`) and a valid config schema;
    invalid ones are reported with the plugin's name and left out, the others stay available.
    Keep this cheap: build nothing heavy here (models and data are built by the workload's
    functions when a run starts).
    """
