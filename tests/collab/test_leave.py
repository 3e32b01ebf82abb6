"""A trainer killed with SIGKILL in the middle of an averaging round: the round's other peers do
not hang, the run goes on and its next epochs complete."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from support import start_swarm, wait_until


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
