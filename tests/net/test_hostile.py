"""Impersonators, relays and hostile clients on the listening port; honest calls keep working."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import Any

import pytest
from net.netutil import wait_until

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    HandshakeError,
    Message,
    PeerAddress,
    PeerIdMismatchError,
    RequestContext,
    TlsTransport,
    TransportClosed,
)
from dedloc.daemon.net.frames import PREFIX, FrameType, encode_head
from dedloc.daemon.net.handshake import client_handshake
from dedloc.daemon.net.tls import Certificate, client_context, client_hello, server_context


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message(message.header, bytes(message.payload))


def port_of(transport: TlsTransport) -> int:
    return transport.listen_addresses()[0].port


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> None:
    """Until the server drops us (EOF or reset: either is a close)."""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass


async def test_dialing_the_wrong_peer_is_a_mismatch(make_transport: Any) -> None:
    a, b, c = await make_transport(), await make_transport(), await make_transport()
    lying = PeerAddress.parse(f"/ip4/127.0.0.1/tcp/{port_of(b)}/p2p/{a.peer_id}")
    with pytest.raises(PeerIdMismatchError) as info:
        await c.connect(lying, timeout=5)
    assert a.peer_id in str(info.value) and b.peer_id in str(info.value)
    assert c.counters()["peer_id_mismatches"] == 1
    assert not c.links()


async def test_a_relay_replaying_the_real_hello_is_refused(make_transport: Any) -> None:
    """A MITM terminates TLS with its own certificate and forwards the real server's hello."""
    b, c = await make_transport(), await make_transport()
    relay_ctx = server_context(Certificate.generate())
    writers: list[asyncio.StreamWriter] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port_of(b), ssl=client_context())
        writers.append(up_writer)
        prefix = await up_reader.readexactly(PREFIX.size)
        header = await up_reader.readexactly(PREFIX.unpack(prefix)[3])
        writer.write(prefix + header)  # the real hello, signed over b's certificate
        await writer.drain()
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.read(100)

    server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=relay_ctx)
    relay_port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(HandshakeError, match="not signed over the TLS certificate"):
            await c.connect(PeerAddress.parse(f"/ip4/127.0.0.1/tcp/{relay_port}/p2p/{b.peer_id}"),
                            timeout=5)
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
    assert not c.links()


async def test_a_client_hello_over_another_certificate_is_refused(make_transport: Any) -> None:
    b = await make_transport()
    intruder = Identity.generate()
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(b), ssl=client_context())
    try:
        prefix = await reader.readexactly(PREFIX.size)
        import orjson
        hello = orjson.loads(await reader.readexactly(PREFIX.unpack(prefix)[3]))
        nonce = bytes.fromhex(hello["nonce"])
        forged = client_hello(intruder, Certificate.generate().sha256, nonce, [])
        writer.write(encode_head(FrameType.HELLO, 0, forged, 0))
        await read_until_closed(reader)
    finally:
        writer.close()
    await wait_until(lambda: b.counters()["handshake_failures"] == 1)
    assert not b.links()


