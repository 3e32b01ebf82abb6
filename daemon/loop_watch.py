"""The daemon's event loop, watched: a loop that was blocked (a long computation or a blocking
call on it) answers nothing meanwhile, not the control API, not its peers' pings. The watch wakes
every `interval` seconds and logs `event_loop_stalled` with how late it woke when that was more
than `threshold` seconds, so that a daemon that "did not answer for 120 s" says so in its log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

__all__ = ["LoopStallWatch"]


class LoopStallWatch:
    def __init__(self, interval: float = 1.0, threshold: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.threshold = threshold
        self.stalls = 0
        self.longest = 0.0  # seconds

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            before = self.clock()
            await asyncio.sleep(self.interval)
            late = self.clock() - before - self.interval
            if late > self.threshold:
                self.stalls += 1
                self.longest = max(self.longest, late)
                log.warning("event_loop_stalled", seconds=round(late, 2), stalls=self.stalls)
