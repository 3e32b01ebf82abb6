"""The STUN responder (daemon/net/stun.py), on 127.0.0.1 only: aioice's client gets its own address
back; junk, floods and other STUN traffic are dropped and counted, and answering goes on."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, cast

import pytest
import support
from aioice import stun
from hypothesis import given
from hypothesis import strategies as st
from net.netutil import wait_until

from dedloc.daemon.config import build_config
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import PeerAddress, TransportError
from dedloc.daemon.net.stun import (
    MAX_GROWTH,
    StunLimits,
    StunResponder,
    ice_servers_from,
    stun_address,
)
from dedloc.daemon.network import PeerNetwork

HOST = "127.0.0.1"
OTHER_HOST = "127.0.0.2"  # another source address, still on the loopback network


class StunClient(asyncio.DatagramProtocol):
    """A UDP socket that runs aioice STUN transactions (with their retransmissions) and keeps
    every datagram it gets."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.transactions: dict[bytes, stun.Transaction] = {}
        self.received: list[bytes] = []

    @classmethod
    async def open(cls, host: str = HOST) -> StunClient:
        client = cls()
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: client, local_addr=(host, 0))
        return client

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return host, port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.received.append(data)
        try:
            message = stun.parse_message(data)
        except ValueError:
            return
        transaction = self.transactions.get(message.transaction_id)
        if transaction is not None:
            transaction.response_received(message, (addr[0], addr[1]))

    # aioice's TransactionSender
    def send_stun(self, message: stun.Message, addr: tuple[str, int]) -> None:
        self.send(bytes(message), addr)

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        if not data:  # asyncio's transport skips empty datagrams: send it from another socket
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as plain:
                plain.sendto(data, addr)
            return
        assert self.transport is not None
        self.transport.sendto(data, addr)

    async def request(self, request: stun.Message, addr: tuple[str, int],
                      retransmissions: int = 3) -> stun.Message:
        transaction = stun.Transaction(request, addr, self, retransmissions=retransmissions)
        self.transactions[request.transaction_id] = transaction
        try:
            response, _ = await transaction.run()
        finally:
            del self.transactions[request.transaction_id]
        return response

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class FrozenClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def send_all(client: StunClient, datagrams: list[bytes], responder: StunResponder) -> None:
    """Send in small batches, each seen by the responder before the next (a burst could
    overflow a socket buffer on the way and make the counts flaky)."""
    for start in range(0, len(datagrams), 20):
        expected = responder.counters()["stun_requests"] + len(datagrams[start:start + 20])
        for data in datagrams[start:start + 20]:
            client.send(data, (HOST, responder.bound_port))
        await wait_until(lambda expected=expected: responder.counters()["stun_requests"] == expected)


def binding_request(*, fingerprint: bool = False) -> stun.Message:
    request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
    if fingerprint:
        request.add_fingerprint()
    return request


@pytest.fixture
async def responder() -> Any:
    made = await StunResponder.start(HOST)
    yield made
    made.close()


@pytest.fixture
async def make_client() -> Any:
    made: list[StunClient] = []

    async def make(host: str = HOST) -> StunClient:
        client = await StunClient.open(host)  # all of 127.0.0.0/8 is local on Linux
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


async def test_aioice_client_learns_its_own_address(responder: StunResponder, make_client: Any) -> None:
    client = await make_client()
    server = (HOST, responder.bound_port)
    request = binding_request()
    response = await client.request(request, server)
    assert response.message_method == stun.Method.BINDING
    assert response.message_class == stun.Class.RESPONSE
    assert response.transaction_id == request.transaction_id
    assert response.attributes["XOR-MAPPED-ADDRESS"] == client.address
    assert response.attributes["MAPPED-ADDRESS"] == client.address
    assert "FINGERPRINT" not in response.attributes
    assert len(client.received[-1]) <= len(bytes(request)) + MAX_GROWTH
    counters = responder.counters()
    assert counters["stun_answered"] >= 1
    assert counters["stun_malformed"] == counters["stun_ignored"] == counters["stun_rate_limited"] == 0


async def test_fingerprint_answered_with_fingerprint(responder: StunResponder, make_client: Any) -> None:
    client = await make_client()
    server = (HOST, responder.bound_port)
    request = binding_request(fingerprint=True)
    response = await client.request(request, server)
    # parse_message has checked the fingerprint's CRC; it is the last attribute.
    assert "FINGERPRINT" in response.attributes
    assert list(response.attributes)[-1] == "FINGERPRINT"
    assert response.attributes["XOR-MAPPED-ADDRESS"] == client.address
    assert len(client.received[-1]) <= len(bytes(request)) + MAX_GROWTH

    # A request whose fingerprint is wrong is dropped.
    bad = bytearray(bytes(binding_request(fingerprint=True)))
    bad[-1] ^= 0xFF
    before = responder.counters()["stun_malformed"]
    client.send(bytes(bad), server)
    await wait_until(lambda: responder.counters()["stun_malformed"] == before + 1)


