"""Two and three real transports on 127.0.0.1: calls, streams, flow control, errors, close."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from net.netutil import FAST, LOOPBACK, wait_until

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    CallTimeout,
    LimitExceeded,
    LinkEvent,
    LinkLimits,
    Message,
    PeerAddress,
    PeerUnreachableError,
    RemoteError,
    RequestContext,
    StreamAborted,
    TlsTransport,
    TransportClosed,
    TransportLimits,
    UnknownMethod,
)
from dedloc.daemon.net.link_stream import LinkStream

MiB = 1024 * 1024


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message({"from": ctx.peer_id, **message.header}, bytes(message.payload))


async def pair(make: Any, **kwargs: Any) -> tuple[TlsTransport, TlsTransport]:
    a, b = await make(**kwargs), await make(**kwargs)
    for t in (a, b):
        t.add_unary_handler("echo", echo)
    b.learn_addresses(a.peer_id, a.listen_addresses())
    return a, b


@pytest.mark.parametrize("tls", [True, False])
async def test_unary_calls_both_directions(make_transport: Any, tls: bool) -> None:
    a, b = await pair(make_transport, tls=tls)
    assert await b.connect(a.listen_addresses()[0], timeout=5) == a.peer_id
    reply = await b.call(a.peer_id, "echo", Message({"x": 1}, b"hi"), timeout=5)
    assert reply.header == {"from": b.peer_id, "x": 1} and bytes(reply.payload) == b"hi"
    # the other way over the same link: a learned b's addresses from its hello, no dial needed
    reply = await a.call(b.peer_id, "echo", Message({}, b"x" * (3 * MiB + 5)), timeout=5)
    assert bytes(reply.payload) == b"x" * (3 * MiB + 5)
    assert len(a.links()) == len(b.links()) == 1
    info = b.links()[0]
    assert info.peer_id == a.peer_id and info.outbound and info.kind == ("tcp" if tls else "tcp-plain")
    await wait_until(lambda: b.links()[0].rtt_ms is not None)


async def test_call_dials_learned_addresses_and_events(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    events: list[LinkEvent] = []
    b.add_link_listener(events.append)
    await b.call(a.peer_id, "echo", Message(), timeout=5)  # dials a's learned address
    assert [(e.kind, e.peer_id) for e in events] == [("up", a.peer_id)]
    await a.close()
    await wait_until(lambda: len(events) == 2)
    assert (events[1].kind, events[1].peer_id) == ("down", a.peer_id)


async def test_concurrent_calls_among_three(make_transport: Any) -> None:
    peers = [await make_transport() for _ in range(3)]
    for p in peers:
        p.add_unary_handler("echo", echo)
        for q in peers:
            if q is not p:
                p.learn_addresses(q.peer_id, q.listen_addresses())
    pairs = [(p, q) for p in peers for q in peers if p is not q for _ in range(10)]
    calls = [p.call(q.peer_id, "echo", Message({"i": i}, os.urandom(i * 1000)), timeout=10)
             for i, (p, q) in enumerate(pairs)]
    replies = await asyncio.gather(*calls)
    assert [r.header["i"] for r in replies] == list(range(len(calls)))
    for p in peers:
        await wait_until(lambda p=p: len(p.links()) == 2)


async def test_errors_arrive_as_remote_errors(make_transport: Any) -> None:
    a, b = await pair(make_transport)

    async def broken(ctx: RequestContext, message: Message) -> Message:
        raise ValueError("no such shard 7")

    a.add_unary_handler("broken", broken)
    with pytest.raises(RemoteError) as info:
        await b.call(a.peer_id, "broken", Message(), timeout=5)
    assert (info.value.kind, info.value.message) == ("ValueError", "no such shard 7")
    with pytest.raises(UnknownMethod):
        await b.call(a.peer_id, "nope", Message(), timeout=5)
    with pytest.raises(UnknownMethod):
        await b.open_stream(a.peer_id, "nope", {}, timeout=5)
    with pytest.raises(PeerUnreachableError):
        await b.call(TlsTransport.__name__, "echo", Message(), timeout=5)
    # the link is still fine
    assert (await b.call(a.peer_id, "echo", Message({"k": 1}), timeout=5)).header["k"] == 1


async def test_deadline_and_cancellation_reach_the_handler(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(ctx: RequestContext, message: Message) -> Message:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Message()

    async def echo(ctx: RequestContext, message: Message) -> Message:
        return message

    a.add_unary_handler("slow", slow)
    a.add_unary_handler("echo", echo)
    with pytest.raises(CallTimeout):
        await b.call(a.peer_id, "slow", Message(), timeout=0.3)
    # A call after it on the same link is answered once the server has read the request and
    # its cancellation: the handler either ran and is cancelled, or (on a machine so loaded that
    # both came in one read) was cancelled before it ever ran. It never runs on.
    await b.call(a.peer_id, "echo", Message(), timeout=60)
    await asyncio.sleep(0)
    if started.is_set():
        async with asyncio.timeout(60):  # (a safety net)
            await cancelled.wait()

    started.clear()
    cancelled.clear()
    task = asyncio.create_task(b.call(a.peer_id, "slow", Message(), timeout=120))
    async with asyncio.timeout(60):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(60):
        await cancelled.wait()
    assert (await b.call(a.peer_id, "echo", Message({"k": 2}), timeout=5)).header["k"] == 2


async def test_big_stream_does_not_block_small_calls(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    total = 64 * MiB
    received = 0
    first = asyncio.Event()

    async def sink(ctx: RequestContext, stream: LinkStream) -> None:
        nonlocal received
        while (message := await stream.receive(timeout=10)) is not None:
            received += len(message.payload)
            first.set()
        await stream.send(Message({"n": received}), timeout=10)

    a.add_stream_handler("sink", sink)
    stream = await b.open_stream(a.peer_id, "sink", {"what": "bulk"}, timeout=5)
    chunk = bytes(4 * MiB)

    async def push() -> None:
        for _ in range(total // len(chunk)):
            await stream.send(Message({}, chunk), timeout=10)
        await stream.close()

    pusher = asyncio.create_task(push())
    async with asyncio.timeout(10):
        await first.wait()
    progress = []

    async def small(i: int) -> None:
        reply = await b.call(a.peer_id, "echo", Message({"i": i}, b"x" * 100), timeout=5)
        assert reply.header["i"] == i
        progress.append(received)

    await asyncio.gather(*(small(i) for i in range(20)))
    # every small call came back while the stream was still under way
    assert len(progress) == 20 and max(progress) < total
    await pusher
    final = await stream.receive(timeout=10)
    assert final is not None and final.header == {"n": total}
    assert await stream.receive(timeout=5) is None


async def test_big_reply_does_not_block_small_calls(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    replying = asyncio.Event()

    async def big(ctx: RequestContext, message: Message) -> Message:
        replying.set()
        return Message({}, bytes(96 * MiB))

    a.add_unary_handler("big", big)
    big_call = asyncio.create_task(b.call(a.peer_id, "big", Message(), timeout=30))
    async with asyncio.timeout(5):
        await replying.wait()
    await b.call(a.peer_id, "echo", Message(), timeout=5)
    assert not big_call.done()
    assert len((await big_call).payload) == 96 * MiB


async def test_slow_consumer_bounds_what_is_in_flight(make_transport: Any) -> None:
    window = 4 * MiB
    limits = TransportLimits(handshake_timeout=1.0, link=LinkLimits(stream_window=window))
    a, b = await pair(make_transport, limits=limits)
    release = asyncio.Event()
    got: list[int] = []

    async def slow_sink(ctx: RequestContext, stream: LinkStream) -> None:
        message = await stream.receive(timeout=10)
        assert message is not None
        got.append(len(message.payload))
        async with asyncio.timeout(20):
            await release.wait()
        while (message := await stream.receive(timeout=10)) is not None:
            got.append(len(message.payload))
        await stream.send(Message({"done": len(got)}), timeout=10)

    a.add_stream_handler("slow", slow_sink)
    stream = await b.open_stream(a.peer_id, "slow", {}, timeout=5)
    sent = 0
    with pytest.raises(CallTimeout):
        for _ in range(40):
            await stream.send(Message({}, bytes(MiB)), timeout=0.5)
            sent += 1
    # the window (4 MiB) plus the one credit the consumer returned after its first message
    assert sent == window // MiB + 1
    server_link = next(iter(a._all_links))  # the receiving side holds at most one window
    assert server_link._pending_in <= window
    release.set()
    await stream.send(Message({}, bytes(MiB)), timeout=10)
    await stream.close()
    done = await stream.receive(timeout=10)
    assert done is not None and done.header == {"done": sent + 1}


async def test_receive_into_a_caller_buffer(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    payload = os.urandom(5 * MiB + 3)
    result: dict[str, Any] = {}

    async def into(ctx: RequestContext, stream: LinkStream) -> None:
        buffer = bytearray(8 * MiB)
        message = await stream.receive_into(buffer, timeout=10)
        assert message is not None
        result["same"] = memoryview(message.payload).obj is buffer
        result["data"] = bytes(message.payload)
        result["header"] = stream.header
        small = bytearray(10)
        with pytest.raises(LimitExceeded):
            await stream.receive_into(small, timeout=10)

    a.add_stream_handler("into", into)
    stream = await b.open_stream(a.peer_id, "into", {"shape": [5]}, timeout=5)
    await stream.send(Message({}, payload), timeout=10)
    await stream.send(Message({}, b"y" * 100), timeout=10)
    with pytest.raises(StreamAborted):
        await stream.receive(timeout=10)
    assert result == {"same": True, "data": payload, "header": {"shape": [5]}}


async def test_stream_open_limit_refuses_with_a_clear_error(make_transport: Any) -> None:
    limits = TransportLimits(handshake_timeout=1.0, link=LinkLimits(max_streams=2))
    a, b = await pair(make_transport, limits=limits)
    hold = asyncio.Event()

    async def held(ctx: RequestContext, stream: LinkStream) -> None:
        async with asyncio.timeout(20):
            await hold.wait()

    a.add_stream_handler("held", held)
    s1 = await b.open_stream(a.peer_id, "held", {}, timeout=5)
    s2 = await b.open_stream(a.peer_id, "held", {}, timeout=5)
    with pytest.raises(LimitExceeded, match="too many open"):
        await b.open_stream(a.peer_id, "held", {}, timeout=5)
    assert a.counters()["streams_refused"] == 1
    hold.set()
    for s in (s1, s2):
        await s.close()


async def test_simultaneous_dial_keeps_one_link(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    a.learn_addresses(b.peer_id, b.listen_addresses())
    for round_ in range(1, 4):
        await asyncio.gather(a.connect(b.listen_addresses()[0], timeout=5),
                             b.connect(a.listen_addresses()[0], timeout=5))
        await wait_until(
            lambda r=round_: a.counters()["links_opened"] == b.counters()["links_opened"] == 2 * r)
        await wait_until(lambda: len(a.links()) == 1 and len(b.links()) == 1)
        # both kept the same link: the one the smaller peer id dialed
        smaller = min(a.peer_id, b.peer_id)
        assert a.links()[0].outbound == (a.peer_id == smaller)
        assert b.links()[0].outbound == (b.peer_id == smaller)
        await a.call(b.peer_id, "echo", Message(), timeout=5)
        await b.call(a.peer_id, "echo", Message(), timeout=5)
        for link in list(a._all_links):
            await link.close("next round")
        await wait_until(lambda: not a.links() and not b.links())


async def test_close_fails_pending_calls_and_leaks_nothing() -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    tasks_before = asyncio.all_tasks()
    a = await TlsTransport.start(Identity.generate(), [LOOPBACK], limits=FAST)
    b = await TlsTransport.start(Identity.generate(), [LOOPBACK], limits=FAST)
    c = await TlsTransport.start(Identity.generate(), [LOOPBACK], limits=FAST)

    async def hang(ctx: RequestContext, message: Message) -> Message:
        await asyncio.sleep(60)
        return Message()

    async def hang_stream(ctx: RequestContext, stream: LinkStream) -> None:
        await stream.receive(timeout=60)

    for t in (a, b):
        t.add_unary_handler("hang", hang)
        t.add_stream_handler("hang", hang_stream)
    b.learn_addresses(a.peer_id, a.listen_addresses())
    c.learn_addresses(a.peer_id, a.listen_addresses())
    pending = asyncio.create_task(b.call(a.peer_id, "hang", Message(), timeout=30))
    remote_pending = asyncio.create_task(c.call(a.peer_id, "hang", Message(), timeout=30))
    stream = await b.open_stream(a.peer_id, "hang", {}, timeout=5)
    await wait_until(lambda: len(a.links()) == 2)
    await b.close()
    with pytest.raises(TransportClosed):
        await pending
    with pytest.raises(TransportClosed):
        await stream.receive(timeout=5)
    with pytest.raises(TransportClosed):
        await b.call(a.peer_id, "hang", Message(), timeout=5)
    await a.close()  # c's call was pending at a: the link went away under it
    with pytest.raises(TransportClosed):
        await remote_pending
    await c.close()
    await wait_until(lambda: asyncio.all_tasks() <= tasks_before | {asyncio.current_task()})
    assert len(os.listdir("/proc/self/fd")) == fds_before


async def test_probe_and_announced_addresses(make_transport: Any) -> None:
    a, b = await pair(make_transport)
    assert await b.probe(a.listen_addresses()[0], timeout=5) == a.peer_id
    assert not b.links()  # a probe never keeps a link
    a.set_announced([PeerAddress.parse("/ip4/127.0.0.1/tcp/9")])
    assert a.listen_addresses() == [PeerAddress.parse(f"/ip4/127.0.0.1/tcp/9/p2p/{a.peer_id}")]
    assert a.bound_addresses()[0].port != 9
    c = await make_transport()
    await c.connect(a.bound_addresses()[0], timeout=5)
    assert PeerAddress.parse(f"/ip4/127.0.0.1/tcp/9/p2p/{a.peer_id}") in c.known_addresses(a.peer_id)
    with pytest.raises(PeerUnreachableError):
        await c.probe(PeerAddress.parse(f"/ip4/127.0.0.1/tcp/9/p2p/{a.peer_id}"), timeout=2)


async def test_a_refused_address_is_forgotten_and_hearsay_never_jumps_the_queue(make_transport: Any) -> None:
    """A restarted peer listens on a new port: its old address (refused) is dropped from the
    book, and the old address repeated by others (second hand) goes after the peer's own word."""
    a, b = await make_transport(), await make_transport()
    (new,) = b.listen_addresses()
    old = PeerAddress.parse(f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{b.peer_id}")
    a.learn_addresses(b.peer_id, [old])
    with pytest.raises(PeerUnreachableError):
        await a.call(b.peer_id, "x", Message({}), timeout=5)
    assert a.known_addresses(b.peer_id) == []
    assert a.counters()["addresses_forgotten"] == 1
    a.learn_addresses(b.peer_id, [new])
    a.learn_addresses(b.peer_id, [old], first_hand=False)
    assert a.known_addresses(b.peer_id) == [new.with_peer(b.peer_id), old]


def _free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_request_header_that_cannot_be_encoded_fails_its_call_and_leaves_none_open(
        make_transport: Any) -> None:
    # (registered before its header was encoded, such a call stayed open for the link's life: a
    # draining link then waited its whole grace to close)
    a, b = await pair(make_transport, tls=False)
    try:
        assert await b.connect(a.listen_addresses()[0], timeout=60) == a.peer_id
        with pytest.raises(TypeError):
            await b.call(a.peer_id, "echo", Message({"x": object()}, b""), timeout=60)
        (link,) = b._links[a.peer_id]
        assert link.active() == 0
        reply = await b.call(a.peer_id, "echo", Message({"x": 1}, b"ok"), timeout=60)
        assert bytes(reply.payload) == b"ok"  # the link is fine
    finally:
        await b.close()
        await a.close()
