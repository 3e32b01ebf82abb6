"""Byte pipes that are not a socket of our own, for links over other paths.

A `Link` runs over anything with `kind`, `recv_into(buffer) -> int` (0 at the end),
`send_all(buffers)` and `close()` (sockio.py's `PlainIO`/`TlsIO` are the socket ones):

- `StreamPipe`: the bytes of a stream of another link, e.g. a stream through a relay. Flow
  control is the carrying stream's, so a slow reader slows the writer end to end.
- `BioTlsIO`: TLS 1.3 over any pipe (`ssl.SSLObject` on memory BIOs), so that a relayed link is
  encrypted end to end and the relay sees only ciphertext. The hellos of tls.py then bind both
  peer ids to this TLS session exactly as on a direct TCP link.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from typing import Protocol

from .errors import CallTimeout, TransportClosed, TransportError
from .interface import Message, Stream

Buffer = bytes | bytearray | memoryview
PIPE_MESSAGE_BYTES = 256 * 1024  # bytes per carrying message: big enough to amortise, small to interleave
SEND_TIMEOUT = 120.0  # a carrying stream that takes no bytes for this long is dead
_READ_POLL = 3600.0
_TLS_READ = 64 * 1024


class Pipe(Protocol):
    kind: str

    async def recv_into(self, buffer: memoryview) -> int: ...

    async def send_all(self, buffers: Sequence[Buffer]) -> None: ...

    def close(self) -> None: ...


class StreamPipe:
    """A byte pipe over a message stream (the stream's messages carry the bytes as payloads)."""

    def __init__(self, stream: Stream, kind: str = "relay") -> None:
        self._stream = stream
        self.kind = kind
        self._pending = memoryview(b"")
        self._eof = False
        self.closed = False
        self._closer: asyncio.Task[None] | None = None

    async def recv_into(self, buffer: memoryview) -> int:
        while not self._pending:
            if self._eof or self.closed:
                return 0
            try:
                message = await self._stream.receive(timeout=_READ_POLL)
            except CallTimeout:
                continue  # the link's own keepalive decides when the far end is dead
            except TransportError as exc:
                raise TransportClosed(f"the carrying stream failed: {exc}") from exc
            if message is None:
                self._eof = True
                return 0
            self._pending = memoryview(message.payload).cast("B")
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        if self.closed:
            raise TransportClosed("pipe closed")
        small = bytearray()
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if len(view) < PIPE_MESSAGE_BYTES // 4:
                small += view
                if len(small) >= PIPE_MESSAGE_BYTES:
                    await self._send(memoryview(small))
                    small = bytearray()
                continue
            if small:
                await self._send(memoryview(small))
                small = bytearray()
            await self._send(view)
        if small:
            await self._send(memoryview(small))

    async def _send(self, view: memoryview) -> None:
        for offset in range(0, len(view), PIPE_MESSAGE_BYTES):
            try:
                await self._stream.send(Message({}, view[offset:offset + PIPE_MESSAGE_BYTES]),
                                        timeout=SEND_TIMEOUT)
            except TransportError as exc:
                raise TransportClosed(f"the carrying stream failed: {exc}") from exc

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # no running loop: nothing left to tell
            self._closer = asyncio.get_running_loop().create_task(self._stream.abort("pipe closed"))


class BioTlsIO:
    """TLS over a pipe. One reader and one writer may run at once (like a link's two tasks): the
    TLS records each produces leave through one lock, in order."""

    def __init__(self, inner: Pipe, context: ssl.SSLContext, *, server_side: bool) -> None:
        self._inner = inner
        self.kind = inner.kind
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._flush_lock = asyncio.Lock()
        self._read_buffer = bytearray(_TLS_READ)
        self.closed = False

    async def _flush(self) -> None:
        async with self._flush_lock:
            data = self._outgoing.read()
            if data:
                await self._inner.send_all([data])

    async def _fill(self) -> bool:
        """Feed the TLS object what the pipe has; False at the pipe's end."""
        view = memoryview(self._read_buffer)
        count = await self._inner.recv_into(view)
        if count == 0:
            self._incoming.write_eof()
            return False
        self._incoming.write(view[:count])
        return True

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                await self._flush()
                return
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise TransportClosed("the pipe ended during the TLS handshake") from None
            except ssl.SSLError as exc:
                raise TransportClosed(f"TLS handshake failed: {exc}") from exc

    def peer_certificate(self) -> bytes | None:
        return self._tls.getpeercert(binary_form=True)

    async def recv_into(self, buffer: memoryview) -> int:
        while True:
            try:
                return self._tls.read(len(buffer), buffer)
            except ssl.SSLWantReadError:
                if self._outgoing.pending:  # e.g. a TLS 1.3 key update to answer
                    await self._flush()
                if not await self._fill():
                    with contextlib.suppress(ssl.SSLError):
                        return self._tls.read(len(buffer), buffer)
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0
            except ssl.SSLError as exc:
                raise TransportClosed(f"TLS failed: {exc}") from exc

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        if self.closed:
            raise TransportClosed("pipe closed")
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            for offset in range(0, len(view), PIPE_MESSAGE_BYTES):
                try:
                    self._tls.write(view[offset:offset + PIPE_MESSAGE_BYTES])
                except ssl.SSLError as exc:
                    raise TransportClosed(f"TLS failed: {exc}") from exc
                await self._flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._inner.close()
