"""Fuzzing a live link: sequences of frames, well-formed or not, from an authenticated peer.

A `Link` runs over an in-memory pipe here (a link runs over any pipe: a socket, a relayed stream,
a data channel), serving echo and failing handlers and the DHT's handlers. After each sequence a
PING must still be answered, or the link must have closed because of a protocol violation or a
limit, counted. No link task may die of anything else; every ERROR frame names a known refusal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from fuzz.fuzzutil import PEER_IDS, Deep, daemon_recursion_limit, fuzz_settings, to_json
from fuzz.peerwire import aligned, frame_bytes, sessions
from hypothesis import event, example, given
from net.netutil import wait_until
from structlog.testing import capture_logs

from dedloc.daemon.dht import DHTNode
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import LinkLimits, Message, RequestContext, TransportClosed
from dedloc.daemon.net.frames import F_MORE, Frame, FrameDecoder, FrameType
from dedloc.daemon.net.link import Dispatcher, Link
from dedloc.daemon.net.link_stream import LinkStream
from dedloc.daemon.net.memory import MemoryNetwork

LIMITS = LinkLimits(max_payload=4096, chunk_bytes=1024, max_message_bytes=16384, stream_window=8192,
                    max_streams=8, max_pending_bytes=65536, ping_interval=3600.0, ping_timeout=7200.0)
UNARY = ["echo", "fail", "slow", "dht.ping", "dht.find_node", "dht.find_value", "dht.store"]
STREAMS = ["stream.echo", "stream.into"]
#: ERROR kinds a link may send: refusals, and the exceptions our handlers raise on bad input.
KNOWN_ERRORS = {"UnknownMethod", "LimitExceeded", "ValueError", "MalformedMessage", "BadSignature",
                "ForbiddenWrite", "StaleRecord", "RecordExpired", "RecordTooLarge", "StorageFull",
                "AccessDenied"}


class FuzzPipe:
    """The link's side of an in-memory connection: what the fuzzer feeds, and what the link sent
    (decoded)."""

    kind = "fuzz"

    def __init__(self) -> None:
        self.inbound = bytearray()
        self.closed = False
        self._arrived = asyncio.Event()
        self._decoder = FrameDecoder(max_payload=1 << 24)
        self.sent: list[Frame] = []

    def feed(self, data: bytes) -> None:
        self.inbound += data
        self._arrived.set()

    async def recv_into(self, buffer: memoryview) -> int:
        while not self.inbound:
            if self.closed:
                raise TransportClosed("pipe closed")
            self._arrived.clear()
            await self._arrived.wait()
        count = min(len(buffer), len(self.inbound))
        buffer[:count] = self.inbound[:count]
        del self.inbound[:count]
        return count

    async def send_all(self, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
        if self.closed:
            raise TransportClosed("pipe closed")
        for buffer in buffers:
            self.sent.extend(self._decoder.feed(bytes(buffer)))

    def close(self) -> None:
        self.closed = True
        self._arrived.set()


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message(message.header, bytes(message.payload))


async def fail(ctx: RequestContext, message: Message) -> Message:
    raise ValueError("refused on purpose")


async def slow(ctx: RequestContext, message: Message) -> Message:
    await asyncio.sleep(0.01)
    return Message({"late": True})


async def stream_echo(ctx: RequestContext, stream: LinkStream) -> None:
    while (message := await stream.receive(timeout=1.0)) is not None:
        await stream.send(Message(message.header, bytes(message.payload)), timeout=1.0)


async def stream_into(ctx: RequestContext, stream: LinkStream) -> None:
    buffer = bytearray(600)  # smaller than some messages: those abort the stream
    while await stream.receive_into(buffer, timeout=1.0) is not None:
        pass


@dataclass
class Served:
    dispatcher: Dispatcher
    counters: dict[str, int]
    loop_errors: list[dict[str, Any]]  # what the loop's exception handler was told (never retrieved)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    network = MemoryNetwork()
    identity = Identity.generate()
    dht = DHTNode(network.transport(identity.peer_id), identity)
    dispatcher = Dispatcher()
    dispatcher.unary.update({"echo": echo, "fail": fail, "slow": slow, "dht.ping": dht._on_ping,
                             "dht.find_node": dht._on_find_node, "dht.find_value": dht._on_find_value,
                             "dht.store": dht._on_store})
    dispatcher.streams.update({"stream.echo": stream_echo, "stream.into": stream_into})
    served = Served(dispatcher, {}, [])
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: served.loop_errors.append(context))
    yield served
    await dht.close()
    loop.set_exception_handler(None)


SYNC = b"fuzz-sync"


async def run_session(served: Served, parts: list[bytes]) -> tuple[Link, FuzzPipe]:
    """Feed `parts` to a fresh link, then a PING; return once it is answered or the link closed."""
    pipe = FuzzPipe()
    link = Link(pipe, peer_id=PEER_IDS[1], peer_addresses=(), outbound=True, address=None,
                limits=LIMITS, dispatcher=served.dispatcher, on_closed=lambda _: None,
                counters=served.counters)
    link.start()
    pieces = aligned(parts, LIMITS.max_payload)
    if len(parts) % 2:  # all at once (handlers start only after the read), or a part at a time
        pieces = [b"".join(pieces)]
    for part in pieces:
        pipe.feed(part)
        await asyncio.sleep(0)
    pipe.feed(frame_bytes(FrameType.PING, 0, 0, b"", SYNC))
    # A hang is a failure (wait_until times out); unary handlers answer (or fail) quickly.
    await wait_until(lambda: link.closed or any(f.type == FrameType.PONG and bytes(f.payload) == SYNC
                                                for f in pipe.sent), timeout=10)
    await wait_until(lambda: link.closed or not link._unary.served, timeout=10)
    return link, pipe


def task_failures(link: Link) -> list[BaseException]:
    tasks = [*link._tasks, *link._handler_tasks]
    return [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]


async def check_session(served: Served, parts: list[bytes]) -> None:
    with capture_logs() as logs:
        await check_link(served, parts)
    failed = [e for e in logs if e["event"] in ("link_task_failed", "link_reader_failed",
                                                "link_writer_failed")]
    assert not failed, failed
    assert not served.loop_errors, served.loop_errors


async def check_link(served: Served, parts: list[bytes]) -> None:
    before = dict(served.counters)
    link, pipe = await run_session(served, parts)
    failures = task_failures(link)
    assert not failures, failures
    assert served.counters.get("link_errors", 0) == 0
    if link.closed:
        assert link.close_reason.startswith(("ProtocolViolation", "LimitExceeded")), link.close_reason
        refused = sum(served.counters.get(k, 0) - before.get(k, 0)
                      for k in ("protocol_violations", "limits_exceeded"))
        assert refused == 1
    event("link closed: " + link.close_reason[:60] if link.closed else "link alive")
    for frame in pipe.sent:
        if frame.type in (FrameType.RESPONSE, FrameType.ERROR, FrameType.ACCEPT):
            event(f"sent {frame.type.name} {frame.header.get('k', '')}".strip())
        if frame.type == FrameType.ERROR:
            kind, text = frame.header.get("k"), frame.header.get("e", "")
            # "echo" answers with the request's header: one orjson cannot encode is refused
            assert kind in KNOWN_ERRORS or "reply header cannot be sent" in text, frame.header
    await link.close("fuzz example done")
    assert not task_failures(link)


# Regressions found by this fuzzer: a deeply nested "k"/"e" in an ERROR or ABORT frame killed the
# link's reader (RecursionError in str()); an echoed header too deep for orjson killed its writer.
@example([frame_bytes(FrameType.ERROR, 0, 1, b'{"k":' + to_json(Deep(1000)) + b"}", b"")])
@example([frame_bytes(FrameType.ABORT, 0, 3, b'{"e":' + to_json(Deep(1000)) + b"}", b"")])
@example([frame_bytes(FrameType.REQUEST, 0, 2, b'{"m":"echo","n":0,"h":' + to_json(Deep(300)) + b"}", b"")])
@example([b"\x03", b"\x00"])  # half a prefix: the link waits for the rest (not a hang)
# handlers that end on a link closed by a violation just before: their reply (or their stream's
# close()) raised TransportClosed out of the handler's task
@example([frame_bytes(FrameType.REQUEST, 0, 2, b'{"m":"echo","n":0}', b"")
          + frame_bytes(FrameType.CREDIT, 0, 0, b'{"c":0}', b"")])
@example([frame_bytes(FrameType.OPEN, 0, 2, b'{"m":"stream.echo","h":{},"w":8192}', b""),
          frame_bytes(FrameType.CLOSE, 0, 2, b"", b""), frame_bytes(FrameType.CREDIT, 0, 2, b'{"c":0}', b"")])
@given(sessions(unary=UNARY, streams=STREAMS, first_sid=2))
@fuzz_settings()
async def test_link_survives_or_refuses(served: Served, parts: list[bytes]) -> None:
    with daemon_recursion_limit():
        await check_session(served, parts)


@pytest.mark.parametrize("first", [b"x", b""], ids=["carrying-a-byte", "empty"])
@pytest.mark.parametrize("kind", ["request", "stream"])
async def test_announcing_big_messages_is_a_limit_not_an_allocation(served: Served, kind: str,
                                                                    first: bytes) -> None:
    """Found by reading what the fuzzer sent: a first frame saying "n": 256 MiB made the link
    allocate (and zero) 256 MiB at once, so a few 60-byte frames could exhaust a daemon's memory.
    Announced bytes now count against `max_pending_bytes` before anything is allocated. (A
    review found that a stream message whose first frame carried no byte still skipped the count.)"""
    big = {"n": LIMITS.max_message_bytes, "h": {}}
    if kind == "request":
        parts = [frame_bytes(FrameType.REQUEST, F_MORE, 2 + 2 * i, to_json({"m": "echo", **big}), first)
                 for i in range(LIMITS.max_pending_bytes // LIMITS.max_message_bytes + 1)]
    else:
        parts = []
        for i in range(LIMITS.max_pending_bytes // LIMITS.max_message_bytes + 1):
            sid = 2 + 2 * i
            opening = to_json({"m": "stream.echo", "h": {}, "w": 8192})
            parts.append(frame_bytes(FrameType.OPEN, 0, sid, opening, b""))
            parts.append(frame_bytes(FrameType.DATA, F_MORE, sid, to_json(big), first))
    before = served.counters.get("limits_exceeded", 0)
    link, _ = await run_session(served, parts)
    assert link.closed and link.close_reason.startswith("LimitExceeded"), link.close_reason
    assert served.counters["limits_exceeded"] == before + 1
    await link.close()
