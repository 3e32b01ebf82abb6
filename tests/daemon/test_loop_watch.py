"""The event-loop watch counts a loop blocked for longer than its threshold (a blocking call on
the loop)."""

from __future__ import annotations

import asyncio
import time

from dedloc.daemon.loop_watch import LoopStallWatch


async def test_a_blocked_loop_is_counted() -> None:
    watch = LoopStallWatch(interval=0.01, threshold=0.1)
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.05)
    time.sleep(0.5)  # noqa: ASYNC251 (blocking the loop is what is tested)
    await asyncio.sleep(0.05)
    task.cancel()
    assert watch.stalls >= 1 and watch.longest >= 0.4