async def _raw_connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def _client_hello_bytes() -> bytes:
    """The first flight of a real TLS 1.3 client, to send only part of it."""
    context = client_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def garbage(port: int) -> None:
    reader, writer = await _raw_connect(port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
    await writer.drain()
    await read_until_closed(reader)
    writer.close()


async def silent(port: int) -> None:
    reader, writer = await _raw_connect(port)
    await read_until_closed(reader)  # dropped at the handshake deadline
    writer.close()


async def half_tls(port: int) -> None:
    reader, writer = await _raw_connect(port)
    flight = _client_hello_bytes()
    writer.write(flight[: len(flight) // 2])
    await writer.drain()
    await read_until_closed(reader)
    writer.close()


async def slowloris(port: int) -> None:
    """One byte of a real ClientHello every 0.2 s: still dropped at the 1 s deadline."""
    reader, writer = await _raw_connect(port)
    flight = _client_hello_bytes()
    closed = asyncio.create_task(read_until_closed(reader))
    try:
        for byte in flight:
            if closed.done():
                break
            writer.write(bytes([byte]))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.wait([closed], timeout=0.2)
        await closed
    finally:
        closed.cancel()
        writer.close()


async def oversize_frame(port: int, server_id: str) -> None:
    """A valid handshake, then a frame announcing a payload over the limit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    done = await client_handshake(sock, Identity.generate(), client_context(), server_id, [])
    try:
        await done.io.send_all([PREFIX.pack(FrameType.REQUEST, 0, 1, 0, 2**31)])
        buffer = memoryview(bytearray(4096))
        async with asyncio.timeout(5):
            with contextlib.suppress(TransportClosed):
                while await done.io.recv_into(buffer):
                    pass
    finally:
        done.io.close()


async def test_hostile_clients_are_dropped_while_honest_calls_go_on(make_transport: Any) -> None:
    server, honest = await make_transport(), await make_transport()
    server.add_unary_handler("echo", echo)
    honest.learn_addresses(server.peer_id, server.listen_addresses())
    port = port_of(server)
    answered = 0
    stop = asyncio.Event()

    async def keep_calling() -> None:
        nonlocal answered
        while not stop.is_set():
            reply = await honest.call(server.peer_id, "echo", Message({"n": answered}), timeout=2)
            assert reply.header == {"n": answered}
            answered += 1
            await asyncio.sleep(0.01)

    caller = asyncio.create_task(keep_calling())
    await wait_until(lambda: answered > 0)
    await asyncio.gather(garbage(port), silent(port), half_tls(port), slowloris(port),
                         oversize_frame(port, server.peer_id))
    stop.set()
    await caller
    counters = server.counters()
    assert counters["handshake_failures"] == 4  # garbage, silent, half TLS, slowloris
    assert counters["protocol_violations"] == 1  # the oversize frame
    assert answered > 10
    # the honest link is the only one left
    assert [info.peer_id for info in server.links()] == [honest.peer_id]


async def test_too_many_handshakes_are_refused(make_transport: Any) -> None:
    from dedloc.daemon.net import TransportLimits
    server = await make_transport(limits=TransportLimits(handshake_timeout=1.0, max_handshakes=2))
    port = port_of(server)
    held = [await _raw_connect(port) for _ in range(2)]
    await wait_until(lambda: server.counters()["connections_accepted"] == 2)
    reader, writer = await _raw_connect(port)
    await read_until_closed(reader)
    writer.close()
    assert server.counters()["connections_refused"] == 1
    for r, w in held:
        await read_until_closed(r)
        w.close()


async def test_one_source_holds_a_few_handshake_slots_only(make_transport: Any) -> None:
    """Silent connections from one address take at most max_handshakes_per_source slots: a
    further one from there is refused at once, while another address still gets a slot."""
    from dedloc.daemon.net import TransportLimits
    server = await make_transport(limits=TransportLimits(
        handshake_timeout=30.0, max_handshakes=64, max_handshakes_per_source=3, limit_loopback=True))
    port = port_of(server)
    held = [await _raw_connect(port) for _ in range(3)]
    await wait_until(lambda: server.counters()["connections_accepted"] == 3)
    reader, writer = await _raw_connect(port)  # a fourth from 127.0.0.1
    await read_until_closed(reader)
    writer.close()
    assert server.counters()["connections_refused_per_source"] == 1
    other = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
    await wait_until(lambda: server.counters()["connections_accepted"] == 5)
    assert server.counters()["connections_refused_per_source"] == 1  # another source: let in
    for _, w in [*held, other]:
        w.close()


async def test_a_source_holding_fewer_takes_over_the_oldest_slot_of_the_one_holding_most(
        make_transport: Any) -> None:
    """Every slot held by silent connections from two addresses: a third address, and then an
    honest peer, each take over the oldest slot of the source holding the most, and the honest
    peer's call is answered; a source already holding the most is refused."""
    from dedloc.daemon.net import TransportLimits
    server = await make_transport(limits=TransportLimits(
        handshake_timeout=120.0, max_handshakes=4, max_handshakes_per_source=3,
        handshake_evict_after=0.0, limit_loopback=True))  # (the age floor: test_admission.py)
    server.add_unary_handler("echo", echo)
    port = port_of(server)

    async def silent_from(host: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        accepted = server.counters()["connections_accepted"]
        connection = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
        await wait_until(lambda: server.counters()["connections_accepted"] > accepted, 60)
        return connection  # (taken by the server, in order: the slots' age is this order)

    two = [await silent_from("127.0.0.2") for _ in range(2)]
    three = [await silent_from("127.0.0.3") for _ in range(2)]
    await wait_until(lambda: server.counters()["connections_accepted"] == 4, 60)
    # 127.0.0.2 holds as many as the most: no slot is taken from anyone for it
    refused = await silent_from("127.0.0.2")
    await read_until_closed(refused[0], timeout=60)
    assert server.counters()["connections_refused"] == 1
    assert server.counters()["handshakes_evicted"] == 0
    # 127.0.0.4 holds none: it takes the oldest slot of the two tied, 127.0.0.2's first
    four = await silent_from("127.0.0.4")
    await read_until_closed(two[0][0], timeout=60)
    assert server.counters()["handshakes_evicted"] == 1
    # an honest peer (from 127.0.0.1) takes 127.0.0.3's oldest and completes its handshake
    honest = await make_transport()
    honest.learn_addresses(server.peer_id, server.listen_addresses())
    reply = await honest.call(server.peer_id, "echo", Message({"n": 7}), timeout=60)
    assert reply.header == {"n": 7}
    await read_until_closed(three[0][0], timeout=60)
    assert server.counters()["handshakes_evicted"] == 2
    assert [info.peer_id for info in server.links()] == [honest.peer_id]
    for _, w in [*two, *three, four, refused]:
        w.close()
