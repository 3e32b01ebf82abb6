"""Streams on a link: `LinkStream`, an ordered exchange of messages in both directions on one
stream id, with flow control; `StreamTable`, the link's streams by id (opening one, serving the
peer's, routing credit).

- Opening: OPEN {"m": method, "h": header, "w": window} on a new id of the opener's, answered by
  ACCEPT {"w": window} or an ERROR frame (an unknown method, too many open calls and streams).
- Flow control: per stream, the receiver grants a window (`stream_window`); bytes count as
  consumed when the application takes a message or when they land while it waits in receive().
  The receiver sends CREDIT frames as it consumes; a peer that sends past its credit breaks the
  protocol.
- Receiving: payloads are received straight into the message's buffer (or the application's, with
  `receive_into`).
- Ending: each side closes its own direction (CLOSE); ABORT (either side, or a handler that
  fails) tears the whole stream down, and a link that ends fails its streams.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import timebase
from .errors import CallTimeout, LimitExceeded, ProtocolViolation, StreamAborted, TransportError
from .frames import F_CONT, F_MORE, Frame, FrameType
from .inbound import Assembly, inbound_buffer, message_total
from .interface import Message, StreamHandler
from .link_writer import Job, Outbox

if TYPE_CHECKING:
    from .link import Link


class LinkStream:
    """A stream within a link (the `Stream` protocol of interface.py, plus `receive_into`)."""

    def __init__(self, link: Link, sid: int, method: str, window: int) -> None:
        self._link = link
        self.sid = sid
        self.method = method
        self._outbox = Outbox(sid, window)  # until the peer's ACCEPT/OPEN tells its window
        self._window = link.limits.stream_window
        self._recv_allow = self._window
        self._consumed = 0  # consumed but not yet credited back
        self._inbox: deque[tuple[Message, int]] = deque()  # message, bytes not yet consumed
        self._current: Assembly | None = None
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
        job = Job(FrameType.DATA, header, payload, self._link.loop.create_future())
        self._link._writer.submit(self._outbox, job)
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
        self._link._writer.submit(self._outbox, Job(FrameType.CLOSE, None, memoryview(b""), None))
        self._link._streams.maybe_forget(self)

    async def abort(self, reason: str) -> None:
        self._abort_now(reason)

    # --- internals ----------------------------------------------------------------------------
    def _abort_now(self, reason: str) -> None:
        if self._error is not None:
            return
        for job in self._outbox.jobs:
            job.cancelled = True
        self._link._writer.send_ctrl(FrameType.ABORT, self.sid, {"e": reason[:500]})
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
        self._link._streams.forget(self)

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
            self._link._writer.send_ctrl(FrameType.CREDIT, self.sid, {"c": credit})

    # called by the link's reader
    def _allocate(self, header: dict[str, Any], flags: int, length: int) -> memoryview:
        if not flags & F_CONT:
            if self._current is not None:
                raise ProtocolViolation("a stream message began before the previous one ended")
            total = message_total(header, length, flags, self._link.limits.max_message_bytes)
            into = self._into
            if into is not None and total <= len(into):
                self._current = Assembly(header.get("h", {}), total, into[:total], owned=False)
                self._into = None
            else:
                self._link._reserve(total)
                self._current = Assembly(header.get("h", {}), total, inbound_buffer(total),
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
        total = message_total(frame.header, 0, frame.flags, self._link.limits.max_message_bytes)
        self._link._reserve(total)  # (a first frame carrying no byte announces as much as any)
        self._current = Assembly(frame.header.get("h", {}), total, inbound_buffer(total), owned=True)
        self._current_consumed = 0

    def _on_remote_close(self) -> None:
        if self._current is not None:
            raise ProtocolViolation("stream closed in the middle of a message")
        self._remote_closed = True
        self._changed.set()
        self._link._streams.maybe_forget(self)

    def _discard_inbound(self) -> None:
        """Nobody will receive any more (the handler returned): consume and drop what comes."""
        self._discarding = True
        while self._inbox:
            _, unconsumed = self._inbox.popleft()
            self._consume(unconsumed)
        self._link._streams.maybe_forget(self)

    @property
    def finished(self) -> bool:
        return self._error is not None or (self._local_closed and self._remote_closed)


def _same_buffer(a: memoryview, b: memoryview) -> bool:
    return a.obj is b.obj


class StreamTable:
    """A link's streams by stream id."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self.streams: dict[int, LinkStream] = {}

    def get(self, sid: int) -> LinkStream | None:
        return self.streams.get(sid)

    def active(self) -> int:
        return len(self.streams)

    def under_way(self) -> Iterator[Assembly]:
        """The messages being received into buffers of the link's own (not the application's)."""
        return (s._current for s in self.streams.values()
                if s._current is not None and s._current.owned and s._current.buffer is not None)

    async def open(self, method: str, header: dict[str, Any], deadline: float) -> LinkStream:
        link = self._link
        sid = link._new_sid()
        stream = LinkStream(link, sid, method, 0)
        stream.header = header
        self.streams[sid] = stream
        link._writer.send_ctrl(FrameType.OPEN, sid, {"m": method, "h": header,
                                                     "w": link.limits.stream_window})
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(stream.accepted)
        except TimeoutError:
            stream._abort_now("open timed out")
            raise CallTimeout(f"opening stream {method!r} to {link.peer_id} timed out") from None
        except asyncio.CancelledError:
            stream._abort_now("opener cancelled")
            raise
        return stream

    def on_open(self, frame: Frame) -> None:
        """The peer opens a stream: refuse it, or accept it and start its handler."""
        link = self._link
        sid = frame.stream_id
        link._check_new_sid(sid)
        method, window = frame.header.get("m"), frame.header.get("w")
        header = frame.header.get("h", {})
        if not isinstance(method, str) or not isinstance(header, dict) or not isinstance(window, int) \
                or window <= 0:
            raise ProtocolViolation("OPEN without a method, a header object and a window")
        if link.active() >= link.limits.max_streams:
            link._counters["streams_refused"] = link._counters.get("streams_refused", 0) + 1
            link._writer.send_ctrl(FrameType.ERROR, sid, {
                "k": "LimitExceeded", "e": f"too many open calls/streams (max {link.limits.max_streams})"})
            return
        handler = link._dispatcher.streams.get(method)
        if handler is None:
            link._counters["unknown_methods"] = link._counters.get("unknown_methods", 0) + 1
            link._writer.send_ctrl(FrameType.ERROR, sid, {"k": "UnknownMethod",
                                                          "e": f"no stream handler for {method!r}"})
            return
        stream = LinkStream(link, sid, method, window)
        stream.accepted.set_result(None)
        self.streams[sid] = stream
        link._writer.send_ctrl(FrameType.ACCEPT, sid, {"w": link.limits.stream_window})
        stream.header = header
        link._spawn(self._serve(handler, stream), f"stream-{method}")

    async def _serve(self, handler: StreamHandler, stream: LinkStream) -> None:
        link = self._link
        try:
            await handler(link._context, stream)
        except asyncio.CancelledError:
            stream._abort_now("handler cancelled")
            raise
        except Exception as exc:  # the handler's failure aborts the stream with its message
            link._log.info("stream_handler_failed", method=stream.method, error=repr(exc))
            stream._abort_now(f"{type(exc).__name__}: {exc}")
        else:
            if stream._error is None and not link.closed:  # (a closed link fails its streams soon)
                await stream.close()
                stream._discard_inbound()

    def on_accept(self, frame: Frame) -> None:
        stream = self.streams.get(frame.stream_id)
        window = frame.header.get("w")
        if not isinstance(window, int) or window <= 0:
            raise ProtocolViolation("ACCEPT without a window")
        if stream is None or stream.accepted.done():
            return
        self.add_credit(stream.sid, window)
        stream.accepted.set_result(None)

    def add_credit(self, sid: int, amount: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        self._link._writer.add_credit(stream._outbox, amount)

    def fail_all(self, error: TransportError) -> None:
        """The link closed: every stream fails with `error`."""
        for stream in list(self.streams.values()):
            stream._fail(error)

    def forget(self, stream: LinkStream) -> None:
        self.streams.pop(stream.sid, None)
        self._link._writer.forget(stream.sid)
        self._link._maybe_finish_drain()

    def maybe_forget(self, stream: LinkStream) -> None:
        if stream.finished:
            self.forget(stream)
