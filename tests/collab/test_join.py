"""Joining a run by its name: the manifest comes from the DHT; a newcomer downloads the state,
follows the run's learning-rate schedule and contributes. Another manifest under the same name is
another run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import p2p_address, wait_until

from dedloc.rpc import RpcCallError

LR, WARMUP = 0.01, 1000
PARAMS = {"workload": "tiny", "name": "open", "target_batch_size": 128, "collaborative": True,
          "min_peers": 2, "config": {"warmup_steps": WARMUP, "lr": LR}, "checkpoint_every": 0}


async def _status(daemon: Any) -> dict[str, Any]:
    (status,) = await daemon.call("run.status", {"name": "open"})
    return status


async def test_a_newcomer_joins_by_name_downloads_and_contributes(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    second = await daemon_factory("--net.bootstrap", address)
    await asyncio.gather(first.call("run.start", PARAMS), second.call("run.start", PARAMS))

    async def at_epoch(daemon: Any, n: int) -> dict[str, Any] | None:
        status = await _status(daemon)
        assert status["state"] == "running", status
        return status if status["epoch"] >= n else None

    await wait_until(lambda: at_epoch(first, 3), timeout=120)
    late = await daemon_factory("--net.bootstrap", address)

    async def late_joined_the_dht() -> bool:
        return bool((await late.call("node.info"))["dht"]["joined"])

    await wait_until(late_joined_the_dht, timeout=60)
    with pytest.raises(RpcCallError) as refused:  # a name nobody publishes
        await late.call("run.start", {"name": "no-such-run"})
    assert "no peer publishes" in refused.value.message

    async def join() -> dict[str, Any] | None:
        try:
            return await late.call("run.start", {"name": "open"})  # no workload: join by name
        except RpcCallError as exc:
            if "no peer publishes" in exc.message:
                return None
            raise

    joined = await wait_until(join, timeout=60)
    reference = await _status(first)
    assert joined["fingerprint"] == reference["fingerprint"]
    assert joined["manifest"] == reference["manifest"]

    async def contributing() -> dict[str, Any] | None:
        status = await _status(late)
        last = status["last_round"]
        return status if last and last["senders"] == 3 and status["lr"] is not None else None

    status = await wait_until(contributing, timeout=120)
    assert status["state_downloads"] >= 1 and status["epoch"] > 3
    # Its learning rate is the schedule's at the run's epoch, not at its own few steps.
    assert status["lr"] == pytest.approx(LR * status["epoch"] / WARMUP, rel=1e-6)


async def test_another_manifest_under_the_same_name_is_another_run(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    other = await daemon_factory("--net.bootstrap", address)
    started = await first.call("run.start", {**PARAMS, "min_peers": 1})

    async def published() -> dict[str, Any] | None:
        status = await other.call("run.start", {**PARAMS, "min_peers": 1, "target_batch_size": 64})
        if status["other_manifests"]:
            return status
        await other.call("run.stop", {"name": "open"})
        return None

    mine = await wait_until(published, timeout=60)
    assert mine["fingerprint"] != started["fingerprint"]
    assert [m["fingerprint"] for m in mine["other_manifests"]] == [started["fingerprint"]]

    async def stepped(daemon: Any) -> dict[str, Any] | None:
        status = await _status(daemon)
        return status if status["epoch"] >= 3 else None

    for daemon in (first, other):
        status = await wait_until(lambda d=daemon: stepped(d), timeout=120)
        assert status["last_round"]["group_size"] == 1  # they never average together
        assert status["run_peers"] == 1
