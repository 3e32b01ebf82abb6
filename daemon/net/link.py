"""One authenticated, multiplexed link to a peer over one socket (after the handshake).

Unary calls and streams share the link, each on its own stream id (odd: opened by the dialer,
even: by the listener; ids only grow). A message (request, reply, stream message) is one first
frame carrying the header and the total payload length, then continuation frames (frames.py).

The link hands each frame it reads to what the frame's stream id belongs to. Its parts:
- link_reader.py: the reading side (payloads received in place, the download cap);
- link_writer.py: the sending side (fair scheduling, the control queue, write stalls, the upload
  cap);
- link_calls.py: unary calls, made and served (cancellation included);
- link_stream.py: streams (`LinkStream`) and their flow control;
- inbound.py: the memory inbound messages take (`InboundBudget`, `inbound_buffer`).

- Hard limits: frame payload, message size, open streams (new ones are refused with an ERROR
  frame), pending inbound bytes (the link is closed: LimitExceeded).
- Keepalive: PING/PONG measures the round-trip time; a peer that stops answering (no PONG and no
  other bytes for `ping_timeout`) is dropped, and so is one that leaves a message half-sent
  (`message_stall_timeout`).
- Draining: a duplicate link says GOAWAY and closes once neither side has anything active.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog

from .. import timebase
from .addresses import PeerAddress
from .errors import (
    LimitExceeded,
    ProtocolViolation,
    RemoteError,
    StreamAborted,
    TransportClosed,
    TransportError,
    UnknownMethod,
)
from .frames import Frame, FrameDecoder, FrameType
from .inbound import LAZY_BUFFER_BYTES, Assembly, InboundBudget, inbound_buffer
from .interface import LinkInfo, Message, RequestContext, StreamHandler, UnaryHandler
from .link_calls import UnaryCalls
from .link_reader import read_frames
from .link_stream import LinkStream, StreamTable
from .link_writer import Job, LinkWriter, Outbox
from .pipes import Pipe
from .ratelimit import Bandwidth
from .sockio import SocketIO

# (what other modules import from here, some of it from the modules it is made of)
__all__ = ["LAZY_BUFFER_BYTES", "Dispatcher", "InboundBudget", "Link", "LinkLimits", "LinkStream",
           "inbound_buffer"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LinkLimits:
    """Per-link limits and timings (defaults suit the internet; tests shrink them)."""

    max_payload: int = 16 * 1024 * 1024
    chunk_bytes: int = 1024 * 1024
    max_message_bytes: int = 256 * 1024 * 1024
    stream_window: int = 8 * 1024 * 1024
    max_streams: int = 512
    max_pending_bytes: int = 256 * 1024 * 1024
    ping_interval: float = 15.0
    ping_timeout: float = 45.0
    idle_timeout: float | None = None
    drain_grace: float = 30.0
    send_timeout: float = 60.0
    # Control frames (PONGs, CREDITs, ERRORs, ...) queued to a peer that does not read them: past
    # this the link is closed (a peer that sends PINGs and never reads grew the queue unbounded).
    max_control_bytes: int = 16 * 1024 * 1024
    # A write slower than MIN_WRITE_RATE after this long closes the link (a peer that reads nothing)
    write_stall_timeout: float = 120.0
    # A message received part-way, then nothing (or under MIN_MESSAGE_RATE) this long: closed
    message_stall_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.chunk_bytes > self.max_payload:
            raise ValueError("chunk_bytes must not exceed max_payload")


class Dispatcher:
    """What a link serves: the transport's handler tables."""

    def __init__(self) -> None:
        self.unary: dict[str, UnaryHandler] = {}
        self.streams: dict[str, StreamHandler] = {}


def _text(value: Any, limit: int) -> str:
    """A peer's free-text field (an error kind, a reason), cut to `limit`. Only a string is taken:
    str() of a JSON value nested a thousand deep raises RecursionError."""
    return value[:limit] if isinstance(value, str) else ""


