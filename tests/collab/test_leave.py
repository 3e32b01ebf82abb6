"""A trainer killed with SIGKILL in the middle of an averaging round: the round's other peers do
not hang, the run goes on and its next epochs complete."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from support import DaemonProcess, p2p_address, start_swarm, wait_until


async def test_a_trainer_killed_during_averaging(daemon_factory: Any) -> None:
    daemons = await start_swarm(daemon_factory, 3)
    first = daemons[0]
    # About 3 MB of gradients: a round takes long enough to be caught in the middle.
    params = {"workload": "tiny", "name": "leave", "collaborative": True, "min_peers": 2,
              "config": {"hidden": 512, "layers": 3, "batch_size": 32}, "target_batch_size": 96,
              "checkpoint_every": 0, "average_state_every": 0}
    await asyncio.gather(*(d.call("run.start", params) for d in daemons))

    async def epoch_at_least(daemon: Any, n: int) -> dict[str, Any] | None:
        (status,) = await daemon.call("run.status", {"name": "leave"})
        assert status["state"] == "running", status
        return status if status["epoch"] >= n else None

    await wait_until(lambda: epoch_at_least(first, 2), timeout=120)
    victim = daemons[2]
    (status,) = await victim.call("run.status", {"name": "leave"})
    worker_pid = status["worker"]["pid"]
    deadline = time.monotonic() + 120
    while True:  # watch the victim closely and kill it while it averages
        (status,) = await victim.call("run.status", {"name": "leave"})
        if status["phase"] == "averaging":
            victim.process.kill()
            break
        assert time.monotonic() < deadline, "the victim was never seen averaging"
    killed_at_epoch = status["epoch"]
    await victim.process.wait()
    os.kill(worker_pid, signal.SIGKILL)  # its worker too, as when a machine dies

    for survivor in daemons[:2]:
        after = await wait_until(lambda s=survivor: epoch_at_least(s, killed_at_epoch + 3), timeout=180)
        assert after["state"] == "running"
    statuses = [(await d.call("run.status", {"name": "leave"}))[0] for d in daemons[:2]]
    for status in statuses:
        assert status["last_round"]["group_size"] == 2  # the dead peer is out of the rounds

    async def dead_peer_gone(daemon: Any) -> bool:  # and, once its last report is stale, of the count
        (status,) = await daemon.call("run.status", {"name": "leave"})
        return status["run_peers"] == 2

    await wait_until(lambda: dead_peer_gone(first), timeout=90)
    # The survivors stayed together: the same epoch, or one step apart while a round ends.
    assert abs(statuses[0]["epoch"] - statuses[1]["epoch"]) <= 1


async def test_a_paused_peer_leaves_the_rounds_and_catches_up_on_resume(daemon_factory: Any) -> None:
    """node.pause: the peer's run leaves its rounds (the other goes on alone) and waits;
    node.resume: it drops its stale gradients, downloads the run's state and takes part in
    rounds again."""
    first = await daemon_factory()
    address = await p2p_address(first)
    second = await daemon_factory("--net.bootstrap", address)
    params = {"workload": "tiny", "name": "pause", "target_batch_size": 256, "collaborative": True,
              "min_peers": 1, "checkpoint_every": 0}
    await asyncio.gather(first.call("run.start", params), second.call("run.start", params))

    async def status(daemon: Any) -> dict[str, Any]:
        (found,) = await daemon.call("run.status", {"name": "pause"})
        return found

    async def both_in_rounds() -> bool:
        last = (await status(second))["last_round"]
        return bool(last and last["senders"] == 2)

    await wait_until(both_in_rounds, timeout=120)
    paused = await second.call("node.pause")
    assert paused["paused"] is True and "paused by the volunteer" in paused["blocked"]

    async def waiting() -> dict[str, Any] | None:
        found = await status(second)
        return found if found["phase"] == "paused" else None

    held = await wait_until(waiting, timeout=60)
    assert "paused" in held["paused"]
    epoch = (await status(first))["epoch"]

    async def alone_ahead() -> bool:
        found = await status(first)
        return found["epoch"] >= epoch + 3 and found["last_round"]["senders"] == 1

    await wait_until(alone_ahead, timeout=120)
    assert (await status(second))["phase"] == "paused"
    assert (await second.call("node.availability"))["paused"] is True
    resumed = await second.call("node.resume")
    assert resumed["paused"] is False and resumed["blocked"] is None

    async def back() -> dict[str, Any] | None:
        found = await status(second)
        last = found["last_round"]
        ahead = found["epoch"] >= epoch + 3
        return found if ahead and last and last["senders"] == 2 and found["phase"] != "paused" else None

    found = await wait_until(back, timeout=120)
    # It caught up with the run by a state download or a state-averaging round, not by training.
    assert found["paused"] is None
    assert found["state_downloads"] >= 1 or found["last_state_round"] is not None, found


async def test_a_pause_outlives_a_restart(daemon_factory: Any) -> None:
    daemon = await daemon_factory()
    assert (await daemon.call("node.availability"))["paused"] is False
    await daemon.call("node.pause")
    assert await daemon.terminate() == 0
    again = await DaemonProcess.start(daemon.root)
    try:
        state = await again.call("node.availability")
        assert state["paused"] is True and "dedloc resume" in state["blocked"]
        assert (await again.call("node.resume"))["paused"] is False
    finally:
        await again.terminate()
