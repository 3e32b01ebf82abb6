"""The event-loop watch counts a loop that woke later than its threshold (a blocking call on the
loop), on a clock the test moves: no wall-clock wait."""

from __future__ import annotations

import asyncio
import itertools

from dedloc.daemon.loop_watch import LoopStallWatch


async def test_a_loop_that_wakes_late_is_counted_and_one_on_time_is_not() -> None:
    # the clock reads 0, 3 (woke 3 s late), 3, 3.01 (on time), then 0.01 s a wake-up
    readings = itertools.chain([0.0, 3.0, 3.0, 3.01], itertools.count(10.0, 0.01))
    watch = LoopStallWatch(interval=0.0, threshold=2.0, clock=lambda: next(readings))
    task = asyncio.create_task(watch.run())
    for _ in range(50):  # (the watch sleeps 0 s: each of these lets it wake once or so)
        await asyncio.sleep(0)
    task.cancel()
    assert watch.stalls == 1 and watch.longest == 3.0