class Link:
    """One link. The transport creates it after the handshake and calls `start()`."""

    def __init__(self, io: SocketIO | Pipe, *, peer_id: str, peer_addresses: tuple[PeerAddress, ...],
                 outbound: bool, address: str | None, limits: LinkLimits, dispatcher: Dispatcher,
                 on_closed: Callable[[Link], None], counters: dict[str, int],
                 local_peer_id: str = "", bandwidth: Bandwidth | None = None,
                 budget: InboundBudget | None = None) -> None:
        self.io = io
        self._budget = budget
        if budget is not None:
            budget.links[self] = None
        self.peer_id = peer_id
        self.peer_addresses = peer_addresses
        self.outbound = outbound
        self.address = address
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.opened_at = timebase.now()
        self.rtt_ms: float | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.draining = False  # we sent GOAWAY: no new calls from us
        self.remote_draining = False  # the peer sent GOAWAY
        self._dispatcher = dispatcher
        self._on_closed = on_closed
        self._counters = counters
        self._context = RequestContext(peer_id, io.kind, peer_addresses,
                                       remote_host=_direct_host(io.kind, address))
        self._log = log.bind(peer_id=peer_id, local=local_peer_id, outbound=outbound)
        self._next_sid = 1 if outbound else 2
        self._peer_max_sid = 0
        self._unary = UnaryCalls(self)
        self._streams = StreamTable(self)
        self._writer = LinkWriter(self, bandwidth)
        self._pending_in = 0
        self._scratch = bytearray(0)
        self._last_activity = timebase.monotonic()
        self._last_pong = timebase.monotonic()
        self._last_heard = timebase.monotonic()  # bytes came in (a throttled peer's pongs come late)
        self._bandwidth = bandwidth  # this daemon's caps (ratelimit.py); None: not metered here
        self._ping_sent: dict[int, float] = {}
        self._ping_seq = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._handler_tasks: set[asyncio.Task[Any]] = set()
        self._closer: asyncio.Task[None] | None = None
        self._wait_closing = asyncio.Event()
        self.closed = False
        self.close_reason = ""
        self._drain_started = 0.0
        self._done_sent = False
        self._done_received = False

    # --- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for coro, name in ((self._read_loop(), "reader"), (self._writer.run(), "writer"),
                           (self._keepalive_loop(), "keepalive")):
            task = self.loop.create_task(coro, name=f"link-{name}-{self.peer_id[:8]}")
            self._tasks.add(task)

    @property
    def usable(self) -> bool:
        return not (self.closed or self.draining or self.remote_draining)

    @property
    def kind(self) -> str:
        """The path: tcp (direct), holepunch, webrtc or relay."""
        return str(self.io.kind)

    def info(self) -> LinkInfo:
        return LinkInfo(self.peer_id, self.address, self.io.kind, self.outbound, self.rtt_ms,
                        self.bytes_in, self.bytes_out, self.active(), self.opened_at)

    def active(self) -> int:
        return self._streams.active() + self._unary.active()

    def begin_close(self, reason: str) -> asyncio.Task[None]:
        if self._closer is None:
            self.closed = True
            self.close_reason = reason
            self._closer = self.loop.create_task(self._do_close(reason), name="link-close")
            self._wait_closing.set()
        return self._closer

    async def close(self, reason: str = "closed") -> None:
        await asyncio.shield(self.begin_close(reason))

    async def wait_closed(self) -> None:
        """Return once the link has closed (for whoever keeps its pipe alive, e.g. a relay stream)."""
        while self._closer is None:
            await self._wait_closing.wait()
        await asyncio.shield(self._closer)

    async def _do_close(self, reason: str) -> None:
        error = TransportClosed(f"link to {self.peer_id} closed: {reason}")
        self._unary.fail_all(error)
        self._streams.fail_all(error)
        tasks = [t for t in (*self._tasks, *self._handler_tasks) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._log.warning("link_task_failed", task=task.get_name(), error=repr(task.exception()))
        self.io.close()
        self._unary.assembling.clear()  # what its peer owed no longer counts against the budget
        if self._budget is not None:
            self._budget.links.pop(self, None)
        self._log.debug("link_closed", reason=reason)
        self._on_closed(self)

    def start_drain(self) -> None:
        """Say GOAWAY: no new calls here. Once neither side has anything active, each says
        GOAWAY {"done": true}; a side that has said and heard "done" closes the link."""
        if self.draining or self.closed:
            return
        self.draining = True
        self._drain_started = timebase.monotonic()
        # a job, not a control frame: it goes out after the first frames of every call already
        # queued, so the peer has seen all our calls on this link before it hears GOAWAY
        self._writer.submit(Outbox(0, math.inf),
                            Job(FrameType.GOAWAY, {"e": "duplicate link"}, memoryview(b""), None))
        self._maybe_finish_drain()

    def _maybe_finish_drain(self) -> None:
        if not (self.draining and self.remote_draining) or self.active() or self.closed:
            return
        if not self._done_sent:
            self._done_sent = True
            self._writer.send_ctrl(FrameType.GOAWAY, 0, {"e": "drained", "done": True})
        if self._done_received:
            self.begin_close("duplicate link drained")

    # --- calls and streams --------------------------------------------------------------------
    def _new_sid(self) -> int:
        if self.closed:
            raise TransportClosed(f"link to {self.peer_id} is closed")
        sid = self._next_sid
        self._next_sid += 2
        if sid >= 2**32:
            raise LimitExceeded("stream ids exhausted on this link")
        return sid

    def _check_new_sid(self, sid: int) -> None:
        if sid == 0 or (sid % 2 == 1) != (not self.outbound) or sid <= self._peer_max_sid:
            raise ProtocolViolation(f"peer opened stream id {sid}, which is not a new id of its own")
        self._peer_max_sid = sid

    async def call(self, method: str, message: Message, deadline: float) -> Message:
        """One unary call; `deadline` is loop.time() by which the reply must have come."""
        return await self._unary.call(method, message, deadline)

    async def open_stream(self, method: str, header: dict[str, Any], deadline: float) -> LinkStream:
        return await self._streams.open(method, header, deadline)

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run a handler (a unary call's or a stream's): cancelled when the link closes."""
        task = self.loop.create_task(coro, name=name)  # type: ignore[arg-type]
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)
        return task

    # --- inbound ------------------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        """Before a buffer for an inbound message is allocated: the bytes still to come into the
        buffers of messages under way count with the pending ones against `max_pending_bytes`
        (a peer may announce 256 MiB in a 60-byte frame and never send them)."""
        if not total:
            return
        due = self._due() + total
        if due > self.limits.max_pending_bytes:
            raise LimitExceeded(f"peer announced messages of {due} bytes in all, over the limit of "
                                f"{self.limits.max_pending_bytes} pending bytes")
        budget = self._budget
        while budget is not None and not budget.admits(total):
            if budget.evict_hog(self, total):
                continue
            budget.refused += 1
            raise LimitExceeded(f"a message of {total} bytes would take this daemon's inbound "
                                f"messages past {budget.limit} bytes in all")

    def _due(self) -> int:
        """Bytes this link's peer announced and has not delivered or had consumed yet."""
        return self._pending_in + sum(a.total - a.filled for a in self._under_way())

    def _stalled_message(self, now: float) -> bool:
        """A message the peer began and then stopped sending (for message_stall_timeout), or
        trickles at under MIN_MESSAGE_RATE (inbound.py; a byte now and then kept its buffer taken)."""
        timeout = self.limits.message_stall_timeout
        return any(a.stalled(now, timeout) for a in self._under_way())

    def _under_way(self) -> Iterator[Assembly]:
        """The inbound messages being received into buffers of this link's."""
        return itertools.chain(self._unary.under_way(), self._streams.under_way())

    def _add_pending(self, count: int) -> None:
        self._pending_in += count
        if self._pending_in > self.limits.max_pending_bytes:
            raise LimitExceeded(f"peer has {self._pending_in} unconsumed bytes pending, over the "
                                f"limit of {self.limits.max_pending_bytes}")

    def _allocate(self, ftype: FrameType, flags: int, sid: int, header: dict[str, Any],
                  length: int) -> memoryview:
        if ftype == FrameType.DATA:
            stream = self._streams.get(sid)
            if stream is not None and stream._error is None:
                return stream._allocate(header, flags, length)
        elif ftype in (FrameType.REQUEST, FrameType.RESPONSE):
            target = self._unary.allocate(ftype, flags, sid, header, length)
            if target is not None:
                return target
        elif ftype in (FrameType.PING, FrameType.PONG):
            if length > 64:
                raise ProtocolViolation("ping payload too long")
        elif length > 0:
            raise ProtocolViolation(f"{ftype.name} frames carry no payload")
        # discard: a frame for a call or stream we no longer track, or a ping's few bytes (the
        # scratch grows by doubling from what is asked: a 64 KiB floor cost every link of
        # hundreds 64 KiB for its first ping)
        if len(self._scratch) < length:
            self._scratch = bytearray(min(max(length, 2 * len(self._scratch)), self.limits.max_payload))
        return memoryview(self._scratch)[:length]

    async def _read_loop(self) -> None:
        try:
            decoder = FrameDecoder(max_payload=self.limits.max_payload, allocate=self._allocate)
            await read_frames(self.io, decoder, self._bandwidth, self._heard, self._on_frame)
        except (ProtocolViolation, LimitExceeded) as exc:
            key = "protocol_violations" if isinstance(exc, ProtocolViolation) else "limits_exceeded"
            self._counters[key] = self._counters.get(key, 0) + 1
            self._log.warning("link_peer_misbehaved", error=str(exc), kind=type(exc).__name__)
            self.begin_close(f"{type(exc).__name__}: {exc}")
        except TransportClosed as exc:
            self.begin_close(str(exc))
        except Exception as exc:  # a bug of ours: close this link now rather than leave it deaf
            self.fail_internally("link_reader_failed", exc)

    def fail_internally(self, event: str, exc: Exception) -> None:
        """A bug of ours in this link's reader or writer: counted, logged, and the link closed."""
        self._counters["link_errors"] = self._counters.get("link_errors", 0) + 1
        self._log.error(event, error=repr(exc), exc_info=exc)
        self.begin_close(f"internal error: {type(exc).__name__}")

    def _heard(self, count: int) -> None:
        """`count` bytes came in."""
        self.bytes_in += count
        self._last_heard = timebase.monotonic()

    def _on_frame(self, frame: Frame) -> None:
        ftype, sid = frame.type, frame.stream_id
        if ftype not in (FrameType.PING, FrameType.PONG, FrameType.CREDIT):
            self._last_activity = timebase.monotonic()
        if ftype == FrameType.DATA:
            stream = self._streams.get(sid)
            if stream is not None and stream._error is None:
                stream._on_data(frame)
        elif ftype in (FrameType.REQUEST, FrameType.RESPONSE):
            self._unary.on_frame(frame)
        elif ftype == FrameType.CREDIT:
            amount = frame.header.get("c")
            if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
                raise ProtocolViolation("CREDIT without a positive amount")
            self._streams.add_credit(sid, amount)
        elif ftype == FrameType.OPEN:
            self._streams.on_open(frame)
        elif ftype == FrameType.ACCEPT:
            self._streams.on_accept(frame)
        elif ftype == FrameType.CLOSE:
            stream = self._streams.get(sid)
            if stream is not None:
                stream._on_remote_close()
        elif ftype == FrameType.ABORT:
            stream = self._streams.get(sid)
            if stream is not None:
                reason = _text(frame.header.get("e"), 500)
                stream._fail(StreamAborted(f"stream aborted by {self.peer_id}: {reason}"))
        elif ftype == FrameType.CANCEL:
            self._unary.on_cancel(sid)
        elif ftype == FrameType.ERROR:
            self._on_error(frame)
        elif ftype == FrameType.PING:
            self._writer.send_ctrl(FrameType.PONG, 0, None, bytes(frame.payload))
        elif ftype == FrameType.PONG:
            self._on_pong(bytes(frame.payload))
        elif ftype == FrameType.GOAWAY:
            self.remote_draining = True
            if frame.header.get("done") is True:
                self._done_received = True
            self._maybe_finish_drain()
        else:
            raise ProtocolViolation(f"unexpected {ftype.name} frame on an open link")

    def _on_error(self, frame: Frame) -> None:
        sid = frame.stream_id
        kind = _text(frame.header.get("k"), 100) or "Error"
        text = _text(frame.header.get("e"), 2000)
        error: TransportError
        if kind == "UnknownMethod":
            error = UnknownMethod(kind, text)
        elif kind == "LimitExceeded":
            error = LimitExceeded(f"peer {self.peer_id} refused: {text}")
        else:
            error = RemoteError(kind, text)
        if self._unary.fail_call(sid, error):
            return
        stream = self._streams.get(sid)
        if stream is not None:
            stream._fail(error)

    # --- keepalive ----------------------------------------------------------------------------
    def _ping(self) -> None:
        self._ping_seq += 1
        self._ping_sent[self._ping_seq] = timebase.monotonic()
        if len(self._ping_sent) > 8:
            self._ping_sent.pop(min(self._ping_sent))
        self._writer.send_ctrl(FrameType.PING, 0, None, self._ping_seq.to_bytes(8, "big"))

    def _on_pong(self, payload: bytes) -> None:
        sent = self._ping_sent.pop(int.from_bytes(payload[:8], "big"), None)
        if sent is not None:
            self.rtt_ms = (timebase.monotonic() - sent) * 1000
            self._last_pong = timebase.monotonic()

    async def _keepalive_loop(self) -> None:
        self._ping()
        while True:
            await asyncio.sleep(self.limits.ping_interval)
            now = timebase.monotonic()
            if now - max(self._last_pong, self._last_heard) > self.limits.ping_timeout:
                self.begin_close(f"no keepalive answer for {self.limits.ping_timeout}s")
                return
            idle = self.limits.idle_timeout
            if idle is not None and not self.active() and now - self._last_activity > idle:
                self.begin_close("idle")
                return
            if self.draining and now - self._drain_started > self.limits.drain_grace:
                self.begin_close("duplicate link drain grace passed")
                return
            if self._stalled_message(now):  # its buffer would stay taken while pings go on
                self._counters["messages_stalled"] = self._counters.get("messages_stalled", 0) + 1
                self.begin_close(f"a message stalled half-received for "
                                 f"{self.limits.message_stall_timeout:g}s")
                return
            self._ping()


_DIRECT_KINDS = ("tcp", "tcp-plain", "holepunch")  # a socket of ours at one end, the peer's at the other


def _direct_host(kind: str, address: str | None) -> str | None:
    """The IP address at the other end of a direct link (from the address its socket connected
    to or from); None for a relayed or WebRTC link, or an address without an IP."""
    if kind not in _DIRECT_KINDS or address is None:
        return None
    try:
        parsed = PeerAddress.parse(address)
    except ValueError:
        return None
    return parsed.host if parsed.host_kind in ("ip4", "ip6") else None
