"""The two workloads of the DeDLOC paper in real 2-peer collaborative runs (tiny presets, CPU)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import start_swarm, wait_until

SWAV_TINY = {"preset": "resnet18", "crops": "2,2", "crop_sizes": "64,32", "batch_size": 8,
             "synthetic_size": 80, "prototypes": 64, "feature_dim": 16, "queue_length": 0,
             "freeze_prototypes_steps": 0, "warmup_steps": 0, "total_steps": 100}


@pytest.mark.parametrize(("workload", "config", "target", "epochs"), [
    ("albert", {"preset": "albert-tiny"}, 64, 3),
    ("swav", SWAV_TINY, 16, 2),
])
async def test_two_peers_train_a_paper_workload_together(daemon_factory: Any, workload: str,
                                                         config: dict[str, Any], target: int,
                                                         epochs: int) -> None:
    daemons = await start_swarm(daemon_factory, 2, "--workers.threads", "1")
    params = {"workload": workload, "name": workload, "config": config, "target_batch_size": target,
              "epochs": epochs, "collaborative": True, "min_peers": 2, "checkpoint_every": 0}
    await asyncio.gather(*(d.call("run.start", params) for d in daemons))

    async def finished() -> list[dict[str, Any]] | None:
        statuses = [(await d.call("run.status", {"name": workload}))[0] for d in daemons]
        for status in statuses:
            assert status["state"] in ("running", "finished"), status
        return statuses if all(s["state"] == "finished" for s in statuses) else None

    statuses = await wait_until(finished, timeout=280)
    for status in statuses:
        assert status["epoch"] == epochs
        stepped = [e for e in status["epoch_history"] if e["stepped"]]
        assert [e["epoch"] for e in stepped] == list(range(epochs))
        assert {e["trainers"] for e in stepped} == {2}  # every step averaged both peers' gradients


async def test_a_peer_on_two_devices_is_one_trainer_of_the_run(daemon_factory: Any) -> None:
    """A worker with a replica process (device "cpu,cpu", Gloo) trains as one peer of the run."""
    daemons = await start_swarm(daemon_factory, 2, "--workers.threads", "1")
    params = {"workload": "tiny", "name": "pair", "target_batch_size": 256, "epochs": 3,
              "collaborative": True, "min_peers": 2, "checkpoint_every": 0}
    await asyncio.gather(daemons[0].call("run.start", {**params, "device": "cpu,cpu"}),
                         daemons[1].call("run.start", params))

    async def finished() -> list[dict[str, Any]] | None:
        statuses = [(await d.call("run.status", {"name": "pair"}))[0] for d in daemons]
        for status in statuses:
            assert status["state"] in ("running", "finished"), status
        return statuses if all(s["state"] == "finished" for s in statuses) else None

    statuses = await wait_until(finished, timeout=200)
    assert statuses[0]["devices"] == ["cpu", "cpu"] and statuses[1]["devices"] == ["cpu"]
    for status in statuses:
        stepped = [e for e in status["epoch_history"] if e["stepped"]]
        assert [e["epoch"] for e in stepped] == [0, 1, 2]
        assert {e["trainers"] for e in stepped} == {2}  # two peers, not three
        assert all(e["samples"] > 0 for e in stepped)  # each contributed to every step
