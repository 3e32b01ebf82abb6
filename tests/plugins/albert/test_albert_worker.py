"""The `albert` workload in the worker: the worker's own Session in this process, then a real
`dedloc-worker` process (only once the `albert` entry point is installed)."""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dedloc.plugins.albert as albert_plugin
from dedloc.plugins import WorkloadCatalog
from dedloc.plugins.worker.session import Session

TINY = {"preset": "albert-tiny", "batch_size": 8, "max_seq_length": 32}


def test_session_trains_steps_and_moves_state(albert_cache: Path, buffers: Any) -> None:
    catalog = WorkloadCatalog.from_plugins({"albert (test)": albert_plugin})
    entry = catalog.get("albert")
    config = entry.workload.resolve_config({**TINY, "cache_dir": str(albert_cache)})
    session = Session(entry, config, seed=1, init_seed=7, device=torch.device("cpu"))
    peer = Session(entry, config, seed=2, init_seed=7, device=torch.device("cpu"))
    numel = session.total_numel
    assert numel == peer.total_numel
    # The vocabulary is the task's: the same tokenizer, the same fingerprint; another, another.
    assert session.task_fingerprint is not None and session.task_fingerprint.startswith("vocab-")
    assert peer.describe()["task_fingerprint"] == session.task_fingerprint
    smaller = entry.workload.resolve_config({**TINY, "cache_dir": str(albert_cache), "vocab_size": 3000})
    assert entry.workload.task_fingerprint(smaller) != session.task_fingerprint
    trained = session.train(32, None, threading.Event())
    assert trained["samples"] == 32 and trained["samples_per_second"] > 0
    name, _ = buffers.make(numel)
    session.export("gradients", name, numel)
    applied = session.apply("gradients", name, numel, {"step": 3})  # the run's global step 3
    assert applied["step"] == 4
    assert applied["lr"] == pytest.approx(0.03 * 4 / 10)  # tiny: warm-up over 10 steps
    # The full state (LAMB's moments and step, the LambdaLR position) moves to another peer.
    capacity = 3 * numel + 1024
    state, array = buffers.make(capacity)
    exported = session.export("state", state, capacity)
    assert {item["key"] for item in exported["meta"]["layout"]["optimizer"]} == {"exp_avg", "exp_avg_sq"}
    peer.apply("state", state, exported["numel"], exported["meta"])
    params, theirs = buffers.make(numel)
    peer.export("parameters", params, numel)
    assert np.array_equal(theirs, array[:numel])
    evaluated = peer.evaluate(16)
    assert set(evaluated["metrics"]) == {"mlm_accuracy", "sop_accuracy", "mlm_loss", "sop_loss"}
    assert np.isfinite(evaluated["loss"])


def _registered() -> bool:
    return any(point.name == "albert"
               for point in importlib.metadata.entry_points(group="dedloc.workloads"))


async def test_real_worker_trains_albert_tiny(launch: Callable[..., Any], buffers: Any,
                                              albert_cache: Path) -> None:
    assert _registered(), "the `albert` entry point is missing from pyproject.toml (or not reinstalled)"
    worker = launch()
    client = await worker.connect()
    try:
        described = await client.call("worker.load", {
            "workload": "albert", "seed": 1, "init_seed": 3, "device": "cpu",
            "config": {**TINY, "cache_dir": str(albert_cache)}})
        numel = described["total_numel"]
        assert described["config"]["preset"] == "albert-tiny"
        name, _ = buffers.make(numel)
        for _ in range(3):
            await client.call("worker.train", {"samples": 16})
            await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
            await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel})
        evaluated = await client.call("worker.evaluate", {"samples": 16})
        assert 0.0 <= evaluated["metrics"]["sop_accuracy"] <= 1.0
        assert 0.0 <= evaluated["metrics"]["mlm_accuracy"] <= 1.0
        assert (await client.call("worker.describe"))["step"] == 3
        await client.call("worker.stop")
    finally:
        await client.close()
    assert await worker.wait() == 0, worker.log()


def test_albert_trains_in_a_local_update_run_without_a_change(albert_cache: Path,
                                                              buffers: Any) -> None:
    from local_session import check_one_outer_step

    entry = WorkloadCatalog.from_plugins({"albert (test)": albert_plugin}).get("albert")
    config = entry.workload.resolve_config({**TINY, "cache_dir": str(albert_cache)})
    check_one_outer_step(entry, config, 8, buffers)
