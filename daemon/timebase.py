"""The daemon's two clocks, read in one place: wall time and monotonic time.

- `now()`: unix seconds. What peers compare with each other: expirations of DHT records, the
  times of progress reports, the deadlines of averaging rounds. Peers' clocks differ by seconds;
  code that compares its own `now()` with another peer's must allow for that.
- `monotonic()`: seconds on a clock that never jumps, for intervals measured by this peer alone
  (keepalives, backoffs, rates). It is the event loop's clock (asyncio's loops use
  `time.monotonic`; the simulator's loop, its virtual time), so `asyncio.sleep` and
  `asyncio.timeout` agree with it.

Every module of the daemon reads time here, never `time.time()` directly, so that the swarm
simulator (`dedloc.sim`) runs the real code on a virtual clock: the clock in use is a context
variable (`use`), and the tasks of a simulated peer inherit the clock, with its own skew, of the
context they were created in. Outside the simulator it is the system's clock.
"""

from __future__ import annotations

import time
from contextvars import ContextVar, Token
from typing import Protocol

__all__ = ["Clock", "SystemClock", "current", "monotonic", "now", "reset", "use"]


class Clock(Protocol):
    def now(self) -> float:
        """Unix seconds."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""


class SystemClock:
    """The machine's clocks."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()  # what asyncio's own loops use as their time()


SYSTEM = SystemClock()
_current: ContextVar[Clock] = ContextVar("dedloc_clock", default=SYSTEM)


def now() -> float:
    """Unix seconds on the clock in use."""
    return _current.get().now()


def monotonic() -> float:
    """Monotonic seconds on the clock in use."""
    return _current.get().monotonic()


def current() -> Clock:
    return _current.get()


def use(clock: Clock) -> Token[Clock]:
    """Make `clock` the clock of the current context (and of the tasks created from it)."""
    return _current.set(clock)


def reset(token: Token[Clock]) -> None:
    """Undo a `use`."""
    _current.reset(token)