def _header(message_type: int, length: int, cookie: int = stun.COOKIE) -> bytes:
    return struct.pack("!HHI12s", message_type, length, cookie, b"\x07" * 12)


async def test_junk_is_dropped_and_counted(responder: StunResponder, make_client: Any) -> None:
    client = await make_client()
    server = (HOST, responder.bound_port)
    good = bytes(binding_request())
    malformed = [
        b"",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        good[:10],                                          # truncated header
        good[:19],                                          # not a whole header
        _header(0x0001, 0, cookie=0x01020304),              # no magic cookie (RFC 3489)
        _header(0x0001, 8),                                 # length says 8, nothing follows
        _header(0x0001, 2) + b"\x00\x00",                   # length not a multiple of 4
        b"\xc0" + good[1:],                                 # first two bits set
        _header(0x0001, 8) + struct.pack("!HHI", 0x8028, 4, 12345),  # wrong FINGERPRINT
        _header(0x0001, 8) + struct.pack("!HH", 0x8028, 2) + b"\x00\x00",  # truncated attribute
        _header(0x0001, 8) + struct.pack("!HH", 0x0006, 2) + b"\xff\xfe\x00\x00",  # bad USERNAME
        _header(0x0005, 0),                                 # unknown method
        _header(0x0001, 9000 - 20) + bytes(9000 - 20),      # a 9000-byte datagram
        _header(0x0001, 1484) + bytes(1484),                # 1504 bytes: just over the limit
    ]
    ignored = [
        bytes(stun.Message(stun.Method.BINDING, stun.Class.RESPONSE,
                           attributes={"XOR-MAPPED-ADDRESS": ("198.51.100.7", 9)})),
        bytes(stun.Message(stun.Method.BINDING, stun.Class.ERROR, attributes={"ERROR-CODE": (400, "x")})),
        bytes(stun.Message(stun.Method.BINDING, stun.Class.INDICATION)),
        bytes(stun.Message(stun.Method.ALLOCATE, stun.Class.REQUEST)),
        bytes(stun.Message(stun.Method.SEND, stun.Class.INDICATION, attributes={"DATA": b"x" * 40})),
    ]
    await send_all(client, malformed + ignored, responder)
    total = len(malformed) + len(ignored)
    assert responder.counters() == {"stun_requests": total, "stun_answered": 0,
                                    "stun_malformed": len(malformed), "stun_ignored": len(ignored),
                                    "stun_rate_limited": 0}

    request = binding_request()
    response = await client.request(request, server)
    assert response.transaction_id == request.transaction_id
    assert response.attributes["XOR-MAPPED-ADDRESS"] == client.address
    # Nothing but the answer to the good request ever came back.
    assert all(stun.parse_message(d).transaction_id == request.transaction_id for d in client.received)
    assert responder.counters()["stun_answered"] >= 1


async def test_a_flood_from_one_source_is_limited_and_others_still_answered(make_client: Any) -> None:
    clock = FrozenClock()
    responder = await StunResponder.start(HOST, limits=StunLimits(rate=50, burst=100), clock=clock)
    try:
        server = (HOST, responder.bound_port)
        flooder = await make_client()
        requests = [binding_request() for _ in range(150)]
        await send_all(flooder, [bytes(r) for r in requests], responder)
        assert responder.counters()["stun_answered"] == 100
        assert responder.counters()["stun_rate_limited"] == 50
        await wait_until(lambda: len(flooder.received) == 100)
        answered = {stun.parse_message(d).transaction_id for d in flooder.received}
        assert answered == {r.transaction_id for r in requests[:100]}

        # Another source is not limited (same host but another address).
        other = await make_client(OTHER_HOST)
        response = await other.request(binding_request(), server, retransmissions=0)
        assert response.attributes["XOR-MAPPED-ADDRESS"] == other.address
        # The flooder's other ports share its limit ...
        flooder_too = await make_client()
        flooder_too.send(bytes(binding_request()), server)
        await wait_until(lambda: responder.counters()["stun_rate_limited"] == 51)
        # ... which refills with time: 50 a second.
        clock.now += 1.0
        await send_all(flooder, [bytes(binding_request()) for _ in range(60)], responder)
        assert responder.counters()["stun_requests"] == 150 + 1 + 1 + 60
        assert responder.counters()["stun_answered"] == 100 + 1 + 50
        assert responder.counters()["stun_rate_limited"] == 51 + 10
    finally:
        responder.close()


