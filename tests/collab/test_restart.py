"""A collaborative trainer stopped and restarted resumes from its own checkpoint, then from its
peers, who went on without it."""

from __future__ import annotations

import asyncio
from typing import Any

from support import DaemonProcess, p2p_address, wait_until

PARAMS = {"workload": "tiny", "name": "back", "target_batch_size": 128, "collaborative": True,
          "min_peers": 2, "checkpoint_every": 2}


async def _status(daemon: Any) -> dict[str, Any]:
    (status,) = await daemon.call("run.status", {"name": "back"})
    return status


async def _at_epoch(daemon: Any, n: int) -> dict[str, Any] | None:
    status = await _status(daemon)
    assert status["state"] == "running", status
    return status if status["epoch"] >= n else None


async def test_a_restarted_trainer_resumes_then_catches_up(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    others = await asyncio.gather(*(daemon_factory("--net.bootstrap", address) for _ in range(2)))
    await asyncio.gather(*(d.call("run.start", PARAMS) for d in (first, *others)))
    leaving = others[1]
    await wait_until(lambda: _at_epoch(leaving, 3), timeout=120)
    stopped = await leaving.call("run.stop", {"name": "back"})
    assert await leaving.terminate() == 0
    # The two others carry on without it.
    await wait_until(lambda: _at_epoch(first, stopped["epoch"] + 4), timeout=120)

    back = await DaemonProcess.start(leaving.root, "--net.bootstrap", address)
    try:
        resumed = await back.call("run.start", PARAMS)
        assert resumed["resumed_from"]["epoch"] == stopped["epoch"]  # its own checkpoint first
        assert resumed["epoch"] == stopped["epoch"]

        async def caught_up() -> dict[str, Any] | None:
            status = await _status(back)
            run_epoch = (await _status(first))["epoch"]
            last = status["last_round"]
            if status["state_downloads"] >= 1 and last and last["senders"] == 3 \
                    and status["epoch"] >= run_epoch - 1:
                return status
            return None

        status = await wait_until(caught_up, timeout=120)  # then the peers' newer state
        assert status["epoch"] > stopped["epoch"] + 3
    finally:
        await back.kill()
