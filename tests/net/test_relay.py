"""Relays on 127.0.0.1: a peer that listens nowhere is reached through a relay, TLS end to end,
within the relay's limits; when its relay dies, another one carries it."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from net.netutil import FAST, wait_until

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, PeerUnreachableError, RequestContext, TlsTransport
from dedloc.daemon.net.relay import RelayClient, RelayLimits, RelayService

MIB = 1 << 20


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message({"from": ctx.peer_id, "kind": ctx.link_kind}, bytes(message.payload))


async def sink(ctx: RequestContext, stream: Any) -> None:
    digest = hashlib.sha256()
    total = 0
    while (message := await stream.receive(timeout=30)) is not None:
        digest.update(message.payload)
        total += len(message.payload)
    await stream.send(Message({"sha256": digest.hexdigest(), "bytes": total}), timeout=30)


@pytest.fixture
async def hidden() -> AsyncIterator[Any]:
    """Transports that listen nowhere: nobody can dial them."""
    made: list[TlsTransport] = []

    async def make(identity: Identity | None = None) -> TlsTransport:
        transport = await TlsTransport.start(identity or Identity.generate(), [], limits=FAST)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        await transport.close()


async def _relay(make_transport: Any, limits: RelayLimits | None = None) -> TlsTransport:
    relay = await make_transport()
    relay.service = RelayService(relay, limits)  # type: ignore[attr-defined]
    RelayClient(relay)
    return relay


async def test_a_hidden_peer_is_reached_through_a_relay(make_transport: Any, hidden: Any) -> None:
    relay = await _relay(make_transport)
    a, b = await make_transport(), await hidden()
    client_a, client_b = RelayClient(a), RelayClient(b)
    for t in (a, b):
        t.add_unary_handler("echo", echo)
        t.add_stream_handler("sink", sink)
    await client_b.reserve(relay.listen_addresses()[0])
    (circuit,) = b.listen_addresses()
    assert circuit.circuit == b.peer_id and circuit.peer_id == relay.peer_id
    a.learn_addresses(b.peer_id, b.listen_addresses())

    reply = await a.call(b.peer_id, "echo", Message({}, b"over the relay"), timeout=10)
    assert reply.header == {"from": a.peer_id, "kind": "relay"} and reply.payload == b"over the relay"
    assert a.link_kind(b.peer_id) == "relay" and b.link_kind(a.peer_id) == "relay"
    assert {i.kind for i in a.links() if i.peer_id == b.peer_id} == {"relay"}
    # B calls back over the same link.
    back = await b.call(a.peer_id, "echo", Message({}, b"back"), timeout=10)
    assert back.header["kind"] == "relay"

    # A bulk stream, checked end to end; the relay only ever carried ciphertext.
    data = bytes(range(256)) * (8 * MIB // 256)
    stream = await a.open_stream(b.peer_id, "sink", {}, timeout=10)
    for offset in range(0, len(data), MIB):
        await stream.send(Message({}, data[offset:offset + MIB]), timeout=30)
    await stream.close()
    result = await stream.receive(timeout=30)
    assert result is not None and result.header == {"sha256": hashlib.sha256(data).hexdigest(),
                                                     "bytes": len(data)}
    assert relay.service.counters["bytes_relayed"] > len(data)  # type: ignore[attr-defined]
    assert client_a.counters["circuits_dialed"] == 1 and client_b.counters["circuits_accepted"] == 1


async def test_a_relay_refuses_what_it_should(make_transport: Any, hidden: Any) -> None:
    relay = await _relay(make_transport, RelayLimits(max_circuits_per_peer=1))
    not_a_relay = await make_transport()
    RelayService(not_a_relay, RelayLimits(enabled=False))
    a, b, c = await make_transport(), await hidden(), await hidden()
    client_a, client_b, client_c = RelayClient(a), RelayClient(b), RelayClient(c)
    for t in (a, b, c):
        t.add_unary_handler("echo", echo)
    with pytest.raises(Exception, match="not a relay"):
        await client_b.reserve(not_a_relay.listen_addresses()[0])
    # C has no reservation: the relay will not carry a circuit to it.
    with pytest.raises(PeerUnreachableError, match="no reservation"):
        await client_a.dial(relay.listen_addresses()[0].via(c.peer_id))
    await client_b.reserve(relay.listen_addresses()[0])
    await client_c.reserve(relay.listen_addresses()[0])
    await client_a.dial(b.listen_addresses()[0])
    # A already has one circuit on this relay: a second one is over max_circuits_per_peer.
    with pytest.raises(PeerUnreachableError, match="max_circuits_per_peer"):
        await client_a.dial(c.listen_addresses()[0])
    assert relay.service.counters["circuits_refused"] == 2  # type: ignore[attr-defined]
    assert relay.service.counters["circuits"] == 1  # type: ignore[attr-defined]


async def test_relay_bandwidth_is_bounded_per_peer(make_transport: Any, hidden: Any) -> None:
    limits = RelayLimits(bytes_per_second_per_peer=2 * MIB, burst_bytes=256 * 1024)
    relay = await _relay(make_transport, limits)
    a, b = await make_transport(), await hidden()
    RelayClient(a)
    client_b = RelayClient(b)
    b.add_stream_handler("sink", sink)
    await client_b.reserve(relay.listen_addresses()[0])
    a.learn_addresses(b.peer_id, b.listen_addresses())
    stream = await a.open_stream(b.peer_id, "sink", {}, timeout=10)
    started = time.monotonic()
    for _ in range(6):
        await stream.send(Message({}, bytes(MIB)), timeout=30)
    await stream.close()
    result = await stream.receive(timeout=60)
    assert result is not None and result.header["bytes"] == 6 * MIB
    # 6 MiB at 2 MiB/s after a 256 KiB burst cannot take less than ~2.8 s.
    assert time.monotonic() - started > 2.5


async def test_when_the_relay_dies_another_one_carries_the_link(make_transport: Any, hidden: Any) -> None:
    first, second = await _relay(make_transport), await _relay(make_transport)
    a, b = await make_transport(), await hidden()
    RelayClient(a)
    client_b = RelayClient(b)
    b.add_unary_handler("echo", echo)
    await client_b.reserve(first.listen_addresses()[0])
    await client_b.reserve(second.listen_addresses()[0])
    assert len(b.listen_addresses()) == 2
    a.learn_addresses(b.peer_id, b.listen_addresses())
    await a.call(b.peer_id, "echo", Message({}, b"1"), timeout=10)
    used = next(i.address for i in a.links() if i.peer_id == b.peer_id)
    dead = first if first.peer_id in str(used) else second
    await dead.close()
    await wait_until(lambda: a.link_kind(b.peer_id) is None, timeout=10)
    client_b.forget(dead.peer_id)  # B notices its relay is gone (the daemon does this on link down)
    reply = await a.call(b.peer_id, "echo", Message({}, b"2"), timeout=20)
    assert reply.header["kind"] == "relay" and reply.payload == b"2"
    now_used = next(i.address for i in a.links() if i.peer_id == b.peer_id)
    assert dead.peer_id not in str(now_used)


async def test_a_relayed_link_is_upgraded_to_webrtc(make_transport: Any, hidden: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """ICE runs on 127.0.0.1 here (aioice never offers loopback on its own); the NAT lab tests run
    the same upgrade between network namespaces."""
    import aioice.ice

    from dedloc.daemon.net.upgrade import PathUpgrader

    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    relay = await _relay(make_transport)
    a, b = await make_transport(), await hidden()
    RelayClient(a)
    client_b = RelayClient(b)
    upgraders = [PathUpgrader(t, list) for t in (a, b)]
    for t in (a, b):
        t.add_unary_handler("echo", echo)
    await client_b.reserve(relay.listen_addresses()[0])
    a.learn_addresses(b.peer_id, b.listen_addresses())
    first = await a.call(b.peer_id, "echo", Message({}, b"1"), timeout=10)
    assert first.header["kind"] == "relay"
    await wait_until(lambda: a.link_kind(b.peer_id) == "webrtc" and b.link_kind(a.peer_id) == "webrtc",
                     timeout=20)
    reply = await a.call(b.peer_id, "echo", Message({}, b"2"), timeout=10)
    assert reply.header["kind"] == "webrtc"
    # The relayed link drains away: the relay carries nothing for them any more.
    await wait_until(lambda: {i.kind for i in a.links() if i.peer_id == b.peer_id} == {"webrtc"}, timeout=20)
    assert sum(u.counters["upgrades_webrtc"] for u in upgraders) == 1
    for upgrader in upgraders:
        await upgrader.close()


async def test_forged_and_malformed_relay_requests_are_refused(make_transport: Any, hidden: Any) -> None:
    from dedloc.daemon.net import PeerAddress, RemoteError, StreamAborted, TransportError
    from dedloc.daemon.net.handshake import pipe_client_handshake
    from dedloc.daemon.net.pipes import StreamPipe

    relay = await _relay(make_transport)
    a, b = await make_transport(), await hidden()
    RelayClient(a)
    client_b = RelayClient(b)
    await client_b.reserve(relay.listen_addresses()[0])
    # relay.connect without a target: refused and counted.
    await a.connect(relay.listen_addresses()[0], timeout=10)
    stream = await a.open_stream(relay.peer_id, "relay.connect", {}, timeout=10)
    with pytest.raises(StreamAborted, match="target"):
        await stream.receive(timeout=10)
    assert relay.service.counters["circuits_refused"] == 1  # type: ignore[attr-defined]
    # A peer that is no relay of B's opens relay.incoming to B (with a true "from" or not): B
    # refuses it before any inner handshake (links nested in a link would dodge max_links).
    await b.connect(a.listen_addresses()[0], timeout=10)
    await wait_until(lambda: a.link_kind(b.peer_id) == "tcp")
    _, client_ctx, _ = a.tls_contexts
    assert client_ctx is not None
    for source in ("6MkNotThePeerWhoDialed", a.peer_id):
        liar = await a.open_stream(b.peer_id, "relay.incoming", {"from": source}, timeout=10)
        with pytest.raises((StreamAborted, TransportError)):
            await pipe_client_handshake(StreamPipe(liar), a.identity, client_ctx, b.peer_id,
                                        a.listen_addresses())
            await liar.receive(timeout=10)
    assert client_b.counters["circuits_not_reserved"] == 2
    assert client_b.counters["circuits_accepted"] == 0
    assert all(i.kind != "relay" for i in b.links())
    # net.addresses with too many entries is refused; junk entries are skipped.
    with pytest.raises(RemoteError, match="at most"):
        await a.call(b.peer_id, "net.addresses", Message({"addrs": ["x"] * 100}), timeout=5)
    await a.call(b.peer_id, "net.addresses", Message({"addrs": ["junk", "/ip4/10.0.0.1/tcp/1"]}),
                 timeout=5)
    assert b.known_addresses(a.peer_id)[0] == PeerAddress.parse("/ip4/10.0.0.1/tcp/1").with_peer(a.peer_id)


async def test_a_peer_known_only_by_id_is_found_through_the_resolver(make_transport: Any,
                                                                    hidden: Any) -> None:
    relay = await _relay(make_transport)
    a, b = await make_transport(), await hidden()
    RelayClient(a)
    client_b = RelayClient(b)
    b.add_unary_handler("echo", echo)
    await client_b.reserve(relay.listen_addresses()[0])
    asked: list[str] = []

    async def resolve(peer_id: str) -> list[Any]:  # what the daemon reads from the DHT
        asked.append(peer_id)
        return b.listen_addresses() if peer_id == b.peer_id else []

    a.set_address_resolver(resolve)
    reply = await a.call(b.peer_id, "echo", Message({}, b"by id"), timeout=10)
    assert reply.header["kind"] == "relay" and asked == [b.peer_id]


async def test_a_members_only_relay_serves_its_closed_runs_members(make_transport: Any,
                                                                   hidden: Any) -> None:
    """relay.members_only: reservations and circuits need a valid token of a closed run the relay
    takes part in (here: one it owns); others are refused and counted."""
    from dedloc.daemon.collab.membership import MembershipRegistry
    from dedloc.daemon.collab.secrecy import RunSecret
    from dedloc.daemon.collab.tokens import MembershipToken

    relay_identity = Identity.generate()
    registry = MembershipRegistry(relay_identity)
    relay = await make_transport(identity=relay_identity)
    relay.service = RelayService(relay, RelayLimits(), admit=registry.admit_relay)  # type: ignore[attr-defined]
    RelayClient(relay)
    member_id, stranger_id = Identity.generate(), Identity.generate()
    member, stranger = await hidden(identity=member_id), await hidden(identity=stranger_id)
    member_registry, stranger_registry = MembershipRegistry(member_id), MembershipRegistry(stranger_id)
    member_registry.hold(MembershipToken.issue(relay_identity, "club", member_id.peer_id, "trainer", 600,
                                                RunSecret.generate()))
    # The stranger holds a token too, but of a run whose owner is someone else.
    stranger_registry.hold(MembershipToken.issue(Identity.generate(), "other", stranger_id.peer_id,
                                                 "trainer", 600, RunSecret.generate()))
    client_m = RelayClient(member, credentials=member_registry.tokens)
    client_s = RelayClient(stranger, credentials=stranger_registry.tokens)
    address = relay.listen_addresses()[0]
    with pytest.raises(Exception, match="members only"):
        await client_s.reserve(address)
    assert await client_m.reserve(address) > 0
    # A circuit to the member from a peer without tokens is refused as well.
    outsider = await make_transport()
    with pytest.raises(PeerUnreachableError, match="members only"):
        await RelayClient(outsider).dial(address.via(member_id.peer_id))
    assert relay.service.counters["refused_not_member"] == 2  # type: ignore[attr-defined]
    assert registry.refusals_by_reason["relay"] == 2