async def test_all_sources_together_are_limited_too(make_client: Any) -> None:
    responder = await StunResponder.start(
        HOST, limits=StunLimits(rate=50, burst=100, total_rate=1, total_burst=3), clock=FrozenClock())
    try:
        server = (HOST, responder.bound_port)
        one, two = await make_client(), await make_client(OTHER_HOST)
        for _ in range(3):
            one.send(bytes(binding_request()), server)
            two.send(bytes(binding_request()), server)
        await wait_until(lambda: responder.counters()["stun_requests"] == 6)
        assert responder.counters()["stun_answered"] == 3
        assert responder.counters()["stun_rate_limited"] == 3
    finally:
        responder.close()


async def test_many_sources_are_remembered_in_bounded_memory() -> None:
    responder = StunResponder(StunLimits(max_sources=8), clock=FrozenClock())
    for i in range(100):
        assert responder._allow(f"10.0.{i // 256}.{i % 256}")
    assert len(responder._sources) == 8


class RecordingTransport(asyncio.DatagramTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[bytes, Any]] = []

    def sendto(self, data: Any, addr: Any = None) -> None:
        self.sent.append((bytes(data), addr))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (HOST, 3478) if name == "sockname" else default


_ATTRIBUTE = st.tuples(
    st.sampled_from([0x0001, 0x0006, 0x0008, 0x0009, 0x0014, 0x0020, 0x0024, 0x0025, 0x8022,
                     0x8028, 0x8029, 0x802B, 0x7777, 0xC001]),
    st.binary(max_size=40))


def _raw_attributes(attributes: list[tuple[int, bytes]]) -> bytes:
    data = b""
    for kind, value in attributes:
        data += struct.pack("!HH", kind, len(value)) + value + bytes(-len(value) % 4)
    return data


@given(st.one_of(
    st.binary(max_size=1600),
    st.tuples(st.sampled_from([0x0001, 0x0011, 0x0101, 0x0003]), st.lists(_ATTRIBUTE, max_size=6))
    .map(lambda t: _header(t[0], len(_raw_attributes(t[1]))) + _raw_attributes(t[1])),
    st.tuples(st.integers(0, 40), st.integers(0, 255))
    .map(lambda t: (lambda d: d[:t[0]] + bytes([t[1]]) + d[t[0] + 1:])(
        bytes(binding_request(fingerprint=True)))),
))
def test_any_datagram_is_answered_correctly_or_dropped(data: bytes) -> None:
    responder = StunResponder()
    transport = RecordingTransport()
    responder.connection_made(transport)
    source = ("198.51.100.9", 40000)
    responder.datagram_received(data, source)
    counters = responder.counters()
    assert counters["stun_requests"] == 1
    assert sum(counters.values()) == 2  # requests + exactly one outcome
    for reply, addr in transport.sent:
        assert addr == source
        assert len(reply) <= len(data) + MAX_GROWTH
        response = stun.parse_message(reply)
        assert response.message_class == stun.Class.RESPONSE
        assert response.transaction_id == data[8:20]
        assert response.attributes["XOR-MAPPED-ADDRESS"] == source
    # Answering goes on.
    good = binding_request()
    responder.datagram_received(bytes(good), source)
    assert stun.parse_message(transport.sent[-1][0]).transaction_id == good.transaction_id


def test_ipv4_mapped_sources_are_answered_as_ipv4() -> None:
    responder = StunResponder()
    transport = RecordingTransport()
    responder.connection_made(transport)
    responder.datagram_received(bytes(binding_request()), ("::ffff:198.51.100.9", 5000, 0, 0))
    (reply, _), = transport.sent
    assert stun.parse_message(reply).attributes["XOR-MAPPED-ADDRESS"] == ("198.51.100.9", 5000)
    responder.datagram_received(bytes(binding_request()), ("198.51.100.9", 0))  # port 0: no reply
    assert len(transport.sent) == 1
    assert responder.counters()["stun_malformed"] == 1


# --- the port ---------------------------------------------------------------------------------


async def test_port_zero_prefers_the_tcp_port_number() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.bind((HOST, 0))
        tcp_port = tcp.getsockname()[1]
        responder = await StunResponder.start(HOST, 0, prefer_port=tcp_port)
        try:
            assert responder.bound_port == tcp_port
        finally:
            responder.close()


async def test_port_zero_falls_back_to_any_free_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind((HOST, 0))
        busy = taken.getsockname()[1]
        responder = await StunResponder.start(HOST, 0, prefer_port=busy)
        try:
            assert responder.bound_port not in (0, busy)
        finally:
            responder.close()
        with pytest.raises(TransportError, match="cannot listen for STUN"):
            await StunResponder.start(HOST, busy)
    with pytest.raises(ValueError, match="out of range"):
        await StunResponder.start(HOST, 70000)


