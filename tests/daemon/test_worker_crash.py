"""A worker killed with SIGKILL: the run says so, the daemon lives on, a restart resumes."""

from __future__ import annotations

import os
import signal

from support import wait_until


async def test_killed_worker_is_reported_and_restartable(daemon) -> None:  # type: ignore[no-untyped-def]
    await daemon.call("run.start", {"workload": "tiny", "target_batch_size": 32,
                                    "checkpoint_every": 2})

    async def epochs(n: int) -> dict | None:
        (status,) = await daemon.call("run.status", {"name": "tiny"})
        return status if status["epoch"] >= n and status["state"] == "running" else None

    before = await wait_until(lambda: epochs(4))
    os.kill(before["worker"]["pid"], signal.SIGKILL)

    async def crashed() -> dict | None:
        (status,) = await daemon.call("run.status", {"name": "tiny"})
        return status if status["state"] == "crashed" else None

    status = await wait_until(crashed)
    assert status["worker"]["exit_code"] == -signal.SIGKILL
    assert "died" in status["error"]["message"]
    assert isinstance(status["worker"]["last_log_lines"], list)
    assert (await daemon.call("node.info"))["runs"] == {"crashed": 1}

    restarted = await daemon.call("run.restart", {"name": "tiny"})
    assert restarted["state"] == "running"
    assert restarted["restarts"] == 1
    assert restarted["worker"]["pid"] != before["worker"]["pid"]
    assert restarted["epoch"] >= 2  # resumed from a checkpoint, not from scratch
    after = await wait_until(lambda: epochs(restarted["epoch"] + 2))
    assert after["loss"] is not None
    assert await daemon.terminate() == 0
