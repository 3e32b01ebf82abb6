"""Trainers of one run average their gradients at the run's target and stay identical."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from support import p2p_address, start_swarm, wait_until

EPOCHS = 4


async def test_three_trainers_step_together(daemon_factory: Any) -> None:
    daemons = await start_swarm(daemon_factory, 3)
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
        # every epoch was stepped by all three in one round (min_peers 3: a round of fewer is
        # not stepped on; on a loaded machine one may come too late and the round is repeated,
        # which is what failed_rounds counts)
        assert [e["trainers"] for e in status["epoch_history"]] == [3] * EPOCHS, status
        assert status["last_round"]["group_size"] == 3
        # every peer trained: the run needed all of them
        assert status["samples"] > 0
    # The same averaged gradients, the same steps: identical parameters everywhere.
    fingerprint = statuses[0]["fingerprint"]
    paths = [d.root / "state" / "runs" / "together" / fingerprint / f"checkpoint-{EPOCHS:09d}.pt"
             for d in daemons]
    models = [torch.load(path, weights_only=False)["model"] for path in paths]
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


async def test_a_late_trainer_downloads_the_state_and_contributes(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    second = await daemon_factory("--net.bootstrap", address)
    params = {"workload": "tiny", "name": "joinable", "target_batch_size": 128, "collaborative": True,
              "min_peers": 2}
    await asyncio.gather(first.call("run.start", params), second.call("run.start", params))

    async def epoch_at_least(daemon: Any, n: int) -> dict | None:
        (status,) = await daemon.call("run.status", {"name": "joinable"})
        assert status["state"] == "running", status
        return status if status["epoch"] >= n else None

    await wait_until(lambda: epoch_at_least(first, 3), timeout=120)
    late = await daemon_factory("--net.bootstrap", address)
    await late.call("run.start", params)
    caught_up = await wait_until(lambda: epoch_at_least(late, 3), timeout=120)
    assert caught_up["state_downloads"] >= 1  # it did not train from scratch

    async def contributed() -> dict | None:
        (status,) = await late.call("run.status", {"name": "joinable"})
        last = status["last_round"]
        return status if last and last["group_size"] == 3 else None

    status = await wait_until(contributed, timeout=120)
    assert status["epoch"] > caught_up["epoch"] - 1
    for daemon in (first, second, late):
        await daemon.call("run.stop", {"name": "joinable"})


async def test_the_run_goes_on_when_a_trainer_is_killed(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    others = await asyncio.gather(*(daemon_factory("--net.bootstrap", address) for _ in range(2)))
    daemons = [first, *others]
    params = {"workload": "tiny", "name": "churn", "target_batch_size": 192, "collaborative": True,
              "min_peers": 2}
    await asyncio.gather(*(d.call("run.start", params) for d in daemons))

    async def epoch_at_least(daemon: Any, n: int) -> dict | None:
        (status,) = await daemon.call("run.status", {"name": "churn"})
        assert status["state"] == "running", status
        return status if status["epoch"] >= n else None

    before = await wait_until(lambda: epoch_at_least(first, 2), timeout=120)
    victim = daemons[2]
    victim.process.kill()  # SIGKILL, wherever it is: training, publishing or averaging
    await victim.process.wait()
    for survivor in daemons[:2]:
        after = await wait_until(lambda s=survivor: epoch_at_least(s, before["epoch"] + 3), timeout=180)
        assert after["state"] == "running"
    statuses = [(await d.call("run.status", {"name": "churn"}))[0] for d in daemons[:2]]
    assert {s["last_round"]["group_size"] for s in statuses} == {2}  # the dead peer is out
