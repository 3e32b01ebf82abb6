"""SwAV in the worker: a Session in this process, and a real `dedloc-worker` once `swav` is registered."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import dedloc.plugins.swav as swav_plugin
from dedloc.plugins import WorkloadCatalog
from dedloc.plugins.catalog import CatalogEntry
from dedloc.plugins.swav import SWAV, dedloc_workloads
from dedloc.plugins.swav.model import SwAV
from dedloc.plugins.swav.workload import lr_factor
from dedloc.plugins.worker.session import Session

METRICS = {"code_entropy", "prototype_usage", "prediction_entropy", "swap_agreement"}


def test_the_plugin_offers_a_valid_workload() -> None:
    assert dedloc_workloads() == [SWAV]
    assert SWAV.problems() == []
    catalog = WorkloadCatalog.from_plugins({"swav (test)": swav_plugin})
    assert catalog.names == ["swav"] and catalog.errors == []
    schema = SWAV.config_schema()["properties"]
    assert schema["preset"]["enum"] == ["resnet18", "resnet50"] and schema["preset"]["default"] == "resnet50"


def test_a_session_trains_steps_at_the_global_step_and_hands_the_step_to_a_joiner(
        tiny_config: dict[str, Any], buffers: Any) -> None:
    import torch

    entry = CatalogEntry(SWAV, "swav (test)")
    config = {**tiny_config, "warmup_steps": 4, "total_steps": 20, "freeze_prototypes_steps": 6}
    first = Session(entry, config, seed=1, init_seed=3, device=torch.device("cpu"))
    assert isinstance(first.model, SwAV)
    trained = first.train(8, None, threading.Event())
    assert trained["samples"] == 8 and math.isfinite(trained["loss"])
    assert first.model.last["step"] == 0 and first.model.last["frozen"] is True
    numel = first.total_numel
    name, gradients = buffers.make(numel)
    first.export("gradients", name, numel)
    # The prototypes were frozen at step 0: their slot of the gradient is all zeros.
    slot = next(s for s in first.slots if s.name == "prototypes.weight")
    assert not gradients[slot.offset:slot.end].any() and gradients.any()
    stepped = first.apply("gradients", name, numel, {"step": 5})
    assert stepped == {"step": 6, "lr": pytest.approx(config["lr"] * lr_factor(5, config))}
    assert first.model.global_step() == 6
    first.train(8, None, threading.Event())
    assert first.model.last["step"] == 6 and first.model.last["frozen"] is False
    state_numel = first.describe()["state_numel"]
    state_name, _ = buffers.make(state_numel)
    exported = first.export("state", state_name, state_numel)
    joiner = Session(entry, config, seed=2, init_seed=3, device=torch.device("cpu"))
    assert isinstance(joiner.model, SwAV) and joiner.model.global_step() == 0
    assert joiner.apply("state", state_name, exported["numel"], exported["meta"]) == {"step": 6}
    assert joiner.model.global_step() == 6
    evaluated = joiner.evaluate(8)
    assert set(evaluated["metrics"]) == METRICS and math.isfinite(evaluated["loss"])


def registered() -> bool:
    return "swav" in WorkloadCatalog.load().names


async def test_a_worker_process_trains_swav(launch: Callable[..., Any], buffers: Any,
                                            tiny_config: dict[str, Any]) -> None:
    assert registered(), "the `swav` entry point is missing from pyproject.toml (or not reinstalled)"
    worker = launch()
    client = await worker.connect()
    try:
        described = await client.call("worker.load", {"workload": "swav", "config": tiny_config,
                                                      "seed": 1, "init_seed": 3, "device": "cpu"})
        numel = described["total_numel"]
        name, gradients = buffers.make(numel)
        trained = await client.call("worker.train", {"samples": 8})
        assert trained["samples"] == 8 and math.isfinite(trained["loss"])
        await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
        assert np.isfinite(gradients).all() and gradients.any()
        answer = await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel,
                                                    "meta": {"step": 0}})
        assert answer == {"step": 1, "lr": pytest.approx(tiny_config["lr"] * lr_factor(0, tiny_config))}
        evaluated = await client.call("worker.evaluate", {"samples": 8})
        assert set(evaluated["metrics"]) == METRICS
        await client.call("worker.stop")
    finally:
        await client.close()
    assert await worker.wait() == 0, worker.log()


def test_swav_trains_in_a_local_update_run_without_a_change(tiny_config: dict[str, Any],
                                                            buffers: Any) -> None:
    from local_session import check_one_outer_step

    config = SWAV.resolve_config({**tiny_config, "crop_sizes": "32,16", "synthetic_size": 40,
                                  "batch_size": 4, "total_steps": 20})
    check_one_outer_step(CatalogEntry(SWAV, "swav (test)"), config, 4, buffers)
