"""A link's sending side: what it has to send, in what order, and the writes to its socket.

- Fair sending: one writer task serves control frames first, then round-robins over the stream
  ids that have something to send, one chunk (`chunk_bytes`, 1 MiB) at a time; small frames are
  batched into one write. A small call is never stuck behind a big stream.
- A stream's data goes out only as far as its credit (the window the peer granted, grown by its
  CREDIT frames); calls and replies are not flow-controlled.
- Control frames (PONGs, CREDITs, ERRORs, ...) queue up to `max_control_bytes`: a peer that sends
  and never reads grows the queue, and past the bound its link is closed.
- A write slower than MIN_WRITE_RATE past `write_stall_timeout` ends the link (a peer may send and
  never read: the write would wait for ever).
- Bandwidth caps (ratelimit.py, optional): data frames go out in quanta booked on the daemon's
  upload bucket, control frames are booked but never wait (they go out while data waits).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from .errors import TransportClosed
from .frames import F_CONT, F_MORE, FrameType, encode_head, encode_header
from .ratelimit import Bandwidth

if TYPE_CHECKING:
    from .link import Link

_BATCH_BYTES = 1024 * 1024
MIN_WRITE_RATE = 1024  # bytes/s: a write slower than this (past the stall timeout) ends its link


class Job:
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


class Outbox:
    """What one stream id has to send, in order, and how much it may send (its credit)."""

    __slots__ = ("credit", "jobs", "queued", "sid")

    def __init__(self, sid: int, credit: float) -> None:
        self.sid = sid
        self.jobs: deque[Job] = deque()
        self.credit = credit
        self.queued = False

    def sendable(self) -> bool:
        if not self.jobs:
            return False
        job = self.jobs[0]
        return job.cancelled or not job.started or job.offset >= len(job.payload) or self.credit > 0


class LinkWriter:
    """The link's outbound queues (control frames, and the outboxes of the stream ids with
    something to send) and the task that writes them (`run`)."""

    def __init__(self, link: Link, bandwidth: Bandwidth | None) -> None:
        self._link = link
        self._bandwidth = bandwidth  # this daemon's caps (ratelimit.py); None: not metered here
        self.outboxes: dict[int, Outbox] = {}
        self._ctrl: deque[bytes] = deque()
        self._ctrl_bytes = 0
        self._ready: deque[Outbox] = deque()
        self._wake = asyncio.Event()

    def submit(self, outbox: Outbox, job: Job) -> None:
        link = self._link
        if link.closed:
            raise TransportClosed(f"link to {link.peer_id} is closed")
        outbox.jobs.append(job)
        self.outboxes[outbox.sid] = outbox
        if not outbox.queued and outbox.sendable():
            outbox.queued = True
            self._ready.append(outbox)
        self._wake.set()

    def send_ctrl(self, ftype: FrameType, sid: int, header: dict[str, Any] | None,
                  payload: bytes = b"") -> None:
        link = self._link
        if link.closed:
            return
        frame = encode_head(ftype, sid, header, len(payload)) + payload
        if self._ctrl_bytes + len(frame) > link.limits.max_control_bytes:
            link._counters["control_queue_overflows"] = link._counters.get("control_queue_overflows", 0) + 1
            link._log.warning("link_control_queue_full", queued=self._ctrl_bytes,
                              hint="the peer sends but does not read")
            link.begin_close("the peer does not read what it asks for (control queue full)")
            return
        self._ctrl.append(frame)
        self._ctrl_bytes += len(frame)
        self._wake.set()

    def add_credit(self, outbox: Outbox, amount: int) -> None:
        outbox.credit += amount
        if not outbox.queued and outbox.sendable():
            outbox.queued = True
            self._ready.append(outbox)
            self._wake.set()

    def cancel(self, sid: int) -> None:
        """Send no more of what stream id `sid` has queued."""
        outbox = self.outboxes.get(sid)
        if outbox is not None:
            for job in outbox.jobs:
                job.cancelled = True

    def forget(self, sid: int) -> None:
        self.outboxes.pop(sid, None)

    async def run(self) -> None:
        """The writer task: it ends with the link (it closes the link when it fails)."""
        link = self._link
        try:
            await self._write_loop()
        except TransportClosed as exc:
            link.begin_close(str(exc))
        except Exception as exc:  # a bug of ours: close this link now rather than leave it mute
            link.fail_internally("link_writer_failed", exc)

    async def _write_loop(self) -> None:
        link = self._link
        bandwidth = self._bandwidth
        while True:
            chunk_limit = link.limits.chunk_bytes
            throttled = bandwidth is not None and bandwidth.up.rate > 0
            buffers: list[bytes | memoryview] = []
            size = 0
            finished: list[Job] = []
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
                    self.outboxes.pop(outbox.sid, None)
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
            link.bytes_out += size
            for job in finished:
                if job.future is not None and not job.future.done():
                    job.future.set_result(None)

    async def _send_all(self, buffers: list[bytes | memoryview]) -> None:
        """Write to the socket; a write slower than MIN_WRITE_RATE past write_stall_timeout ends
        the link (a peer may send and never read: the write would wait for ever)."""
        link = self._link
        allowed = link.limits.write_stall_timeout + sum(map(len, buffers)) / MIN_WRITE_RATE
        try:
            async with asyncio.timeout(allowed):  # slow links are fine; a peer that reads nothing is not
                await link.io.send_all(buffers)
        except TimeoutError:
            link._counters["write_stalls"] = link._counters.get("write_stalls", 0) + 1
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
            self._link.bytes_out += size
