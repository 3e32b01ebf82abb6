"""One authenticated, multiplexed link to a peer over one socket (after the handshake).

Unary calls and streams share the link, each on its own stream id (odd: opened by the dialer,
even: by the listener; ids only grow). A message (request, reply, stream message) is one first
frame carrying the header and the total payload length, then continuation frames (frames.py).

- Fair sending: one writer task serves control frames first, then round-robins over the stream
  ids that have something to send, one chunk (`chunk_bytes`, 1 MiB) at a time; small frames are
  batched into one write. A small call is never stuck behind a big stream.
- Flow control: per stream, the receiver grants a window (`stream_window`); bytes count as
  consumed when the application takes a message or when they land while it waits in receive().
  The receiver sends CREDIT frames as it consumes; a peer that sends past its credit breaks the
  protocol. Unary calls are bounded by `max_message_bytes` and the link's pending limit instead.
- Receiving: payloads are received straight into the message's buffer (or the application's, with
  `receive_into`).
- Hard limits: frame payload, message size, open streams (new ones are refused with an ERROR
  frame), pending inbound bytes (the link is closed: LimitExceeded).
- Cancellation: a caller that gives up sends CANCEL; the handler task is cancelled.
- Keepalive: PING/PONG measures the round-trip time; a peer that stops answering (no PONG and no
  other bytes for `ping_timeout`) is dropped.
- Bandwidth caps (ratelimit.py, optional): data frames go out in quanta booked on the daemon's
  upload bucket, control frames are booked but never wait (they go out while data waits); each
  read books on the download bucket and the next read waits for it.
"""

from __future__ import annotations

import asyncio
import mmap
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from .. import timebase
from .addresses import PeerAddress
from .errors import (
    CallTimeout,
    LimitExceeded,
    ProtocolViolation,
    RemoteError,
    StreamAborted,
    TransportClosed,
    TransportError,
    UnknownMethod,
)
from .frames import F_CONT, F_MORE, Frame, FrameDecoder, FrameType, encode_head, encode_header
from .interface import LinkInfo, Message, RequestContext, StreamHandler, UnaryHandler
from .pipes import Pipe
from .ratelimit import Bandwidth
from .sockio import SocketIO

log = structlog.get_logger(__name__)

_STAGE_BYTES = 256 * 1024  # the read stage grows to this when reads fill it (bulk traffic)
_STAGE_START = 16 * 1024  # ... from this: a link that only carries calls stays small
_DIRECT_MIN = 64 * 1024
_BATCH_BYTES = 1024 * 1024
MIN_MESSAGE_RATE = 1024  # bytes/s: an inbound message slower than this (past the stall timeout) ends its link
MIN_WRITE_RATE = 1024  # bytes/s: a write slower than this (past the stall timeout) ends its link
LAZY_BUFFER_BYTES = 1024 * 1024  # an inbound message this large gets pages only as its bytes come
_INF = float("inf")


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


class _Job:
    """One message to send: a first frame then continuation frames. The header is encoded here,
    so that one that cannot be sent fails its sender (TypeError, ValueError), not the writer."""

    __slots__ = ("cancelled", "ftype", "future", "header", "offset", "payload", "started")

    def __init__(self, ftype: FrameType, header: dict[str, Any] | None, payload: memoryview,
                 future: asyncio.Future[None] | None) -> None:
        self.ftype = ftype
        self.header = encode_header(header)
        self.payload = payload
        self.offset = 0
        self.started = False
        self.cancelled = False
        self.future = future


class _Outbox:
    """What one stream id has to send, in order, and how much it may send (its credit)."""

    __slots__ = ("credit", "jobs", "queued", "sid")

    def __init__(self, sid: int, credit: float) -> None:
        self.sid = sid
        self.jobs: deque[_Job] = deque()
        self.credit = credit
        self.queued = False

    def sendable(self) -> bool:
        if not self.jobs:
            return False
        job = self.jobs[0]
        return job.cancelled or not job.started or job.offset >= len(job.payload) or self.credit > 0


class InboundBudget:
    """The bytes of inbound messages under way, for all the links of one daemon together: the
    per-link bound alone let a few dozen free identities each announce 256 MiB. A link checks
    what all links are owed (announced, not yet received) plus what it is announced now against
    `limit` before it allocates."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # (a dict, not a set: the same order in every simulated run, where ties are broken)
        self.links: dict[Link, None] = {}
        self.refused = 0
        # An upper bound of `due()`: its last exact sum plus every reservation since (what links
        # owe only shrinks between reservations). Summing over every link for each message
        # made a daemon with hundreds of links spend most of its time here.
        self._bound = 0

    def due(self) -> int:
        self._bound = sum(link._due() for link in self.links if not link.closed)
        return self._bound

    def admits(self, total: int) -> bool:
        """Whether `total` more bytes fit: exact only when the cheap bound says they might not."""
        if self._bound + total <= self.limit:
            self._bound += total
            return True
        if self.due() + total <= self.limit:
            self._bound += total
            return True
        return False

    def evict_hog(self, asking: Link, wanted: int) -> bool:
        """The budget is full: close the link that owes the most, if it owes more than `asking`
        would with `wanted` more (an honest peer's small message must not lose its link to an
        attacker's announced gigabytes). True if one was closed."""
        open_links = [link for link in self.links if not link.closed]
        if not open_links:
            return False
        hog = max(open_links, key=lambda link: link._due())
        if hog is asking or hog._due() <= asking._due() + wanted:
            return False
        hog._counters["inbound_budget_evictions"] = hog._counters.get("inbound_budget_evictions", 0) + 1
        hog.begin_close("LimitExceeded: owes the most of this daemon's inbound budget")
        return True


def inbound_buffer(total: int) -> memoryview:
    """A buffer for an inbound message of `total` bytes. A large one is an anonymous mapping,
    whose pages the kernel provides as the message's bytes are written into them: a peer that
    announces 256 MiB and sends a few bytes costs this machine a few pages, not 256 MiB (what it
    announced still counts in full against the link's and the daemon's budgets). A bytearray is
    zeroed, every page touched, at once."""
    if total >= LAZY_BUFFER_BYTES:
        return memoryview(mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE))  # (shared by no child)
    return memoryview(bytearray(total)) if total else memoryview(b"")


