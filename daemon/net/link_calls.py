"""The unary calls on a link: those it makes (each waits for its reply) and those its peer makes
(each served by the handler its method names in the link's `Dispatcher`).

A call is a REQUEST message {"m": method, "h": header, "n": total, "d": deadline ms} on a new
stream id of the caller's, answered by a RESPONSE message or an ERROR frame on the same id. Calls
are not flow-controlled: they are bounded by `max_message_bytes` and the link's pending limit, and
a peer past `max_streams` open calls and streams is refused with an ERROR frame. A caller that
gives up sends CANCEL: the handler task is cancelled, and what it had queued is not sent.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .. import timebase
from .errors import CallTimeout, LimitExceeded, ProtocolViolation, TransportError
from .frames import F_CONT, F_MORE, Frame, FrameType
from .inbound import Assembly, inbound_buffer, message_total
from .interface import Message
from .link_writer import Job, Outbox

if TYPE_CHECKING:
    from .link import Link


class _Served:
    """A unary call the peer made to us."""

    __slots__ = ("deadline", "method", "task")

    def __init__(self, method: str, deadline: float | None) -> None:
        self.method = method
        self.deadline = deadline
        self.task: asyncio.Task[None] | None = None


class UnaryCalls:
    """The link's unary calls, by stream id: ours waiting for their reply (`calls`), the peer's
    being served (`served`), and the requests and replies being received (`assembling`)."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self.calls: dict[int, asyncio.Future[Message]] = {}
        self.served: dict[int, _Served] = {}
        self.assembling: dict[int, Assembly] = {}

    def active(self) -> int:
        return len(self.calls) + len(self.served)

    def under_way(self) -> Iterator[Assembly]:
        """The requests and replies being received into buffers (not those being discarded)."""
        return (a for a in self.assembling.values() if a.buffer is not None)

    # --- the calls we make ----------------------------------------------------------------------
    async def call(self, method: str, message: Message, deadline: float) -> Message:
        """One unary call; `deadline` is loop.time() by which the reply must have come."""
        link = self._link
        payload = memoryview(message.payload).cast("B")
        if len(payload) > link.limits.max_message_bytes:
            raise LimitExceeded(f"request of {len(payload)} bytes is over max_message_bytes")
        sid = link._new_sid()
        remaining_ms = max(1, int((deadline - link.loop.time()) * 1000))
        # (the header is encoded first: one that cannot be leaves no call registered, which
        # would keep a draining link open until its grace ran out)
        job = Job(FrameType.REQUEST, {"m": method, "h": message.header, "n": len(payload),
                                      "d": remaining_ms}, payload, None)
        future: asyncio.Future[Message] = link.loop.create_future()
        self.calls[sid] = future
        outbox = Outbox(sid, math.inf)
        try:
            link._writer.submit(outbox, job)
            async with asyncio.timeout_at(deadline):
                return await future
        except TimeoutError:
            self._cancel_call(sid, job)
            raise CallTimeout(f"call {method!r} to {link.peer_id} timed out") from None
        except asyncio.CancelledError:
            self._cancel_call(sid, job)
            raise
        finally:
            self.calls.pop(sid, None)
            link._maybe_finish_drain()

    def _cancel_call(self, sid: int, job: Job) -> None:
        if self._link.closed:
            return
        job.cancelled = True
        if job.started:
            self._link._writer.send_ctrl(FrameType.CANCEL, sid, None)
        self.assembling.pop(sid, None)

    def fail_call(self, sid: int, error: TransportError) -> bool:
        """The peer answered call `sid` with an ERROR frame; False if `sid` is no call of ours."""
        future = self.calls.get(sid)
        if future is None:
            return False
        self.assembling.pop(sid, None)
        if not future.done():
            future.set_exception(error)
        return True

    def fail_all(self, error: TransportError) -> None:
        """The link closed: every call still waiting fails with `error`."""
        for future in self.calls.values():
            if not future.done():
                future.set_exception(error)
        self.calls.clear()

    # --- receiving requests and replies ---------------------------------------------------------
    def allocate(self, ftype: FrameType, flags: int, sid: int, header: dict[str, Any],
                 length: int) -> memoryview | None:
        """Where a REQUEST or RESPONSE frame's payload goes; None: discard it."""
        if not flags & F_CONT:
            self._begin_message(ftype, flags, sid, header, length)
        assembly = self.assembling.get(sid)
        if assembly is not None and assembly.buffer is not None:
            if assembly.filled + length > assembly.total:
                raise ProtocolViolation("a message is longer than announced")
            return assembly.buffer[assembly.filled:assembly.filled + length]
        return None

    def _begin_message(self, ftype: FrameType, flags: int, sid: int, header: dict[str, Any],
                       length: int) -> None:
        """The first frame of a request or a reply: validate it and set up its assembly."""
        link = self._link
        total = message_total(header, length, flags, link.limits.max_message_bytes)
        if ftype == FrameType.RESPONSE:
            if sid in self.calls:
                link._reserve(total)
            buffer = inbound_buffer(total) if sid in self.calls else None
            self.assembling[sid] = Assembly(header, total, buffer, owned=True)
            return
        link._check_new_sid(sid)
        method = header.get("m")
        deadline_ms = header.get("d")
        if not isinstance(method, str):
            raise ProtocolViolation("request without a method name")
        if deadline_ms is not None and (not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool)
                                        or deadline_ms <= 0):
            raise ProtocolViolation("request with a bad deadline")
        if link.active() >= link.limits.max_streams:
            link._counters["streams_refused"] = link._counters.get("streams_refused", 0) + 1
            link._writer.send_ctrl(FrameType.ERROR, sid, {
                "k": "LimitExceeded", "e": f"too many open calls/streams (max {link.limits.max_streams})"})
            self.assembling[sid] = Assembly(header, total, None, owned=True)
            return
        link._reserve(total)
        deadline = None if deadline_ms is None else link.loop.time() + deadline_ms / 1000
        self.served[sid] = _Served(method, deadline)
        self.assembling[sid] = Assembly(header, total, inbound_buffer(total), owned=True)

    def on_frame(self, frame: Frame) -> None:
        """A REQUEST or RESPONSE frame has been received."""
        link = self._link
        sid = frame.stream_id
        if not frame.flags & F_CONT and not len(frame.payload):
            self._begin_message(frame.type, frame.flags, sid, frame.header, 0)
        assembly = self.assembling.get(sid)
        if assembly is None:
            return  # continuation of a call we no longer track
        count = len(frame.payload)
        assembly.filled += count
        assembly.touched = timebase.monotonic()
        if assembly.buffer is not None:
            link._add_pending(count)
        if frame.flags & F_MORE:
            return
        del self.assembling[sid]
        if assembly.buffer is None:
            return
        if assembly.filled != assembly.total:
            raise ProtocolViolation("a message is shorter than announced")
        link._pending_in -= assembly.filled
        header = assembly.header.get("h", {})
        message = Message(header, assembly.buffer)
        if frame.type == FrameType.RESPONSE:
            future = self.calls.get(sid)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            served = self.served.get(sid)
            if served is not None:
                self._start_handler(sid, served, message)

    # --- the calls we serve ---------------------------------------------------------------------
    def _start_handler(self, sid: int, served: _Served, message: Message) -> None:
        served.task = self._link._spawn(self._serve(sid, served, message), f"serve-{served.method}")

    async def _serve(self, sid: int, served: _Served, message: Message) -> None:
        link = self._link
        handler = link._dispatcher.unary.get(served.method)
        try:
            if handler is None:
                link._counters["unknown_methods"] = link._counters.get("unknown_methods", 0) + 1
                link._writer.send_ctrl(FrameType.ERROR, sid, {
                    "k": "UnknownMethod", "e": f"no handler for {served.method!r}"})
                return
            try:
                async with asyncio.timeout_at(served.deadline):
                    reply = await handler(link._context, message)
                if not isinstance(reply, Message):
                    raise TypeError(f"handler for {served.method!r} returned {type(reply).__name__}, "
                                    "not a Message")
            except TimeoutError:
                return  # the caller has given up by now
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the handler's failure becomes the caller's RemoteError
                link._log.info("handler_failed", method=served.method, error=repr(exc))
                link._writer.send_ctrl(FrameType.ERROR, sid, {"k": type(exc).__name__,
                                                              "e": str(exc)[:2000]})
                return
            payload = memoryview(reply.payload).cast("B")
            if len(payload) > link.limits.max_message_bytes:
                link._writer.send_ctrl(FrameType.ERROR, sid, {"k": "LimitExceeded",
                                                              "e": "reply over max_message_bytes"})
                return
            try:
                job = Job(FrameType.RESPONSE, {"h": reply.header, "n": len(payload)}, payload,
                          link.loop.create_future())
            except (TypeError, ValueError) as exc:  # e.g. a header echoed from a hostile request
                link._log.info("handler_reply_unsendable", method=served.method, error=repr(exc))
                link._writer.send_ctrl(FrameType.ERROR, sid, {
                    "k": type(exc).__name__, "e": f"reply header cannot be sent: {exc}"[:2000]})
                return
            if link.closed:  # closed while the handler ran: nobody to answer
                return
            link._writer.submit(Outbox(sid, math.inf), job)
            try:
                async with asyncio.timeout(link.limits.send_timeout):
                    await asyncio.shield(job.future)  # type: ignore[arg-type]
            except TimeoutError:
                job.cancelled = True
            except asyncio.CancelledError:
                job.cancelled = True
                raise
        finally:
            self.served.pop(sid, None)
            link._maybe_finish_drain()

    def on_cancel(self, sid: int) -> None:
        """The peer gave up on call `sid`: stop its handler, send nothing more of its reply."""
        served = self.served.pop(sid, None)
        self.assembling.pop(sid, None)
        if served is not None and served.task is not None:
            served.task.cancel()
        self._link._writer.cancel(sid)
        self._link._maybe_finish_drain()
