"""Bandwidth caps: the token bucket on a fake clock, then real transports on 127.0.0.1 with caps.

The transfer checks measure the achieved rate at the receiving application over the steady part of
a 16 MiB stream (after the first 4 MiB, which the bucket's burst and the socket buffers blur) and
require it within 10% of the cap. The caps are far below what loopback TLS does on a loaded
machine, so the machine is never what limits the rate.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from net.netutil import wait_until

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import LinkLimits, Message, RequestContext, TlsTransport, TransportLimits
from dedloc.daemon.net.ratelimit import MIN_RATE, Bandwidth, TokenBucket, check_rate

MiB = 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def wait(self, event: asyncio.Event, seconds: float) -> None:
        """Sleeping advances the clock (unless woken first: a set event returns at once)."""
        self.waits.append(seconds)
        if not event.is_set():
            self.now += seconds
        await asyncio.sleep(0)


def bucket(rate: float, burst: float, clock: FakeClock) -> TokenBucket:
    return TokenBucket(rate, burst, clock=clock, waiter=clock.wait)


# --- the token bucket ----------------------------------------------------------------------------
def test_starts_full_and_refills_at_the_rate_up_to_the_burst() -> None:
    clock = FakeClock()
    b = bucket(1000, 500, clock)
    assert b.tokens() == 500
    assert b.delay(b.reserve(500)) == 0
    mark = b.reserve(250)
    assert b.delay(mark) == pytest.approx(0.25)
    clock.now += 0.1
    assert b.delay(mark) == pytest.approx(0.15)
    clock.now += 3600
    assert b.tokens() == 500  # never more than the burst, however long it was idle


def test_bookings_pass_in_order_and_big_ones_wait_longer() -> None:
    clock = FakeClock()
    b = bucket(100, 100, clock)
    b.take(100)
    first = b.reserve(1000)  # bigger than the burst: it simply waits for the refill
    second = b.reserve(10)
    assert b.delay(first) == pytest.approx(10.0)
    assert b.delay(second) == pytest.approx(10.1)


def test_take_makes_debt_that_later_bookings_wait_for() -> None:
    clock = FakeClock()
    b = bucket(1000, 100, clock)
    b.take(1100)  # control frames: never wait, but they count
    assert b.tokens() == pytest.approx(-1000)
    assert b.delay(b.reserve(1)) == pytest.approx(1.001)


async def test_acquire_sleeps_once_for_what_it_needs() -> None:
    clock = FakeClock()
    b = bucket(2000, 1000, clock)
    assert await b.acquire(1000) == 0.0 and clock.waits == []
    assert await b.acquire(3000) == pytest.approx(1.5)
    assert clock.waits == [pytest.approx(1.5)]  # one sleep of the right length: no polling
    assert b.waited_seconds == pytest.approx(1.5)


async def test_a_rate_change_wakes_sleepers_at_once() -> None:
    clock = FakeClock()
    woken = asyncio.Event()

    async def wait_forever(event: asyncio.Event, seconds: float) -> None:
        await event.wait()  # only a wake ends it (the fake clock stands still)
        woken.set()

    b = TokenBucket(1000, 1000, clock=clock, waiter=wait_forever)
    b.take(1000)
    task = asyncio.create_task(b.acquire(10_000))
    await asyncio.sleep(0)
    assert not task.done()
    b.set_rate(2000)  # the wait is recomputed: (10000 bytes) / 2000 = 5 s, still waiting
    await woken.wait()
    woken.clear()
    assert not task.done()
    assert b.delay(b.booked) == pytest.approx(5.0)
    b.set_rate(0)  # no cap: the debt is forgiven and the sleeper passes
    async with asyncio.timeout(5):
        await task
    assert b.tokens() == b.burst


async def test_a_cancelled_acquire_gives_its_booking_back() -> None:
    clock = FakeClock()

    async def wait_forever(event: asyncio.Event, seconds: float) -> None:
        await event.wait()

    b = TokenBucket(1000, 1000, clock=clock, waiter=wait_forever)
    b.take(1000)
    task = asyncio.create_task(b.acquire(5000))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.delay(b.reserve(1)) == pytest.approx(0.001)  # only the debt of take(), not the 5000


def test_unlimited_never_waits_and_a_new_cap_starts_full() -> None:
    clock = FakeClock()
    b = bucket(0, 100, clock)
    assert b.delay(b.reserve(10 * MiB)) == 0
    b.set_rate(1000, 100)
    assert b.tokens() == 100
    assert b.delay(b.reserve(200)) == pytest.approx(0.1)


async def test_real_clock_rate_change_takes_effect_at_once() -> None:
    b = TokenBucket(MIN_RATE)
    b.take(b.burst)
    task = asyncio.create_task(b.acquire(100 * MIN_RATE))  # ~100 s at this rate
    await asyncio.sleep(0.1)
    assert not task.done()
    started = time.monotonic()
    b.set_rate(0)
    async with asyncio.timeout(10):
        await task
    assert time.monotonic() - started < 5


def test_rates_are_checked() -> None:
    assert check_rate("upload", 0) == 0.0
    assert check_rate("upload", MIN_RATE) == MIN_RATE
    for bad in (-1, MIN_RATE - 1, float("inf"), float("nan"), True, "10"):
        with pytest.raises(ValueError, match="upload"):
            check_rate("upload", bad)  # type: ignore[arg-type]
    bandwidth = Bandwidth(4 * MiB, 0)
    with pytest.raises(ValueError):
        bandwidth.set(upload=0, download=1)  # checked first: nothing changes
    assert bandwidth.caps() == (4 * MiB, 0)
    bandwidth.set(download=MIN_RATE)
    assert bandwidth.caps() == (4 * MiB, MIN_RATE)


# --- real transports with caps -------------------------------------------------------------------
LIMITS = TransportLimits(handshake_timeout=5.0, link=LinkLimits(ping_interval=0.5, ping_timeout=4.0))
CAP = 4_000_000  # bytes/s: far below what loopback TLS does, so the cap is what limits
TOTAL = 16 * MiB
STEADY_FROM = 4 * MiB
MESSAGE = 256 * 1024


class Sink:
    """A stream handler that takes every message and notes when each byte count arrived."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []
        self.received = 0
        self.done = asyncio.Event()

    async def __call__(self, ctx: RequestContext, stream: Any) -> None:
        while True:
            message = await stream.receive(timeout=120)
            if message is None:
                self.done.set()
                return
            self.received += len(message.payload)
            self.marks.append((time.monotonic(), self.received))

    def steady_rate(self, start_bytes: int) -> float:
        t0, b0 = next((t, b) for t, b in self.marks if b >= start_bytes)
        t1, b1 = self.marks[-1]
        return (b1 - b0) / (t1 - t0)