class _Assembly:
    """An inbound message being received: its buffer fills frame by frame."""

    __slots__ = ("buffer", "filled", "header", "owned", "started", "total", "touched")

    def __init__(self, header: dict[str, Any], total: int, buffer: memoryview | None, owned: bool) -> None:
        self.header = header
        self.total = total
        self.buffer = buffer  # None: discard
        self.filled = 0
        self.owned = owned  # False: the application's buffer (receive_into)
        self.touched = self.started = timebase.monotonic()  # when its first, last bytes came


class _Served:
    """A unary call the peer made to us."""

    __slots__ = ("deadline", "method", "task")

    def __init__(self, method: str, deadline: float | None) -> None:
        self.method = method
        self.deadline = deadline
        self.task: asyncio.Task[None] | None = None


class LinkStream:
    """A stream within a link (the `Stream` protocol of interface.py, plus `receive_into`)."""

    def __init__(self, link: Link, sid: int, method: str, window: int) -> None:
        self._link = link
        self.sid = sid
        self.method = method
        self._outbox = _Outbox(sid, window)  # until the peer's ACCEPT/OPEN tells its window
        self._window = link.limits.stream_window
        self._recv_allow = self._window
        self._consumed = 0  # consumed but not yet credited back
        self._inbox: deque[tuple[Message, int]] = deque()  # message, bytes not yet consumed
        self._current: _Assembly | None = None
        self._current_consumed = 0
        self._into: memoryview | None = None
        self._waiting = False
        self._changed = asyncio.Event()
        self._failure: asyncio.Future[TransportError] | None = None  # (made when asked for)
        self._remote_closed = False
        self._local_closed = False
        self._error: TransportError | None = None
        self._discarding = False
        self._frame_open = False  # a frame's payload is being read into the current buffer
        self.header: dict[str, Any] = {}
        self.accepted: asyncio.Future[None] = link.loop.create_future()

    # --- application side -------------------------------------------------------------------
    async def send(self, message: Message, *, timeout: float) -> None:
        if self._error is not None:
            raise self._error
        if self._local_closed:
            raise TransportError("send on a stream after close()")
        payload = memoryview(message.payload).cast("B")
        if len(payload) > self._link.limits.max_message_bytes:
            raise LimitExceeded(f"message of {len(payload)} bytes is over max_message_bytes")
        header = {"h": message.header, "n": len(payload)}
        job = _Job(FrameType.DATA, header, payload, self._link.loop.create_future())
        self._link._submit(self._outbox, job)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(job.future)  # type: ignore[arg-type]
        except TimeoutError:
            if job.started:
                await self.abort("send timed out")
            else:
                job.cancelled = True
            raise CallTimeout(f"stream send to {self._link.peer_id} timed out after {timeout}s") from None
        except asyncio.CancelledError:
            if job.started and not job.future.done():  # type: ignore[union-attr]
                self._abort_now("sender cancelled")
            job.cancelled = True
            raise

    async def receive(self, *, timeout: float) -> Message | None:
        return await self._receive(None, timeout)

    async def receive_into(self, buffer: bytearray | memoryview, *, timeout: float) -> Message | None:
        """Like receive(), but the payload lands in `buffer` (the message's payload is a view of
        its first n bytes); a message bigger than the buffer aborts the stream (LimitExceeded)."""
        return await self._receive(memoryview(buffer).cast("B"), timeout)

    async def close(self) -> None:
        if self._local_closed or self._error is not None:
            return
        self._local_closed = True
        self._link._submit(self._outbox, _Job(FrameType.CLOSE, None, memoryview(b""), None))
        self._link._maybe_forget_stream(self)

    async def abort(self, reason: str) -> None:
        self._abort_now(reason)

    # --- internals ----------------------------------------------------------------------------
    def _abort_now(self, reason: str) -> None:
        if self._error is not None:
            return
        for job in self._outbox.jobs:
            job.cancelled = True
        self._link._send_ctrl(FrameType.ABORT, self.sid, {"e": reason[:500]})
        self._fail(StreamAborted(f"stream aborted here: {reason}"))

    def failure(self) -> asyncio.Future[TransportError]:
        """Resolved with the stream's error once it fails (the peer aborted it, we did, or the
        link ended): a handler that holds a stream without reading it (it waits for something
        else first) learns that it is gone."""
        if self._failure is None:
            self._failure = asyncio.get_running_loop().create_future()
            if self._error is not None:
                self._failure.set_result(self._error)
        return self._failure

    def _fail(self, error: TransportError) -> None:
        if self._error is not None:
            return
        self._error = error
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(error)
        if not self.accepted.done():
            self.accepted.set_exception(error)
            self.accepted.exception()  # retrieved: nobody may be waiting
        for job in self._outbox.jobs:
            job.cancelled = True
            if job.future is not None and not job.future.done():
                job.future.set_exception(error)
                job.future.exception()
        self._outbox.jobs.clear()
        self._release_pending()
        self._changed.set()
        self._link._forget_stream(self)

    def _release_pending(self) -> None:
        pending = sum(unconsumed for _, unconsumed in self._inbox)
        if self._current is not None:
            pending += self._current.filled - self._current_consumed
        self._link._pending_in -= pending
        self._inbox.clear()
        self._current = None
        self._current_consumed = 0

    async def _receive(self, into: memoryview | None, timeout: float) -> Message | None:
        if self._waiting:
            raise TransportError("receive on a stream that another task is receiving on")
        self._waiting = True
        try:
            async with asyncio.timeout(timeout):
                while not self._inbox:
                    if self._error is not None:
                        raise self._error
                    if self._remote_closed:
                        return None
                    self._changed.clear()
                    if into is not None and self._into is None:
                        self._take_into(into)
                    self._consume_current()
                    await self._changed.wait()
        except TimeoutError:
            raise CallTimeout(f"stream receive from {self._link.peer_id} timed out after {timeout}s") \
                from None
        finally:
            self._waiting = False
            self._into = None
        message, unconsumed = self._inbox.popleft()
        self._consume(unconsumed)
        if into is not None and message.payload is not None:
            payload = memoryview(message.payload)
            if not _same_buffer(payload, into):
                if len(payload) > len(into):
                    self._abort_now("message larger than the receive buffer")
                    raise LimitExceeded(f"a message of {len(payload)} bytes does not fit the "
                                        f"{len(into)}-byte receive buffer")
                into[:len(payload)] = payload
                message = Message(message.header, into[:len(payload)])
        return message

    def _take_into(self, into: memoryview) -> None:
        """Receive the next (or current) message's payload straight into the caller's buffer."""
        current = self._current
        if current is None:
            self._into = into
        elif current.owned and current.buffer is not None and current.total <= len(into) \
                and not self._frame_open:  # mid-frame, the reader still writes into the old buffer
            into[:current.filled] = current.buffer[:current.filled]
            current.buffer = into[:current.total]
            current.owned = False

    def _consume_current(self) -> None:
        current = self._current
        if current is not None and current.filled > self._current_consumed:
            self._consume(current.filled - self._current_consumed)
            self._current_consumed = current.filled

    def _consume(self, count: int) -> None:
        if count <= 0:
            return
        self._link._pending_in -= count
        self._consumed += count
        if self._consumed >= max(self._window // 4, 1) and not self._remote_closed and self._error is None:
            credit, self._consumed = self._consumed, 0
            self._recv_allow += credit
            self._link._send_ctrl(FrameType.CREDIT, self.sid, {"c": credit})

    # called by the link's reader
    def _allocate(self, header: dict[str, Any], flags: int, length: int) -> memoryview:
        if not flags & F_CONT:
            if self._current is not None:
                raise ProtocolViolation("a stream message began before the previous one ended")
            total = _total(header, length, flags, self._link.limits.max_message_bytes)
            into = self._into
            if into is not None and total <= len(into):
                self._current = _Assembly(header.get("h", {}), total, into[:total], owned=False)
                self._into = None
            else:
                self._link._reserve(total)
                self._current = _Assembly(header.get("h", {}), total, inbound_buffer(total),
                                          owned=True)
            self._current_consumed = 0
        current = self._current
        if current is None or current.buffer is None:
            raise ProtocolViolation("a continuation frame without a message")
        if current.filled + length > current.total:
            raise ProtocolViolation("a stream message is longer than announced")
        self._recv_allow -= length
        if self._recv_allow < 0:
            raise ProtocolViolation(f"peer sent past its flow-control window on stream {self.sid}")
        self._frame_open = True
        return current.buffer[current.filled:current.filled + length]

    def _on_data(self, frame: Frame) -> None:
        self._frame_open = False
        if frame.stream_id and not frame.flags & F_CONT and not len(frame.payload):
            self._allocate_empty(frame)
        current = self._current
        if current is None:
            raise ProtocolViolation("stream data without a message")
        current.filled += len(frame.payload)
        current.touched = timebase.monotonic()
        self._link._add_pending(len(frame.payload))
        if self._waiting:
            self._consume_current()
        if not frame.flags & F_MORE:
            if current.filled != current.total:
                raise ProtocolViolation("a stream message is shorter than announced")
            buffer = current.buffer if current.buffer is not None else memoryview(b"")
            self._inbox.append((Message(current.header, buffer),
                                current.filled - self._current_consumed))
            self._current = None
            self._current_consumed = 0
            if self._discarding:
                self._discard_inbound()
        self._changed.set()

    def _allocate_empty(self, frame: Frame) -> None:
        if self._current is not None:
            raise ProtocolViolation("a stream message began before the previous one ended")
        total = _total(frame.header, 0, frame.flags, self._link.limits.max_message_bytes)
        self._link._reserve(total)  # (a first frame carrying no byte announces as much as any)
        self._current = _Assembly(frame.header.get("h", {}), total, inbound_buffer(total), owned=True)
        self._current_consumed = 0

    def _on_remote_close(self) -> None:
        if self._current is not None:
            raise ProtocolViolation("stream closed in the middle of a message")
        self._remote_closed = True
        self._changed.set()
        self._link._maybe_forget_stream(self)

    def _discard_inbound(self) -> None:
        """Nobody will receive any more (the handler returned): consume and drop what comes."""
        self._discarding = True
        while self._inbox:
            _, unconsumed = self._inbox.popleft()
            self._consume(unconsumed)
        self._link._maybe_forget_stream(self)

    @property
    def finished(self) -> bool:
        return self._error is not None or (self._local_closed and self._remote_closed)


def _same_buffer(a: memoryview, b: memoryview) -> bool:
    return a.obj is b.obj


def _text(value: Any, limit: int) -> str:
    """A peer's free-text field (an error kind, a reason), cut to `limit`. Only a string is taken:
    str() of a JSON value nested a thousand deep raises RecursionError."""
    return value[:limit] if isinstance(value, str) else ""


def _total(header: dict[str, Any], length: int, flags: int, limit: int) -> int:
    total = header.get("n", length)
    if not isinstance(total, int) or isinstance(total, bool) or total < length:
        raise ProtocolViolation("message header has a bad total length")
    if not flags & F_MORE and total != length:
        raise ProtocolViolation("single-frame message with a total length that differs")
    if total > limit:
        raise LimitExceeded(f"peer sent a message of {total} bytes, over the limit of {limit}")
    header_field = header.get("h", {})
    if not isinstance(header_field, dict):
        raise ProtocolViolation("message header 'h' is not an object")
    return total


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
        self._calls: dict[int, asyncio.Future[Message]] = {}
        self._served: dict[int, _Served] = {}
        self._streams: dict[int, LinkStream] = {}
        self._assembling: dict[int, _Assembly] = {}
        self._outboxes: dict[int, _Outbox] = {}
        self._ctrl: deque[bytes] = deque()
        self._ctrl_bytes = 0
        self._ready: deque[_Outbox] = deque()
        self._wake = asyncio.Event()
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
        for coro, name in ((self._read_loop(), "reader"), (self._write_loop_guarded(), "writer"),
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
                        self.bytes_in, self.bytes_out,
                        len(self._streams) + len(self._calls) + len(self._served), self.opened_at)

    def active(self) -> int:
        return len(self._streams) + len(self._calls) + len(self._served)

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
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for stream in list(self._streams.values()):
            stream._fail(error)
        tasks = [t for t in (*self._tasks, *self._handler_tasks) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._log.warning("link_task_failed", task=task.get_name(), error=repr(task.exception()))
        self.io.close()
        self._assembling.clear()  # what its peer owed no longer counts against the budget
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
        self._submit(_Outbox(0, _INF), _Job(FrameType.GOAWAY, {"e": "duplicate link"}, memoryview(b""), None))
        self._maybe_finish_drain()

    def _maybe_finish_drain(self) -> None:
        if not (self.draining and self.remote_draining) or self.active() or self.closed:
            return
        if not self._done_sent:
            self._done_sent = True
            self._send_ctrl(FrameType.GOAWAY, 0, {"e": "drained", "done": True})
        if self._done_received:
            self.begin_close("duplicate link drained")

    # --- outbound -----------------------------------------------------------------------------
    def _new_sid(self) -> int:
        if self.closed:
            raise TransportClosed(f"link to {self.peer_id} is closed")
        sid = self._next_sid
        self._next_sid += 2
        if sid >= 2**32:
            raise LimitExceeded("stream ids exhausted on this link")
        return sid

    async def call(self, method: str, message: Message, deadline: float) -> Message:
        """One unary call; `deadline` is loop.time() by which the reply must have come."""
        payload = memoryview(message.payload).cast("B")
        if len(payload) > self.limits.max_message_bytes:
            raise LimitExceeded(f"request of {len(payload)} bytes is over max_message_bytes")
        sid = self._new_sid()
        remaining_ms = max(1, int((deadline - self.loop.time()) * 1000))
        future: asyncio.Future[Message] = self.loop.create_future()
        self._calls[sid] = future
        outbox = _Outbox(sid, _INF)
        job = _Job(FrameType.REQUEST, {"m": method, "h": message.header, "n": len(payload),
                                       "d": remaining_ms}, payload, None)
        self._submit(outbox, job)
        try:
            async with asyncio.timeout_at(deadline):
                return await future
        except TimeoutError:
            self._cancel_call(sid, job)
            raise CallTimeout(f"call {method!r} to {self.peer_id} timed out") from None
        except asyncio.CancelledError:
            self._cancel_call(sid, job)
            raise
        finally:
            self._calls.pop(sid, None)
            self._maybe_finish_drain()

    def _cancel_call(self, sid: int, job: _Job) -> None:
        if self.closed:
            return
        job.cancelled = True
        if job.started:
            self._send_ctrl(FrameType.CANCEL, sid, None)
        self._assembling.pop(sid, None)

    async def open_stream(self, method: str, header: dict[str, Any], deadline: float) -> LinkStream:
        sid = self._new_sid()
        stream = LinkStream(self, sid, method, 0)
        stream.header = header
        self._streams[sid] = stream
        self._send_ctrl(FrameType.OPEN, sid, {"m": method, "h": header, "w": self.limits.stream_window})
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(stream.accepted)
        except TimeoutError:
            stream._abort_now("open timed out")
            raise CallTimeout(f"opening stream {method!r} to {self.peer_id} timed out") from None
        except asyncio.CancelledError:
            stream._abort_now("opener cancelled")
            raise
        return stream

    def _submit(self, outbox: _Outbox, job: _Job) -> None:
        if self.closed:
            raise TransportClosed(f"link to {self.peer_id} is closed")
        outbox.jobs.append(job)
        self._outboxes[outbox.sid] = outbox
        if not outbox.queued and outbox.sendable():
            outbox.queued = True
            self._ready.append(outbox)
        self._wake.set()

    def _send_ctrl(self, ftype: FrameType, sid: int, header: dict[str, Any] | None,
                   payload: bytes = b"") -> None:
        if self.closed:
            return
        frame = encode_head(ftype, sid, header, len(payload)) + payload
        if self._ctrl_bytes + len(frame) > self.limits.max_control_bytes:
            self._counters["control_queue_overflows"] = self._counters.get("control_queue_overflows", 0) + 1
            self._log.warning("link_control_queue_full", queued=self._ctrl_bytes,
                              hint="the peer sends but does not read")
            self.begin_close("the peer does not read what it asks for (control queue full)")
            return
        self._ctrl.append(frame)
        self._ctrl_bytes += len(frame)
        self._wake.set()

    def _add_credit(self, sid: int, amount: int) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            return
        outbox = stream._outbox
        outbox.credit += amount
        if not outbox.queued and outbox.sendable():
            outbox.queued = True
            self._ready.append(outbox)
            self._wake.set()

    async def _write_loop_guarded(self) -> None:
        try:
            await self._write_loop()
        except TransportClosed as exc:
            self.begin_close(str(exc))
        except Exception as exc:  # a bug of ours: close this link now rather than leave it mute
            self._counters["link_errors"] = self._counters.get("link_errors", 0) + 1
            self._log.error("link_writer_failed", error=repr(exc), exc_info=exc)
            self.begin_close(f"internal error: {type(exc).__name__}")

    async def _write_loop(self) -> None:
        bandwidth = self._bandwidth
        while True:
            chunk_limit = self.limits.chunk_bytes
            throttled = bandwidth is not None and bandwidth.up.rate > 0
            buffers: list[bytes | memoryview] = []
            size = 0
            finished: list[_Job] = []
            while self._ctrl and size < _BATCH_BYTES:
                frame = self._ctrl.popleft()
                self._ctrl_bytes -= len(frame)
                buffers.append(frame)
                size += len(frame)
            ctrl_count, ctrl_size, limit = len(buffers), size, _BATCH_BYTES
            if bandwidth is not None and throttled:  # data in quanta: control frames pass between
                quantum = bandwidth.quantum("up")
                chunk_limit, limit = min(chunk_limit, quantum), size + quantum
            while self._ready and size < limit:
                outbox = self._ready.popleft()
                outbox.queued = False
                job = outbox.jobs[0] if outbox.jobs else None
                if job is None:
                    continue
                if job.cancelled:
                    outbox.jobs.popleft()
                else:
                    remaining = len(job.payload) - job.offset
                    count = int(min(remaining, chunk_limit, outbox.credit))
                    if remaining and count <= 0:
                        continue  # parked until CREDIT comes
                    more = F_MORE if count < remaining else 0
                    if job.started:
                        head = encode_head(job.ftype, outbox.sid, None, count, F_CONT | more)
                    else:
                        head = encode_head(job.ftype, outbox.sid, job.header, count, more)
                        job.started = True
                    buffers.append(head)
                    size += len(head)
                    if count:
                        buffers.append(job.payload[job.offset:job.offset + count])
                        size += count
                        job.offset += count
                        outbox.credit -= count
                    if not more:
                        outbox.jobs.popleft()
                        finished.append(job)
                if outbox.sendable():
                    outbox.queued = True
                    self._ready.append(outbox)
                elif not outbox.jobs:
                    self._outboxes.pop(outbox.sid, None)
            if not buffers:
                self._wake.clear()
                await self._wake.wait()
                continue
            if bandwidth is None:
                await self._send_all(buffers)
            elif throttled and size > ctrl_size:
                if ctrl_count:
                    bandwidth.up.take(ctrl_size)
                    await self._send_all(buffers[:ctrl_count])
                await bandwidth.pay_up(size - ctrl_size, self._wake, self._flush_ctrl)
                await self._send_all(buffers[ctrl_count:])
            else:
                bandwidth.up.take(size)
                await self._send_all(buffers)
            self.bytes_out += size
            for job in finished:
                if job.future is not None and not job.future.done():
                    job.future.set_result(None)

    async def _send_all(self, buffers: list[bytes | memoryview]) -> None:
        """Write to the socket; a write slower than MIN_WRITE_RATE past write_stall_timeout ends
        the link (a peer may send and never read: the write would wait for ever)."""
        allowed = self.limits.write_stall_timeout + sum(map(len, buffers)) / MIN_WRITE_RATE
        try:
            async with asyncio.timeout(allowed):  # slow links are fine; a peer that reads nothing is not
                await self.io.send_all(buffers)
        except TimeoutError:
            self._counters["write_stalls"] = self._counters.get("write_stalls", 0) + 1
            raise TransportClosed(f"the peer took under {MIN_WRITE_RATE} B/s of {allowed:.0f} s of "
                                  "writes") from None

    async def _flush_ctrl(self) -> None:
        """Send the control frames queued now (while data waits for the upload cap)."""
        frames = list(self._ctrl)
        self._ctrl.clear()
        self._ctrl_bytes = 0
        if frames:
            size = sum(map(len, frames))
            if self._bandwidth is not None:
                self._bandwidth.up.take(size)
            await self._send_all(frames)
            self.bytes_out += size

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
        due = self._pending_in
        due += sum(a.total - a.filled for a in self._assembling.values() if a.buffer is not None)
        for stream in self._streams.values():
            current = stream._current
            if current is not None and current.owned and current.buffer is not None:
                due += current.total - current.filled
        return due

    def _stalled_message(self, now: float) -> bool:
        """A message the peer began and then stopped sending (for message_stall_timeout), or
        trickles at under MIN_MESSAGE_RATE (a byte now and then kept its buffer taken)."""
        timeout = self.limits.message_stall_timeout
        under_way = [a for a in self._assembling.values() if a.buffer is not None]
        under_way += [s._current for s in self._streams.values()
                      if s._current is not None and s._current.owned and s._current.buffer is not None]
        return any(a.filled < a.total and (now - a.touched > timeout or (
            now - a.started > timeout and a.filled < (now - a.started) * MIN_MESSAGE_RATE))
            for a in under_way)

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
            if not flags & F_CONT:
                self._begin_message(ftype, flags, sid, header, length)
            assembly = self._assembling.get(sid)
            if assembly is not None and assembly.buffer is not None:
                if assembly.filled + length > assembly.total:
                    raise ProtocolViolation("a message is longer than announced")
                return assembly.buffer[assembly.filled:assembly.filled + length]
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
            await self._read_frames()
        except (ProtocolViolation, LimitExceeded) as exc:
            key = "protocol_violations" if isinstance(exc, ProtocolViolation) else "limits_exceeded"
            self._counters[key] = self._counters.get(key, 0) + 1
            self._log.warning("link_peer_misbehaved", error=str(exc), kind=type(exc).__name__)
            self.begin_close(f"{type(exc).__name__}: {exc}")
        except TransportClosed as exc:
            self.begin_close(str(exc))
        except Exception as exc:  # a bug of ours: close this link now rather than leave it deaf
            self._counters["link_errors"] = self._counters.get("link_errors", 0) + 1
            self._log.error("link_reader_failed", error=repr(exc), exc_info=exc)
            self.begin_close(f"internal error: {type(exc).__name__}")

    async def _read_frames(self) -> None:
        decoder = FrameDecoder(max_payload=self.limits.max_payload, allocate=self._allocate)
        view = memoryview(bytearray(_STAGE_START))
        start = end = 0
        io = self.io
        bandwidth = self._bandwidth
        owed = 0  # bytes of the last read, booked on the download cap before the next read
        while True:
            target = decoder.next_target()
            if end > start:
                count = min(len(target), end - start)
                target[:count] = view[start:start + count]
                start += count
            else:
                read_limit: int | None = None
                if bandwidth is not None and bandwidth.down.rate > 0:
                    await bandwidth.pay_down(owed)
                    read_limit = bandwidth.quantum("down")
                if len(target) >= _DIRECT_MIN:
                    count = owed = await io.recv_into(target[:read_limit])
                    if not count:
                        raise TransportClosed("the peer closed the connection")
                    self.bytes_in += count
                    self._last_heard = timebase.monotonic()
                else:
                    start, end = 0, await io.recv_into(view[:read_limit])
                    if not end:
                        raise TransportClosed("the peer closed the connection")
                    if end == len(view) < _STAGE_BYTES:  # full: more is coming, read bigger
                        grown = memoryview(bytearray(min(2 * len(view), _STAGE_BYTES)))
                        grown[:end] = view[:end]
                        view = grown
                    owed = end
                    self.bytes_in += end
                    self._last_heard = timebase.monotonic()
                    continue
            frame = decoder.advance(count)
            if frame is not None:
                self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        ftype, sid = frame.type, frame.stream_id
        if ftype not in (FrameType.PING, FrameType.PONG, FrameType.CREDIT):
            self._last_activity = timebase.monotonic()
        if ftype == FrameType.DATA:
            stream = self._streams.get(sid)
            if stream is not None and stream._error is None:
                stream._on_data(frame)
        elif ftype in (FrameType.REQUEST, FrameType.RESPONSE):
            self._on_message_frame(frame)
        elif ftype == FrameType.CREDIT:
            amount = frame.header.get("c")
            if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
                raise ProtocolViolation("CREDIT without a positive amount")
            self._add_credit(sid, amount)
        elif ftype == FrameType.OPEN:
            self._on_open(frame)
        elif ftype == FrameType.ACCEPT:
            self._on_accept(frame)
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
            self._on_cancel(sid)
        elif ftype == FrameType.ERROR:
            self._on_error(frame)
        elif ftype == FrameType.PING:
            self._send_ctrl(FrameType.PONG, 0, None, bytes(frame.payload))
        elif ftype == FrameType.PONG:
            self._on_pong(bytes(frame.payload))
        elif ftype == FrameType.GOAWAY:
            self.remote_draining = True
            if frame.header.get("done") is True:
                self._done_received = True
            self._maybe_finish_drain()
        else:
            raise ProtocolViolation(f"unexpected {ftype.name} frame on an open link")

    def _check_new_sid(self, sid: int) -> None:
        if sid == 0 or (sid % 2 == 1) != (not self.outbound) or sid <= self._peer_max_sid:
            raise ProtocolViolation(f"peer opened stream id {sid}, which is not a new id of its own")
        self._peer_max_sid = sid

    def _begin_message(self, ftype: FrameType, flags: int, sid: int, header: dict[str, Any],
                       length: int) -> None:
        """The first frame of a request or a reply: validate it and set up its assembly."""
        total = _total(header, length, flags, self.limits.max_message_bytes)
        if ftype == FrameType.RESPONSE:
            if sid in self._calls:
                self._reserve(total)
            buffer = inbound_buffer(total) if sid in self._calls else None
            self._assembling[sid] = _Assembly(header, total, buffer, owned=True)
            return
        self._check_new_sid(sid)
        method = header.get("m")
        deadline_ms = header.get("d")
        if not isinstance(method, str):
            raise ProtocolViolation("request without a method name")
        if deadline_ms is not None and (not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool)
                                        or deadline_ms <= 0):
            raise ProtocolViolation("request with a bad deadline")
        if self.active() >= self.limits.max_streams:
            self._counters["streams_refused"] = self._counters.get("streams_refused", 0) + 1
            self._send_ctrl(FrameType.ERROR, sid, {
                "k": "LimitExceeded", "e": f"too many open calls/streams (max {self.limits.max_streams})"})
            self._assembling[sid] = _Assembly(header, total, None, owned=True)
            return
        self._reserve(total)
        deadline = None if deadline_ms is None else self.loop.time() + deadline_ms / 1000
        self._served[sid] = _Served(method, deadline)
        self._assembling[sid] = _Assembly(header, total, inbound_buffer(total), owned=True)

    def _on_message_frame(self, frame: Frame) -> None:
        sid = frame.stream_id
        if not frame.flags & F_CONT and not len(frame.payload):
            self._begin_message(frame.type, frame.flags, sid, frame.header, 0)
        assembly = self._assembling.get(sid)
        if assembly is None:
            return  # continuation of a call we no longer track
        count = len(frame.payload)
        assembly.filled += count
        assembly.touched = timebase.monotonic()
        if assembly.buffer is not None:
            self._add_pending(count)
        if frame.flags & F_MORE:
            return
        del self._assembling[sid]
        if assembly.buffer is None:
            return
        if assembly.filled != assembly.total:
            raise ProtocolViolation("a message is shorter than announced")
        self._pending_in -= assembly.filled
        header = assembly.header.get("h", {})
        message = Message(header, assembly.buffer)
        if frame.type == FrameType.RESPONSE:
            future = self._calls.get(sid)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            served = self._served.get(sid)
            if served is not None:
                self._start_handler(sid, served, message)

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = self.loop.create_task(coro, name=name)  # type: ignore[arg-type]
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)
        return task

    def _start_handler(self, sid: int, served: _Served, message: Message) -> None:
        served.task = self._spawn(self._serve_unary(sid, served, message), f"serve-{served.method}")

    async def _serve_unary(self, sid: int, served: _Served, message: Message) -> None:
        handler = self._dispatcher.unary.get(served.method)
        try:
            if handler is None:
                self._counters["unknown_methods"] = self._counters.get("unknown_methods", 0) + 1
                self._send_ctrl(FrameType.ERROR, sid, {
                    "k": "UnknownMethod", "e": f"no handler for {served.method!r}"})
                return
            try:
                async with asyncio.timeout_at(served.deadline):
                    reply = await handler(self._context, message)
                if not isinstance(reply, Message):
                    raise TypeError(f"handler for {served.method!r} returned {type(reply).__name__}, "
                                    "not a Message")
            except TimeoutError:
                return  # the caller has given up by now
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the handler's failure becomes the caller's RemoteError
                self._log.info("handler_failed", method=served.method, error=repr(exc))
                self._send_ctrl(FrameType.ERROR, sid, {"k": type(exc).__name__, "e": str(exc)[:2000]})
                return
            payload = memoryview(reply.payload).cast("B")
            if len(payload) > self.limits.max_message_bytes:
                self._send_ctrl(FrameType.ERROR, sid, {"k": "LimitExceeded",
                                                       "e": "reply over max_message_bytes"})
                return
            try:
                job = _Job(FrameType.RESPONSE, {"h": reply.header, "n": len(payload)}, payload,
                           self.loop.create_future())
            except (TypeError, ValueError) as exc:  # e.g. a header echoed from a hostile request
                self._log.info("handler_reply_unsendable", method=served.method, error=repr(exc))
                self._send_ctrl(FrameType.ERROR, sid, {"k": type(exc).__name__,
                                                       "e": f"reply header cannot be sent: {exc}"[:2000]})
                return
            if self.closed:  # closed while the handler ran: nobody to answer
                return
            self._submit(_Outbox(sid, _INF), job)
            try:
                async with asyncio.timeout(self.limits.send_timeout):
                    await asyncio.shield(job.future)  # type: ignore[arg-type]
            except TimeoutError:
                job.cancelled = True
            except asyncio.CancelledError:
                job.cancelled = True
                raise
        finally:
            self._served.pop(sid, None)
            self._maybe_finish_drain()

    def _on_cancel(self, sid: int) -> None:
        served = self._served.pop(sid, None)
        self._assembling.pop(sid, None)
        if served is not None and served.task is not None:
            served.task.cancel()
        outbox = self._outboxes.get(sid)
        if outbox is not None:
            for job in outbox.jobs:
                job.cancelled = True
        self._maybe_finish_drain()

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
        future = self._calls.get(sid)
        if future is not None:
            self._assembling.pop(sid, None)
            if not future.done():
                future.set_exception(error)
            return
        stream = self._streams.get(sid)
        if stream is not None:
            stream._fail(error)

    def _on_open(self, frame: Frame) -> None:
        sid = frame.stream_id
        self._check_new_sid(sid)
        method, window = frame.header.get("m"), frame.header.get("w")
        header = frame.header.get("h", {})
        if not isinstance(method, str) or not isinstance(header, dict) or not isinstance(window, int) \
                or window <= 0:
            raise ProtocolViolation("OPEN without a method, a header object and a window")
        if self.active() >= self.limits.max_streams:
            self._counters["streams_refused"] = self._counters.get("streams_refused", 0) + 1
            self._send_ctrl(FrameType.ERROR, sid, {
                "k": "LimitExceeded", "e": f"too many open calls/streams (max {self.limits.max_streams})"})
            return
        handler = self._dispatcher.streams.get(method)
        if handler is None:
            self._counters["unknown_methods"] = self._counters.get("unknown_methods", 0) + 1
            self._send_ctrl(FrameType.ERROR, sid, {"k": "UnknownMethod",
                                                   "e": f"no stream handler for {method!r}"})
            return
        stream = LinkStream(self, sid, method, window)
        stream.accepted.set_result(None)
        self._streams[sid] = stream
        self._send_ctrl(FrameType.ACCEPT, sid, {"w": self.limits.stream_window})
        stream.header = header
        self._spawn(self._serve_stream(handler, stream), f"stream-{method}")

    async def _serve_stream(self, handler: StreamHandler, stream: LinkStream) -> None:
        try:
            await handler(self._context, stream)
        except asyncio.CancelledError:
            stream._abort_now("handler cancelled")
            raise
        except Exception as exc:  # the handler's failure aborts the stream with its message
            self._log.info("stream_handler_failed", method=stream.method, error=repr(exc))
            stream._abort_now(f"{type(exc).__name__}: {exc}")
        else:
            if stream._error is None and not self.closed:  # (a closed link fails its streams soon)
                await stream.close()
                stream._discard_inbound()

    def _on_accept(self, frame: Frame) -> None:
        stream = self._streams.get(frame.stream_id)
        window = frame.header.get("w")
        if not isinstance(window, int) or window <= 0:
            raise ProtocolViolation("ACCEPT without a window")
        if stream is None or stream.accepted.done():
            return
        self._add_credit(stream.sid, window)
        stream.accepted.set_result(None)

    def _forget_stream(self, stream: LinkStream) -> None:
        self._streams.pop(stream.sid, None)
        self._outboxes.pop(stream.sid, None)
        self._maybe_finish_drain()

    def _maybe_forget_stream(self, stream: LinkStream) -> None:
        if stream.finished:
            self._forget_stream(stream)

    # --- keepalive ----------------------------------------------------------------------------
    def _ping(self) -> None:
        self._ping_seq += 1
        self._ping_sent[self._ping_seq] = timebase.monotonic()
        if len(self._ping_sent) > 8:
            self._ping_sent.pop(min(self._ping_sent))
        self._send_ctrl(FrameType.PING, 0, None, self._ping_seq.to_bytes(8, "big"))

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
