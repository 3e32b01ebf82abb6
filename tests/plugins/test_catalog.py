"""Loading workload plugins: entry points, pluggy validation, errors that name the plugin."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest

from dedloc.plugins import (
    ENTRY_POINT_GROUP,
    UnknownWorkloadError,
    Workload,
    WorkloadCatalog,
    hookimpl,
)
from dedloc.plugins.tiny import TINY


def installed_entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def plugin_of(*workloads: object) -> object:
    class Plugin:
        @hookimpl
        def dedloc_workloads(self) -> list[object]:
            return list(workloads)

    return Plugin()


def test_the_built_in_tiny_is_found() -> None:
    catalog = WorkloadCatalog.load()
    entry = catalog.get("tiny")
    assert entry.workload is TINY and entry.plugin == "tiny (dedloc)"
    described = {item["name"]: item for item in catalog.describe()["workloads"]}["tiny"]
    assert described["version"] == "1" and described["plugin"] == "tiny (dedloc)"
    assert described["config_schema"]["properties"]["lr"]["type"] == "number"


def test_a_plugin_that_fails_to_import_hides_nothing() -> None:
    broken = importlib.metadata.EntryPoint("broken", "dedloc_no_such_module_for_tests",
                                           ENTRY_POINT_GROUP)
    catalog = WorkloadCatalog.load([broken, *installed_entry_points()])
    assert "tiny" in catalog.names
    [error] = catalog.errors
    assert error["plugin"] == "broken (unknown distribution)"
    assert "ModuleNotFoundError" in error["error"]
    assert catalog.describe()["errors"] == [error]


def test_invalid_workloads_are_reported_with_their_plugin() -> None:
    class Raises:
        @hookimpl
        def dedloc_workloads(self) -> list[Workload]:
            raise RuntimeError("no GPU here")

    class WrongSignature:
        @hookimpl
        def dedloc_workloads(self, unexpected: int) -> list[Workload]:
            return []

    class NotAList:
        @hookimpl
        def dedloc_workloads(self) -> object:
            return TINY

    catalog = WorkloadCatalog.from_plugins({
        "good (g)": plugin_of(dataclasses.replace(TINY, name="good")),
        "raises (r)": Raises(),
        "signature (s)": WrongSignature(),
        "no-hook (n)": object(),
        "not-a-list (l)": NotAList(),
        "wrong-item (w)": plugin_of("tiny"),
        "old-api (o)": plugin_of(dataclasses.replace(TINY, name="old", api_version=0)),
        "dup (d)": plugin_of(dataclasses.replace(TINY, name="good")),
        "mixed (m)": plugin_of(dataclasses.replace(TINY, name="Bad Name"),
                               dataclasses.replace(TINY, name="fine")),
    })
    assert catalog.names == ["fine", "good"]
    errors = {error["plugin"]: error["error"] for error in catalog.errors}
    assert "RuntimeError: no GPU here" in errors["raises (r)"]
    assert "unexpected" in errors["signature (s)"]
    assert "no @hookimpl" in errors["no-hook (n)"]
    assert "must return a list" in errors["not-a-list (l)"]
    assert "is a str, not a Workload" in errors["wrong-item (w)"]
    assert "api_version 0" in errors["old-api (o)"]
    assert "already taken by plugin good (g)" in errors["dup (d)"]
    assert "'Bad Name'" in errors["mixed (m)"]


def test_unknown_workload_lists_the_installed_ones() -> None:
    catalog = WorkloadCatalog.from_plugins({"tiny (dedloc)": plugin_of(TINY)})
    with pytest.raises(UnknownWorkloadError) as caught:
        catalog.get("huge")
    assert caught.value.data == {"workload": "huge", "installed": ["tiny"]}
