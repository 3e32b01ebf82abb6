"""Bandwidth caps a volunteer sets (net.upload_bytes_per_second, net.download_bytes_per_second).

`TokenBucket` is a token bucket kept as two running totals: bytes booked so far (`reserve`) and
bytes the refill has covered so far (`rate` bytes a second, never more than `burst` ahead of the
bookings). A booking is a mark on the booked total; it may pass once the covered total reaches
it, so bookings pass in the order they were made (no waiter starves) and a booking bigger than the
burst simply waits longer. A rate change refills at the old rate up to now, then wakes every
sleeper to recompute its wait with the new rate: it takes effect at once. Rate 0 means no cap
(and forgives any debt). Nothing awaits between reading and updating the totals, so any number
of tasks of one event loop may share a bucket; sleepers sleep (no polling) for exactly the time
their mark needs, or until woken.

`Bandwidth` is one daemon's pair of buckets, shared by all its links (link_writer.py and
link_reader.py): every path kind (direct TCP, hole-punched TCP, WebRTC) meters the bytes of its
frames there, except relayed links, whose bytes already pass through the link to the relay
(metered once, on that link). Control frames (PING/PONG, CREDIT, ...) are booked without waiting
and go out while data waits (keepalive answers never queue behind a quota); data is booked in
quanta of ~`QUANTUM_SECONDS` of the cap. Downloads are metered after each socket read, and the
next read waits for the debt: the kernel's receive buffer fills and TCP (or the link's flow
control, on WebRTC) slows the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Literal

from .. import timebase

__all__ = ["MIN_RATE", "Bandwidth", "TokenBucket", "check_rate"]

MIN_RATE = 16 * 1024  # slower caps starve relayed links' 256 KiB messages and stream deadlines
BURST_SECONDS = 0.5  # the default burst: half a second of the cap (covers event-loop stalls)
MIN_BURST = 64 * 1024
QUANTUM_SECONDS = 0.05  # a throttled link sends and reads in pieces of this much of the cap
MIN_QUANTUM = 2 * 1024
MAX_QUANTUM = 1024 * 1024

Clock = Callable[[], float]
Waiter = Callable[[asyncio.Event, float], Awaitable[None]]


def check_rate(name: str, value: float) -> float:
    """A cap in bytes/s: 0 (none) or at least MIN_RATE, finite; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"{name} must be 0 (no cap) or a positive number of bytes per second, "
                         f"not {value!r}")
    if 0 < value < MIN_RATE:
        raise ValueError(f"{name} must be 0 (no cap) or at least {MIN_RATE} bytes per second "
                         f"(16 KiB/s), not {value!r}")
    return float(value)


def default_burst(rate: float) -> float:
    return max(MIN_BURST, rate * BURST_SECONDS)


async def _wait_event(event: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


class TokenBucket:
    """`rate` bytes/s (0: unlimited) with `burst` bytes of allowance (default: half a second of
    the rate, at least 64 KiB). `clock` and `waiter` are for tests (a fake clock)."""

    def __init__(self, rate: float = 0.0, burst: float | None = None, *,
                 clock: Clock = timebase.monotonic, waiter: Waiter = _wait_event) -> None:
        self._clock = clock
        self._waiter = waiter
        self._rate = 0.0
        self._burst = float(MIN_BURST)
        self._booked = 0.0  # bytes booked, ever
        self._covered = 0.0  # bytes the refill (and the initial burst) covered, ever
        self._stamp = clock()
        # (a dict, not a set: woken in the order they slept, the same in every simulated run)
        self._sleepers: dict[asyncio.Event, None] = {}
        self.waited_seconds = 0.0  # time `acquire` callers slept, in all
        self.set_rate(rate, burst)
        self._covered = self._booked + self._burst  # start full

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    @property
    def booked(self) -> float:
        """Bytes booked so far (what passed or waits to pass)."""
        return self._booked

    def tokens(self) -> float:
        """Bytes that may pass now without waiting (negative: debt)."""
        self._refill()
        return self._covered - self._booked

    def set_rate(self, rate: float, burst: float | None = None) -> None:
        """Change the rate (0: unlimited) and the burst (None: the default for the rate); the
        sleepers wake and wait what the new rate asks."""
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"a rate must be finite and not negative, not {rate!r}")
        new_burst = default_burst(rate) if burst is None else float(burst)
        if not math.isfinite(new_burst) or new_burst <= 0:
            raise ValueError(f"a burst must be finite and positive, not {burst!r}")
        self._refill()
        self._rate, self._burst = float(rate), new_burst
        if self._rate == 0:
            self._covered = self._booked + self._burst
        else:
            self._covered = min(self._covered, self._booked + self._burst)
        for event in self._sleepers:
            event.set()

    def _refill(self) -> None:
        now = self._clock()
        if self._rate == 0:
            self._covered = self._booked + self._burst
        elif now > self._stamp:
            self._covered = min(self._covered + (now - self._stamp) * self._rate,
                                self._booked + self._burst)
        self._stamp = max(now, self._stamp)

    def reserve(self, count: float) -> float:
        """Book `count` bytes now; the mark to pass to `delay`/`sleep_until`."""
        if count < 0:
            raise ValueError("cannot book a negative number of bytes")
        self._refill()
        self._booked += count
        return self._booked

    def take(self, count: float) -> None:
        """Book `count` bytes that pass now anyway (control frames): later bookings wait for them."""
        self.reserve(count)

    def delay(self, mark: float) -> float:
        """Seconds until the booking `mark` may pass at the current rate (0: now)."""
        self._refill()
        if self._rate == 0 or self._covered >= mark:
            return 0.0
        return (mark - self._covered) / self._rate

    def refund(self, count: float) -> None:
        """Give back `count` booked bytes that will not be sent (a cancelled booking)."""
        self._refill()
        self._covered = min(self._covered + count, self._booked + self._burst)

    async def sleep_until(self, mark: float, wake: asyncio.Event) -> float:
        """Sleep until `mark` may pass, or until `wake` is set (by its owner, or by a rate change);
        the seconds still to wait (0: it may pass)."""
        delay = self.delay(mark)
        if delay <= 0 or wake.is_set():
            return delay
        self._sleepers[wake] = None
        try:
            await self._waiter(wake, delay)
        finally:
            self._sleepers.pop(wake, None)
        return self.delay(mark)

    async def acquire(self, count: float) -> float:
        """Book `count` bytes and wait until they may pass; the seconds waited. A cancelled
        caller's booking is given back."""
        mark = self.reserve(count)
        if self.delay(mark) <= 0:
            return 0.0
        started = self._clock()
        wake = asyncio.Event()
        try:
            while await self.sleep_until(mark, wake) > 0:
                wake.clear()
        except asyncio.CancelledError:
            if self.delay(mark) > 0:
                self.refund(count)
            raise
        finally:
            waited = max(0.0, self._clock() - started)
            self.waited_seconds += waited
        return waited


