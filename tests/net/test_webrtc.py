"""The WebRTC pipe (daemon/net/webrtc.py): two aiortc peers in one process, on 127.0.0.1 only.

aioice never offers 127.0.0.1 as a host candidate; here its host address discovery is patched to
return ["127.0.0.1"] so ICE runs on loopback, and every UDP datagram that asyncio sends is checked
(the `loopback_only` fixture drops and reports any other destination). The NAT traversal tests
proper (real NATs, STUN/TURN) run in network namespaces (tests/natlab.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("aiortc", reason="aiortc (WebRTC) is not installed")

import aioice.ice
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcdtlstransport import RTCCertificate
from net.netutil import wait_until

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    HandshakeError,
    LinkLimits,
    Message,
    PeerAddress,
    PeerIdMismatchError,
    PeerUnreachableError,
)
from dedloc.daemon.net import webrtc as W
from dedloc.daemon.net.link import Dispatcher, Link

ADDR = PeerAddress.parse("/ip4/127.0.0.1/tcp/4100")
Transform = Callable[[dict[str, Any]], dict[str, Any] | None]


# --- fixtures: loopback only ---------------------------------------------------------------------
@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """ICE on 127.0.0.1; any datagram to another address is dropped and fails the test."""
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    stray: list[Any] = []
    transport_class = asyncio.selector_events._SelectorDatagramTransport  # type: ignore[attr-defined]
    original = transport_class.sendto

    def sendto(self: Any, data: bytes, addr: Any = None) -> None:
        target = addr if addr is not None else self._address
        if target is None or target[0] != "127.0.0.1":
            stray.append(target)
            return
        original(self, data, addr)

    monkeypatch.setattr(transport_class, "sendto", sendto)
    yield stray
    assert not stray, f"datagrams to addresses other than 127.0.0.1: {stray}"


class QueueSignaller:
    """One end of an in-memory signalling path; `transform` may rewrite (or drop: None) what it
    sends, like a relay would."""

    def __init__(self, inbox: asyncio.Queue[dict[str, Any]], outbox: asyncio.Queue[dict[str, Any]],
                 transform: Transform | None = None) -> None:
        self.inbox, self.outbox, self.transform = inbox, outbox, transform
        self.sent: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if self.transform is not None:
            message = self.transform(dict(message))  # type: ignore[assignment]
            if message is None:
                return
        self.outbox.put_nowait(message)

    async def receive(self, timeout: float) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            return await self.inbox.get()


def signaller_pair(to_answerer: Transform | None = None,
                   to_offerer: Transform | None = None) -> tuple[QueueSignaller, QueueSignaller]:
    a: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    b: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    return QueueSignaller(a, b, to_answerer), QueueSignaller(b, a, to_offerer)


async def connect_pair(*, deadline_s: float = 10.0, to_answerer: Transform | None = None,
                       to_offerer: Transform | None = None, offerer_expects: str | None = None,
                       answerer_expects: str | None = None,
                       ids: tuple[Identity, Identity] | None = None) -> tuple[Any, Any]:
    """Both sides at once; each result is a Handshaken or the exception it raised."""
    offer_id, answer_id = ids or (Identity.generate(), Identity.generate())
    sig_o, sig_a = signaller_pair(to_answerer, to_offerer)
    deadline = asyncio.get_running_loop().time() + deadline_s
    results = await asyncio.gather(
        W.webrtc_connect(sig_o, offer_id, offerer=True, ice_servers=[], deadline=deadline,
                         addresses=[ADDR], expected_peer_id=offerer_expects),
        W.webrtc_connect(sig_a, answer_id, offerer=False, ice_servers=[], deadline=deadline,
                         addresses=[], expected_peer_id=answerer_expects),
        return_exceptions=True)
    return results[0], results[1]


def open_sockets() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        count += target.startswith("socket:")
    return count


async def assert_nothing_left(tasks_before: set[asyncio.Task[Any]], sockets_before: int) -> None:
    """No task and no socket outlives a closed or failed connection (a short settle allowed: aiortc
    ends some of its tasks one loop turn after close)."""
    def leftovers() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() - tasks_before if t is not asyncio.current_task()]

    with contextlib.suppress(TimeoutError):
        await wait_until(lambda: not leftovers() and open_sockets() <= sockets_before, timeout=2.0)
    assert not leftovers()
    assert open_sockets() <= sockets_before
    assert not W._BACKGROUND


async def close_both(*ios: W.DataChannelIO) -> None:
    for io in ios:
        io.close()
    await asyncio.gather(*(io.wait_closed() for io in ios))


# --- no outside STUN server ----------------------------------------------------------------------
async def test_an_empty_ice_server_list_contacts_no_stun_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """aiortc falls back to a public STUN server when given no list; we always give ours."""
    queried: list[Any] = []

    async def no_stun(protocol: Any, server: Any) -> Any:
        queried.append(server)
        raise AssertionError("STUN queried")

    monkeypatch.setattr(aioice.ice, "server_reflexive_candidate", no_stun)
    pc, _channel = W._new_peer_connection([])
    try:
        await pc.setLocalDescription(await pc.createOffer())  # gathers
        connection = pc.sctp.transport.transport.iceGatherer._connection
        assert connection.stun_server is None and connection.turn_server is None
        candidates = pc.sctp.transport.transport.iceGatherer.getLocalCandidates()
        assert {c.type for c in candidates} == {"host"}
        assert {c.ip for c in candidates} == {"127.0.0.1"}
    finally:
        await pc.close()
    assert not queried
    # what we avoid: aiortc's default configuration names an outside STUN server
    default = RTCPeerConnection(RTCConfiguration())
    default.createDataChannel("x")
    try:
        assert default.sctp.transport.transport.iceGatherer._connection.stun_server is not None
    finally:
        await default.close()


async def test_our_stun_server_is_the_one_queried() -> None:
    """The list we pass is used: a STUN server on 127.0.0.1 gets the binding request."""
    from aioice import stun

    seen: list[tuple[str, int]] = []

    class FakeStun(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            request = stun.parse_message(data)
            seen.append(addr)
            response = stun.Message(message_method=stun.Method.BINDING,
                                    message_class=stun.Class.RESPONSE,
                                    transaction_id=request.transaction_id)
            response.attributes["XOR-MAPPED-ADDRESS"] = addr
            self.transport.sendto(bytes(response), addr)

    loop = asyncio.get_running_loop()
    server, _ = await loop.create_datagram_endpoint(FakeStun, local_addr=("127.0.0.1", 0))
    port = server.get_extra_info("sockname")[1]
    pc, _channel = W._new_peer_connection([f"stun:127.0.0.1:{port}"])
    try:
        await pc.setLocalDescription(await pc.createOffer())
        assert seen, "our STUN server was not asked"
    finally:
        await pc.close()
        server.close()


# --- connecting ----------------------------------------------------------------------------------
async def test_connect_exchanges_hellos_and_moves_16_mib() -> None:
    # 16 MiB by default (DEDLOC_WEBRTC_BULK_MB for more, to measure): a data channel moves
    # 5-20 MB/s at a full core per side, and 64 MiB beside a loaded suite took 35 s and once
    # lost its channel (SCTP starved of CPU); 16 is still 16 times the send buffer's high-water
    # mark (1 MiB), so the sender waits on it over and over: what the test checks beside the bytes
    tasks_before, sockets_before = asyncio.all_tasks(), open_sockets()
    offer_id, answer_id = Identity.generate(), Identity.generate()
    setup = time.perf_counter()
    off, ans = await connect_pair(ids=(offer_id, answer_id), offerer_expects=answer_id.peer_id,
                                  answerer_expects=offer_id.peer_id)
    setup = time.perf_counter() - setup
    assert not isinstance(off, BaseException), off
    assert not isinstance(ans, BaseException), ans
    assert off.peer.peer_id == answer_id.peer_id
    assert ans.peer.peer_id == offer_id.peer_id
    assert off.peer.addresses == ()
    assert ans.peer.addresses == (ADDR.with_peer(offer_id.peer_id),)
    sender, receiver = off.io, ans.io
    assert sender.kind == receiver.kind == "webrtc"

    total = int(os.environ.get("DEDLOC_WEBRTC_BULK_MB", "16")) * 1024 * 1024
    block = os.urandom(1024 * 1024)
    sent_hash = hashlib.sha256()

    async def send() -> None:
        for i in range(total // len(block)):
            piece = block[i % 7:] + block[:i % 7]  # not the same megabyte each time
            sent_hash.update(piece)
            await sender.send_all([b"", memoryview(piece)[:1000], memoryview(piece)[1000:]])

    async def receive() -> bytes:
        got, digest = 0, hashlib.sha256()
        buffer = memoryview(bytearray(256 * 1024))
        while got < total:
            count = await receiver.recv_into(buffer)
            assert count > 0
            digest.update(buffer[:count])
            got += count
        return digest.digest()

    wall, cpu = time.perf_counter(), time.process_time()
    _, received = await asyncio.gather(send(), receive())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert received == sent_hash.digest()
    mb = total / 1e6
    print(f"\nwebrtc connect + hellos {setup * 1000:.0f} ms; "
          f"1 channel, both sides in one process: {mb / wall:.1f} MB/s, "
          f"{cpu:.2f} s CPU for {mb:.0f} MB ({mb / cpu:.1f} MB per CPU-second), "
          f"load {os.getloadavg()[0]:.1f}; max bufferedAmount {sender.max_buffered}, "
          f"max queued at the receiver {receiver.max_queued}")
    # backpressure: the sender's buffer never runs far past the high-water mark
    assert sender.max_buffered <= W.HIGH_WATER + W.MESSAGE_BYTES
    await close_both(sender, receiver)
    await assert_nothing_left(tasks_before, sockets_before)


async def test_a_clean_close_is_eof_after_the_data() -> None:
    tasks_before, sockets_before = asyncio.all_tasks(), open_sockets()
    off, ans = await connect_pair()
    data = os.urandom(3 * 1024 * 1024 + 5)
    await off.io.send_all([data])
    off.io.close()  # right away: what was sent still arrives, then EOF
    got = bytearray()
    buffer = memoryview(bytearray(100_000))
    while count := await ans.io.recv_into(buffer):
        got += buffer[:count]
    assert bytes(got) == data
    assert await ans.io.recv_into(buffer) == 0
    ans.io.close()
    await asyncio.gather(off.io.wait_closed(), ans.io.wait_closed())
    await assert_nothing_left(tasks_before, sockets_before)


async def test_a_peer_id_other_than_expected_is_refused() -> None:
    wanted = Identity.generate()
    off, ans = await connect_pair(deadline_s=5.0, offerer_expects=wanted.peer_id)
    assert isinstance(off, PeerIdMismatchError)
    assert isinstance(ans, HandshakeError)  # the offerer hung up before its hello


# --- deadlines -----------------------------------------------------------------------------------
async def test_no_answer_fails_by_our_deadline() -> None:
    tasks_before, sockets_before = asyncio.all_tasks(), open_sockets()
    sig_o, _sig_a = signaller_pair()  # nobody answers
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(PeerUnreachableError):
        await W.webrtc_connect(sig_o, Identity.generate(), offerer=True, ice_servers=[],
                               deadline=start + 3.0, addresses=[], expected_peer_id=None)
    elapsed = loop.time() - start
    assert 2.9 <= elapsed < 4.0, elapsed
    assert sig_o.sent and sig_o.sent[0]["type"] == "offer"
    await assert_nothing_left(tasks_before, sockets_before)


async def test_unreachable_candidates_fail_by_our_deadline() -> None:
    """Every candidate points at a UDP socket that never answers (a NAT that drops): ICE would
    retry for ~40 s; we give up at our 3 s deadline, on both sides, and leave nothing behind."""
    tasks_before, sockets_before = asyncio.all_tasks(), open_sockets()
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    port = sink.getsockname()[1]

    def black_hole(message: dict[str, Any]) -> dict[str, Any]:
        message["sdp"] = re.sub(r"(a=candidate:\S+ \d+ udp \d+ 127\.0\.0\.1) \d+", rf"\1 {port}",
                                message["sdp"])
        return message

    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        off, ans = await connect_pair(deadline_s=3.0, to_answerer=black_hole, to_offerer=black_hole)
    finally:
        sink.close()
    elapsed = loop.time() - start
    assert isinstance(off, PeerUnreachableError), off
    assert isinstance(ans, PeerUnreachableError), ans
    assert 2.9 <= elapsed < 4.0, elapsed
    await assert_nothing_left(tasks_before, sockets_before)


# --- tampering -----------------------------------------------------------------------------------
def _swap_fingerprint(message: dict[str, Any]) -> dict[str, Any]:
    other = RTCCertificate.generateCertificate().getFingerprints()
    replacement = {f.algorithm: f.value for f in other}
    message["sdp"] = re.sub(r"a=fingerprint:(\S+) (\S+)",
                            lambda m: f"a=fingerprint:{m[1]} {replacement[m[1]]}", message["sdp"])
    return message


@pytest.mark.parametrize("side", ["answer", "offer"])
async def test_a_tampered_fingerprint_never_connects(side: str) -> None:
    tasks_before, sockets_before = asyncio.all_tasks(), open_sockets()
    kwargs: dict[str, Any] = {"to_offerer" if side == "answer" else "to_answerer": _swap_fingerprint}
    off, ans = await connect_pair(deadline_s=3.0, **kwargs)
    # the side that checks the tampered fingerprint fails DTLS at once; the other one, left
    # without an answer, gives up at the deadline
    checker, other = (off, ans) if side == "answer" else (ans, off)
    assert isinstance(checker, HandshakeError) and "DTLS" in str(checker), checker
    assert isinstance(other, HandshakeError | PeerUnreachableError), other
    await assert_nothing_left(tasks_before, sockets_before)


async def test_a_relay_that_terminates_dtls_on_both_sides_is_caught_by_the_hellos() -> None:
    """The relay answers the offerer and offers to the answerer with its own certificates (so
    both DTLS sessions succeed) and copies the channel's messages between them: the hellos, bound
    to the DTLS certificates, fail."""
    loop = asyncio.get_running_loop()
    to_mitm: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    from_mitm: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    to_mitm2: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    from_mitm2: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sig_o = QueueSignaller(from_mitm, to_mitm)
    sig_a = QueueSignaller(from_mitm2, to_mitm2)
    faces = []
    for _ in range(2):
        pc, channel = W._new_peer_connection([])
        faces.append((pc, channel))
    (pc_o, ch_o), (pc_a, ch_a) = faces
    relayed = []

    def pipe(source: Any, target: Any) -> None:
        held: list[bytes] = []  # until the other face opens

        @source.on("message")
        def forward(message: bytes) -> None:
            relayed.append(len(message))
            if target.readyState == "open":
                target.send(message)
            else:
                held.append(message)

        @target.on("open")
        def flush() -> None:
            for message in held:
                target.send(message)
            held.clear()

    pipe(ch_o, ch_a)
    pipe(ch_a, ch_o)

    async def relay() -> None:
        offer = await to_mitm.get()
        await pc_o.setRemoteDescription(RTCSessionDescription(sdp=offer["sdp"], type="offer"))
        await pc_o.setLocalDescription(await pc_o.createAnswer())
        await pc_a.setLocalDescription(await pc_a.createOffer())
        from_mitm2.put_nowait({"type": "offer", "sdp": pc_a.localDescription.sdp})
        answer = await to_mitm2.get()
        await pc_a.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        from_mitm.put_nowait({"type": "answer", "sdp": pc_o.localDescription.sdp})

    deadline = loop.time() + 3.0
    relay_task = loop.create_task(relay())
    try:
        off, ans = await asyncio.gather(
            W.webrtc_connect(sig_o, Identity.generate(), offerer=True, ice_servers=[],
                             deadline=deadline, addresses=[], expected_peer_id=None),
            W.webrtc_connect(sig_a, Identity.generate(), offerer=False, ice_servers=[],
                             deadline=deadline, addresses=[], expected_peer_id=None),
            return_exceptions=True)
    finally:
        await relay_task
        await pc_o.close()
        await pc_a.close()
    assert relayed, "the relay carried nothing: this test did not test the hellos"
    assert isinstance(off, HandshakeError) and "not signed over" in str(off), off
    assert isinstance(ans, HandshakeError), ans


# --- SDP checks ----------------------------------------------------------------------------------
async def _an_offer() -> str:
    pc, _ = W._new_peer_connection([])
    try:
        await pc.setLocalDescription(await pc.createOffer())
        return pc.localDescription.sdp
    finally:
        await pc.close()


async def test_remote_sdp_is_checked() -> None:
    sdp = await _an_offer()
    text, parsed = W._checked_sdp({"type": "offer", "sdp": sdp}, "offer")
    assert len(parsed.media) == 1
    with pytest.raises(HandshakeError, match="expected an SDP answer"):
        W._checked_sdp({"type": "offer", "sdp": sdp}, "answer")
    with pytest.raises(PeerUnreachableError, match="gave up"):
        W._checked_sdp({"type": "error", "reason": "no"}, "answer")
    with pytest.raises(HandshakeError, match="over"):
        W._checked_sdp({"type": "offer", "sdp": sdp + "a=x:" + "y" * W.MAX_SDP_BYTES}, "offer")
    candidate = next(line for line in sdp.splitlines() if line.startswith("a=candidate:"))
    many = sdp.replace(candidate, "\r\n".join([candidate] * (W.MAX_REMOTE_CANDIDATES + 1)))
    with pytest.raises(HandshakeError, match="candidates"):
        W._checked_sdp({"type": "offer", "sdp": many}, "offer")
    no_fingerprint = "\r\n".join(line for line in sdp.splitlines() if "fingerprint" not in line)
    with pytest.raises(HandshakeError, match="fingerprint"):
        W._checked_sdp({"type": "offer", "sdp": no_fingerprint}, "offer")
    mdns = sdp.replace(candidate, candidate + "\r\n" + re.sub(r"127\.0\.0\.1", "abc.local", candidate))
    text, parsed = W._checked_sdp({"type": "offer", "sdp": mdns}, "offer")
    assert ".local" not in text
    assert all(not c.ip.endswith(".local") for c in parsed.media[0].ice_candidates)


# --- a Link over the pipe ------------------------------------------------------------------------
async def test_a_link_runs_over_the_data_channel() -> None:
    tasks_before, sockets_before = asyncio.all_tasks(), open_sockets()
    off, ans = await connect_pair()

    async def echo(ctx: Any, message: Message) -> Message:
        assert ctx.link_kind == "webrtc"
        return Message({"echo": message.header}, bytes(message.payload)[::-1])

    async def summer(ctx: Any, stream: Any) -> None:
        total = 0
        while (message := await stream.receive(timeout=10.0)) is not None:
            total += sum(message.payload)
        await stream.send(Message({"sum": total}), timeout=10.0)
        await stream.close()

    dispatcher = Dispatcher()
    dispatcher.unary["echo"] = echo
    dispatcher.streams["sum"] = summer
    closed: list[Link] = []
    limits = LinkLimits(ping_interval=1.0)
    client = Link(off.io, peer_id=off.peer.peer_id, peer_addresses=off.peer.addresses, outbound=True,
                  address=None, limits=limits, dispatcher=Dispatcher(), on_closed=closed.append,
                  counters={})
    server = Link(ans.io, peer_id=ans.peer.peer_id, peer_addresses=ans.peer.addresses,
                  outbound=False, address=None, limits=limits, dispatcher=dispatcher,
                  on_closed=closed.append, counters={})
    client.start()
    server.start()
    loop = asyncio.get_running_loop()
    payload = os.urandom(3 * 1024 * 1024)
    reply = await client.call("echo", Message({"a": 1}, payload), loop.time() + 20.0)
    assert reply.header == {"echo": {"a": 1}}
    assert bytes(reply.payload) == payload[::-1]
    stream = await client.open_stream("sum", {}, loop.time() + 10.0)
    chunks = [os.urandom(200_000) for _ in range(5)]
    for chunk in chunks:
        await stream.send(Message({}, chunk), timeout=10.0)
    await stream.close()
    answer = await stream.receive(timeout=10.0)
    assert answer is not None and answer.header == {"sum": sum(sum(c) for c in chunks)}
    assert await stream.receive(timeout=10.0) is None
    await asyncio.sleep(1.5)  # a keepalive round trip measures the rtt
    assert client.rtt_ms is not None
    await client.close("test over")
    await wait_until(lambda: len(closed) == 2, timeout=10.0)  # the server sees EOF, closes too
    await asyncio.gather(off.io.wait_closed(), ans.io.wait_closed())
    await assert_nothing_left(tasks_before, sockets_before)
