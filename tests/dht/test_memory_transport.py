"""The in-memory transport keeps the unary-call semantics of the real one."""

from __future__ import annotations

import asyncio

import pytest

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    CallTimeout,
    LimitExceeded,
    Message,
    PeerIdMismatchError,
    PeerUnreachableError,
    RemoteError,
    RequestContext,
    TransportClosed,
    TransportError,
    UnknownMethod,
)
from dedloc.daemon.net.memory import MemoryNetwork, MemoryTransport


def pair(network: MemoryNetwork) -> tuple[MemoryTransport, MemoryTransport]:
    a = network.transport(Identity.generate().peer_id)
    b = network.transport(Identity.generate().peer_id)
    return a, b


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message({"from": ctx.peer_id, **message.header}, bytes(message.payload) * 2)


async def test_call_and_connect() -> None:
    network = MemoryNetwork()
    a, b = pair(network)
    b.add_unary_handler("echo", echo)
    with pytest.raises(PeerUnreachableError):  # nothing known about b yet
        await a.call(b.peer_id, "echo", Message(), timeout=1)
    assert await a.connect(b.listen_addresses()[0], timeout=1) == b.peer_id
    reply = await a.call(b.peer_id, "echo", Message({"x": 1}, b"ab"), timeout=1)
    assert reply == Message({"from": a.peer_id, "x": 1}, b"abab")
    with pytest.raises(PeerIdMismatchError):
        await a.connect(b.listen_addresses()[0].with_peer(a.peer_id), timeout=1)
    # b can call back over the link a opened
    a.add_unary_handler("echo", echo)
    assert (await b.call(a.peer_id, "echo", Message(), timeout=1)).header["from"] == b.peer_id


async def test_errors() -> None:
    network = MemoryNetwork(max_message_bytes=1000)
    a, b = pair(network)
    a.learn_addresses(b.peer_id, b.listen_addresses())

    async def fail(ctx: RequestContext, message: Message) -> Message:
        raise KeyError("nope")

    async def hang(ctx: RequestContext, message: Message) -> Message:
        await asyncio.sleep(3600)
        raise AssertionError

    b.add_unary_handler("fail", fail)
    b.add_unary_handler("hang", hang)
    with pytest.raises(RemoteError) as info:
        await a.call(b.peer_id, "fail", Message(), timeout=1)
    assert info.value.kind == "KeyError"
    with pytest.raises(UnknownMethod):
        await a.call(b.peer_id, "missing", Message(), timeout=1)
    with pytest.raises(CallTimeout):
        await a.call(b.peer_id, "hang", Message(), timeout=0.01)
    with pytest.raises(LimitExceeded):
        await a.call(b.peer_id, "fail", Message({}, b"x" * 2000), timeout=1)
    with pytest.raises(TypeError):  # headers must be JSON-able
        await a.call(b.peer_id, "fail", Message({"x": object()}), timeout=1)
    with pytest.raises(TransportError, match="streams not supported"):
        await a.open_stream(b.peer_id, "s", {}, timeout=1)


async def test_faults_and_close() -> None:
    network = MemoryNetwork()
    a, b = pair(network)
    b.add_unary_handler("echo", echo)
    a.learn_addresses(b.peer_id, b.listen_addresses())
    network.set_down(b.peer_id)
    with pytest.raises(PeerUnreachableError):
        await a.call(b.peer_id, "echo", Message(), timeout=1)
    network.restore(b.peer_id)
    network.blackhole(b.peer_id)
    with pytest.raises(CallTimeout):
        await a.call(b.peer_id, "echo", Message(), timeout=0.01)
    network.restore(b.peer_id)
    network.partition({a.peer_id}, {b.peer_id})
    with pytest.raises(PeerUnreachableError):
        await a.call(b.peer_id, "echo", Message(), timeout=1)
    network.heal()
    await a.call(b.peer_id, "echo", Message(), timeout=1)

    started = asyncio.Event()

    async def hang(ctx: RequestContext, message: Message) -> Message:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError

    b.add_unary_handler("hang", hang)
    pending = asyncio.create_task(a.call(b.peer_id, "hang", Message(), timeout=10))
    await started.wait()
    await b.close()  # the server goes away: the caller's pending call fails at once
    with pytest.raises(TransportClosed):
        await pending
    with pytest.raises(PeerUnreachableError):
        await a.call(b.peer_id, "echo", Message(), timeout=1)
    await a.close()
    with pytest.raises(TransportClosed):
        await a.call(b.peer_id, "echo", Message(), timeout=1)