async def test_close_stops_answering(make_client: Any) -> None:
    responder = await StunResponder.start(HOST)
    port = responder.bound_port
    responder.close()
    responder.close()  # twice is fine
    assert responder.closed
    client = await make_client()
    with pytest.raises(stun.TransactionTimeout):
        await client.request(binding_request(), (HOST, port), retransmissions=0)


# --- addresses ----------------------------------------------------------------------------------


def test_stun_address_and_ice_servers() -> None:
    address = stun_address("203.0.113.5", 4100, "12D3KooWpeer")
    assert str(address) == "/ip4/203.0.113.5/udp/4100/p2p/12D3KooWpeer"
    assert PeerAddress.parse(str(address)) == address
    assert str(stun_address("2001:db8::1", 4100, None)) == "/ip6/2001:db8::1/udp/4100"
    addresses = [
        PeerAddress.parse("/ip4/203.0.113.5/tcp/4100/p2p/a"),
        address,
        PeerAddress.parse("/ip4/203.0.113.5/udp/4100/p2p/b"),  # same server, another peer id
        PeerAddress.parse("/ip6/2001:db8::1/udp/3478"),
        PeerAddress.parse("/dns4/stun.example.org/udp/3478"),
        PeerAddress.parse("/ip4/198.51.100.1/udp/0"),
        PeerAddress.parse("/ip4/198.51.100.2/udp/5000"),
        PeerAddress.parse("/ip4/198.51.100.3/udp/5000"),
    ]
    assert ice_servers_from(addresses) == ["stun:203.0.113.5:4100", "stun:[2001:db8::1]:3478",
                                           "stun:stun.example.org:3478", "stun:198.51.100.2:5000"]
    assert ice_servers_from(addresses, limit=1) == ["stun:203.0.113.5:4100"]
    assert ice_servers_from([]) == []


# --- in the daemon ------------------------------------------------------------------------------


async def test_peer_network_starts_and_closes_its_responder(make_client: Any) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((HOST, 0))
        chosen = probe.getsockname()[1]
    config = build_config(overrides={"net.listen": [f"/ip4/{HOST}/tcp/0"], "net.stun_port": chosen,
                                     "dht.client_mode": "no"})
    identity = Identity.generate()
    network = PeerNetwork(config, identity)
    await network.start()
    try:
        (address,) = network.stun_addresses()
        assert address == stun_address(HOST, chosen, identity.peer_id)
        client = await make_client()
        response = await client.request(binding_request(), (HOST, chosen))
        assert response.attributes["XOR-MAPPED-ADDRESS"] == client.address
        assert network.counters()["stun.stun_answered"] >= 1
    finally:
        await network.close()
    assert network.stun_addresses() == []

    off = PeerNetwork(build_config(overrides={"net.listen": [f"/ip4/{HOST}/tcp/0"], "net.stun": False,
                                              "dht.client_mode": "no"}), identity)
    await off.start()
    try:
        assert off.stun_addresses() == []
        assert not any(k.startswith("stun.") for k in off.counters())
    finally:
        await off.close()


async def test_daemon_answers_stun_on_its_port(daemon_factory: Any, make_client: Any) -> None:
    daemon = await daemon_factory()
    (event,) = [e for e in daemon.events() if e.get("event") == "stun_listening"]
    (text,) = event["addresses"]
    address = PeerAddress.parse(text)
    info = await daemon.call("node.info")
    (p2p,) = [PeerAddress.parse(a) for a in info["addresses"]["p2p"]]
    assert (address.transport, address.host, address.peer_id) == ("udp", HOST, info["peer_id"])
    assert address.port == p2p.port  # the TCP port's number, free for UDP

    client = await make_client()
    request = binding_request(fingerprint=True)
    response = await client.request(request, (address.host, address.port))
    assert response.transaction_id == request.transaction_id
    assert response.attributes["XOR-MAPPED-ADDRESS"] == client.address
    client.send(b"not stun at all", (address.host, address.port))

    async def counted() -> dict[str, int] | None:
        counters = (await daemon.call("node.info"))["counters"]
        return counters if counters.get("stun.stun_malformed") == 1 else None

    counters = await support.wait_until(counted, timeout=30)
    assert counters["stun.stun_answered"] >= 1
    assert counters["stun.stun_requests"] >= 2
    assert counters["stun.stun_rate_limited"] == counters["stun.stun_ignored"] == 0


async def test_daemon_without_stun(daemon_factory: Any) -> None:
    daemon = await daemon_factory("--net.stun", "false")
    assert not [e for e in daemon.events() if e.get("event") == "stun_listening"]
    info = await daemon.call("node.info")
    assert not any(k.startswith("stun.") for k in info["counters"])