async def make(bandwidth: Bandwidth | None = None) -> TlsTransport:
    from net.netutil import LOOPBACK

    return await TlsTransport.start(Identity.generate(), [LOOPBACK], limits=LIMITS,
                                    bandwidth=bandwidth)


async def send_bulk(sender: TlsTransport, receiver: TlsTransport, total: int,
                    message: int = MESSAGE) -> None:
    sender.learn_addresses(receiver.peer_id, receiver.listen_addresses())
    stream = await sender.open_stream(receiver.peer_id, "sink", {}, timeout=10)
    payload = bytes(message)
    for _ in range(total // message):
        await stream.send(Message({}, payload), timeout=120)
    await stream.close()


@pytest.fixture
async def transports() -> Any:
    made: list[TlsTransport] = []

    async def factory(bandwidth: Bandwidth | None = None) -> TlsTransport:
        made.append(await make(bandwidth))
        return made[-1]

    yield factory
    for transport in made:
        await transport.close()


@pytest.mark.parametrize("direction", ["upload", "download"])
async def test_a_cap_holds_a_bulk_stream_within_ten_percent(transports: Any, direction: str) -> None:
    capped = Bandwidth(upload=CAP if direction == "upload" else 0,
                       download=CAP if direction == "download" else 0)
    if direction == "upload":
        sender, receiver = await transports(capped), await transports()
    else:
        sender, receiver = await transports(), await transports(capped)
    sink = Sink()
    receiver.add_stream_handler("sink", sink)
    started = time.monotonic()
    await send_bulk(sender, receiver, TOTAL)
    async with asyncio.timeout(120):
        await sink.done.wait()
    elapsed = time.monotonic() - started
    rate = sink.steady_rate(STEADY_FROM)
    print(f"{direction} cap {CAP} B/s: steady {rate:.0f} B/s ({rate / CAP:.3f} x cap), "
          f"{TOTAL} bytes in {elapsed:.2f} s")
    assert 0.9 * CAP <= rate <= 1.1 * CAP
    counters = capped.counters()
    key = "up" if direction == "upload" else "down"
    assert counters[f"throttled_ms_{key}"] > 0 and counters[f"throttled_bytes_{key}"] > 0


async def test_raising_the_cap_mid_transfer_takes_effect_at_once(transports: Any) -> None:
    capped = Bandwidth(upload=64 * 1024)  # 16 MiB would take over four minutes at this cap
    sender, receiver = await transports(capped), await transports()
    sink = Sink()
    receiver.add_stream_handler("sink", sink)
    sending = asyncio.create_task(send_bulk(sender, receiver, TOTAL))
    try:
        await wait_until(lambda: sink.received > 0, timeout=10)
        await asyncio.sleep(0.5)
        assert sink.received < 2 * MiB
        capped.set(upload=0)
        async with asyncio.timeout(60):
            await sink.done.wait()
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
    assert sink.received == TOTAL


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message({}, b"ok")


async def test_links_stay_up_under_tiny_caps_both_ways(transports: Any) -> None:
    """Both directions saturated at the smallest caps: pongs queue behind bulk data in the socket
    buffers, yet neither side drops the link (bytes heard count as a sign of life)."""
    tiny = Bandwidth(upload=MIN_RATE, download=MIN_RATE)
    a, b = await transports(tiny), await transports()
    sinks = [Sink(), Sink()]
    a.add_stream_handler("sink", sinks[0])
    b.add_stream_handler("sink", sinks[1])
    await a.connect(b.listen_addresses()[0], timeout=10)  # one link, used both ways
    await wait_until(lambda: len(b.links()) == 1)
    bulk = [asyncio.create_task(send_bulk(a, b, 64 * MiB, 64 * 1024)),
            asyncio.create_task(send_bulk(b, a, 64 * MiB, 64 * 1024))]
    try:
        await wait_until(lambda: all(s.received for s in sinks), timeout=20)
        await asyncio.sleep(3 * LIMITS.link.ping_timeout)  # three keepalive deadlines
        assert a.counters()["links_closed"] == b.counters()["links_closed"] == 0
        assert len(a.links()) == len(b.links()) == 1
        assert all(not task.done() for task in bulk)  # still crawling along
    finally:
        for task in bulk:
            task.cancel()
        await asyncio.gather(*bulk, return_exceptions=True)
    assert tiny.counters()["throttled_ms_up"] > 0 and tiny.counters()["throttled_ms_down"] > 0


async def test_pings_and_calls_pass_a_saturated_tiny_upload_cap(transports: Any) -> None:
    """The capped side's control frames go out between data quanta (pings do not wait for the
    quota), and a call to it is answered although its upload is saturated."""
    tiny = Bandwidth(upload=MIN_RATE)
    a, b = await transports(tiny), await transports()
    sink = Sink()
    b.add_stream_handler("sink", sink)
    a.add_unary_handler("echo", echo)
    bulk = asyncio.create_task(send_bulk(a, b, 64 * MiB, 64 * 1024))
    try:
        await wait_until(lambda: sink.received > 0, timeout=20)
        await asyncio.sleep(2 * LIMITS.link.ping_interval)
        started = time.monotonic()
        reply = await b.call(a.peer_id, "echo", Message(), timeout=10)
        assert bytes(reply.payload) == b"ok"
        call_seconds = time.monotonic() - started
        rtts = []
        for _ in range(4):  # fresh keepalive round trips, measured while the upload is saturated
            await asyncio.sleep(LIMITS.link.ping_interval)
            rtts.append(a.links()[0].rtt_ms)
        print(f"tiny upload cap: call answered in {call_seconds:.3f} s; rtt {rtts} ms")
        assert call_seconds < 5 and min(r for r in rtts if r is not None) < 1000
        await asyncio.sleep(LIMITS.link.ping_timeout)
        assert a.counters()["links_closed"] == b.counters()["links_closed"] == 0
        assert not bulk.done()
    finally:
        bulk.cancel()
        await asyncio.gather(bulk, return_exceptions=True)