Direction = Literal["up", "down"]


class Bandwidth:
    """One daemon's caps: every link's frames out book on `up`, every byte read on `down`."""

    def __init__(self, upload: float = 0.0, download: float = 0.0, *,
                 clock: Clock = timebase.monotonic) -> None:
        self.up = TokenBucket(check_rate("upload", upload), clock=clock)
        self.down = TokenBucket(check_rate("download", download), clock=clock)
        self._clock = clock
        self.waited = {"up": 0.0, "down": 0.0}  # seconds links waited for the caps
        self.throttled_bytes = {"up": 0, "down": 0}  # bytes that had to wait

    @property
    def upload(self) -> float:
        return self.up.rate

    @property
    def download(self) -> float:
        return self.down.rate

    def caps(self) -> tuple[float, float]:
        """(upload, download) in bytes/s; 0: no cap."""
        return self.up.rate, self.down.rate

    def set(self, upload: float | None = None, download: float | None = None) -> None:
        """Change either cap (None: keep it); checked first, so a bad value changes nothing."""
        up = None if upload is None else check_rate("upload", upload)
        down = None if download is None else check_rate("download", download)
        if up is not None:
            self.up.set_rate(up)
        if down is not None:
            self.down.set_rate(down)

    def quantum(self, direction: Direction) -> int:
        """Bytes a throttled link sends (or reads) at a time: ~QUANTUM_SECONDS of the cap."""
        rate = (self.up if direction == "up" else self.down).rate
        if rate == 0:
            return MAX_QUANTUM
        return int(min(MAX_QUANTUM, max(MIN_QUANTUM, rate * QUANTUM_SECONDS)))

    async def pay_up(self, count: int, wake: asyncio.Event,
                     flush: Callable[[], Awaitable[None]]) -> None:
        """Book `count` bytes of data to send and wait until the cap lets them go. `wake` is the
        link writer's event: when it is set while waiting, `flush()` runs (the link sends its
        control frames, booked with `up.take`) and the wait goes on."""
        bucket = self.up
        mark = bucket.reserve(count)
        if bucket.delay(mark) <= 0:
            return
        started = self._clock()
        try:
            while True:
                wake.clear()
                await flush()
                if await bucket.sleep_until(mark, wake) <= 0:
                    return
        finally:
            self._count("up", count, started)

    async def pay_down(self, count: int) -> None:
        """Book `count` bytes just read; return once the cap allows the next read."""
        if not count:
            return
        started = self._clock()
        if await self.down.acquire(count) > 0:
            self._count("down", count, started)

    def _count(self, direction: Direction, count: int, started: float) -> None:
        self.waited[direction] += max(0.0, self._clock() - started)
        self.throttled_bytes[direction] += count

    def counters(self) -> dict[str, int]:
        """For node.info (prefixed net.): the caps, and how long and for how many bytes links
        waited for them."""
        return {
            "upload_cap_bytes_per_second": int(self.up.rate),
            "download_cap_bytes_per_second": int(self.down.rate),
            "throttled_ms_up": int(self.waited["up"] * 1000),
            "throttled_ms_down": int(self.waited["down"] * 1000),
            "throttled_bytes_up": self.throttled_bytes["up"],
            "throttled_bytes_down": self.throttled_bytes["down"],
        }
