"""The example third-party plugin (tests/example_plugin, installed by `make`): listed and trainable."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import orjson
import pytest


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    try:
        importlib.metadata.distribution("dedloc-example-workload")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("install the example plugin first: pip install ./tests/example_plugin")


def test_listed_by_list_workloads() -> None:
    done = subprocess.run([sys.executable, "-m", "dedloc.plugins.worker", "--list-workloads"],
                          capture_output=True, timeout=60, check=True)
    listing = orjson.loads(done.stdout)
    by_name = {workload["name"]: workload for workload in listing["workloads"]}
    assert listing["errors"] == []
    assert by_name["tiny"]["plugin"] == "tiny (dedloc)"
    example = by_name["example-linear"]
    assert example["plugin"] == "example-linear (dedloc-example-workload)"
    assert example["config_schema"]["additionalProperties"] is False
    assert example["config_schema"]["properties"]["lr"] == {
        "type": "number", "default": 0.1, "description": "SGD learning rate.", "minimum": 0.0,
        "maximum": 10.0}


async def test_trains(launch: Callable[..., Any], buffers: Any) -> None:
    worker = launch()
    client = await worker.connect()
    try:
        described = await client.call("worker.load", {"workload": "example-linear", "seed": 1})
        numel = described["total_numel"]
        assert numel == 9  # 8 weights and a bias
        name, _ = buffers.make(numel)
        start = (await client.call("worker.evaluate", {"samples": 128}))["loss"]
        for _ in range(20):
            await client.call("worker.train", {"samples": 32})
            await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
            await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel})
        end = await client.call("worker.evaluate", {"samples": 128})
        assert end["loss"] < start / 10
        assert end["metrics"]["mean_absolute_error"] < 0.5
    finally:
        await client.close()
    assert await worker.wait() == 0, worker.log()
