"""Trainers of one run average their gradients at the run's target and stay identical."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from support import p2p_address, wait_until

EPOCHS = 4


async def test_three_trainers_step_together(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    others = await asyncio.gather(*(daemon_factory("--net.bootstrap", address) for _ in range(2)))
    daemons = [first, *others]

    async def joined() -> bool:
        infos = [await d.call("node.info") for d in daemons]
        return all(i["dht"]["joined"] for i in infos)

    await wait_until(joined, timeout=60)
    params = {"workload": "tiny", "name": "together", "target_batch_size": 192, "epochs": EPOCHS,
              "collaborative": True, "checkpoint_every": 1, "min_peers": 3}
    await asyncio.gather(*(d.call("run.start", params) for d in daemons))

    async def finished() -> list[dict] | None:
        statuses = [(await d.call("run.status", {"name": "together"}))[0] for d in daemons]
        for status in statuses:
            assert status["state"] in ("running", "finished"), status
        return statuses if all(s["state"] == "finished" for s in statuses) else None

    statuses = await wait_until(finished, timeout=240)
    for status in statuses:
        assert status["epoch"] == EPOCHS
        assert status["failed_rounds"] == 0
        assert status["last_round"]["group_size"] == 3
        # every peer trained: the run needed all of them
        assert status["samples"] > 0
    # The same averaged gradients, the same steps: identical parameters everywhere.
    models = [torch.load(d.root / "state" / "runs" / "together" / "checkpoint.pt",
                         weights_only=False)["model"] for d in daemons]
    for name, tensor in models[0].items():
        for other in models[1:]:
            torch.testing.assert_close(other[name], tensor, rtol=0, atol=0)
    losses = statuses[0]["epoch_losses"]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("epochs", [3])
async def test_a_lone_collaborative_trainer_still_steps(daemon_factory: Any, epochs: int) -> None:
    daemon = await daemon_factory()
    await daemon.call("run.start", {"workload": "tiny", "target_batch_size": 64, "epochs": epochs,
                                    "collaborative": True})

    async def finished() -> dict | None:
        (status,) = await daemon.call("run.status")
        assert status["state"] in ("running", "finished"), status
        return status if status["state"] == "finished" else None

    status = await wait_until(finished, timeout=120)
    assert status["epoch"] == epochs and status["last_round"]["group_size"] == 1
