"""The simulated internet carries the daemon's real links: latency, bandwidth and partitions as
configured, on virtual time."""

from __future__ import annotations

import asyncio

import pytest

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext, TransportError
from dedloc.sim.network import LinkProfile, SimNetwork, SimTransport

pytestmark = pytest.mark.virtual_time

LATENCY = 0.05  # one way, each host to the core
UPLOAD = 1e6  # bytes per second


async def _pair() -> tuple[SimNetwork, SimTransport, SimTransport]:
    network = SimNetwork()
    profile = LinkProfile(upload=UPLOAD, download=10 * UPLOAD, latency=LATENCY)
    a = SimTransport.start_on(network, network.add_host(profile), Identity.from_seed(b"a" * 32))
    b = SimTransport.start_on(network, network.add_host(profile), Identity.from_seed(b"b" * 32))

    async def echo(ctx: RequestContext, message: Message) -> Message:
        return Message({"from": ctx.peer_id, "bytes": len(message.payload)})

    b.add_unary_handler("echo", echo)
    a.learn_addresses(b.peer_id, b.listen_addresses())
    return network, a, b


async def test_a_call_takes_the_round_trips_of_its_hosts_latency() -> None:
    _, a, b = await _pair()
    loop = asyncio.get_running_loop()
    try:
        await a.call(b.peer_id, "echo", Message(), timeout=10)  # dial and handshake first
        begin = loop.time()
        reply = await a.call(b.peer_id, "echo", Message(), timeout=10)
        elapsed = loop.time() - begin
    finally:
        await a.close()
        await b.close()
    assert reply.header["from"] == a.peer_id  # the callee knows who called: the handshake ran
    assert elapsed == pytest.approx(4 * LATENCY, rel=0.05)  # there and back, 2 hops each way


async def test_a_large_message_takes_its_size_over_the_senders_uplink() -> None:
    _, a, b = await _pair()
    loop = asyncio.get_running_loop()
    size = 4_000_000
    try:
        await a.call(b.peer_id, "echo", Message(), timeout=10)
        begin = loop.time()
        reply = await a.call(b.peer_id, "echo", Message(payload=bytes(size)), timeout=60)
        elapsed = loop.time() - begin
    finally:
        await a.close()
        await b.close()
    assert reply.header["bytes"] == size
    # the uplink is the bottleneck: 4 s for the bytes, plus latency and framing
    assert size / UPLOAD <= elapsed <= 1.2 * size / UPLOAD + 1.0


async def test_a_partition_holds_the_bytes_and_a_heal_lets_them_through() -> None:
    network, a, b = await _pair()
    try:
        await a.call(b.peer_id, "echo", Message(), timeout=10)
        network.partition({a.host.index}, {b.host.index})
        with pytest.raises((TimeoutError, TransportError)):
            await a.call(b.peer_id, "echo", Message(), timeout=2)
        network.heal()
        reply = await a.call(b.peer_id, "echo", Message(), timeout=60)
    finally:
        await a.close()
        await b.close()
    assert reply.header["from"] == a.peer_id


async def test_a_silenced_host_cannot_be_dialed_until_restored() -> None:
    network, a, b = await _pair()
    try:
        network.silence(b.host)
        with pytest.raises((TimeoutError, TransportError)):
            await a.call(b.peer_id, "echo", Message(), timeout=3)
        network.restore(b.host)
        reply = await a.call(b.peer_id, "echo", Message(), timeout=60)
    finally:
        await a.close()
        await b.close()
    assert reply.header["from"] == a.peer_id


async def test_a_stopped_host_refuses_connections() -> None:
    _, a, b = await _pair()
    await b.close()
    try:
        with pytest.raises(TransportError):
            await a.call(b.peer_id, "echo", Message(), timeout=10)
    finally:
        await a.close()
