"""Simulated peers' clocks: the virtual loop's time, with a skew of each peer's own."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

__all__ = ["UNIX_START", "SkewedClock"]

#: The unix time at which virtual time starts (2027-01-15), so that reports and records carry
#: realistic timestamps.
UNIX_START = 1_800_000_000.0


@dataclass
class SkewedClock:
    """`now()` is the virtual time as unix seconds plus `skew` (a peer whose clock is off);
    `monotonic()` is the loop's virtual time."""

    loop: asyncio.AbstractEventLoop
    skew: float = 0.0

    def now(self) -> float:
        return UNIX_START + self.loop.time() + self.skew

    def monotonic(self) -> float:
        return self.loop.time()
