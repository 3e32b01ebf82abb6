"""Non-blocking socket I/O for links, driven straight from the event loop.

`PlainIO` (TCP) and `TlsIO` (an `ssl.SSLSocket` in non-blocking mode) offer the same three calls:
`recv_into(buffer)` (0 at EOF), `send_all(buffers)` and `close()`. Both try the syscall first and
wait for readiness with `loop.add_reader`/`add_writer` only when it would block: this avoids the
copies and the per-chunk overhead of asyncio streams and of asyncio's SSL transport.

One task reads and one task writes. An SSL read that needs to write (or a write that needs to read)
is rare in TLS 1.3 (no renegotiation); it retries after a short sleep instead of registering a
second callback on the same file descriptor.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence

from .errors import TransportClosed

Buffer = bytes | bytearray | memoryview
_COALESCE_BELOW = 64 * 1024
_MAX_IOV = 64
_CROSS_WAIT_S = 0.001


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _FdIO:
    kind = "tcp"

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self.closed = False

    async def _readable(self) -> None:
        if self.closed:
            raise TransportClosed("socket closed")
        future = self._loop.create_future()
        self._loop.add_reader(self._fd, _wake, future)
        try:
            await future
        finally:
            self._loop.remove_reader(self._fd)

    async def _writable(self) -> None:
        if self.closed:
            raise TransportClosed("socket closed")
        future = self._loop.create_future()
        self._loop.add_writer(self._fd, _wake, future)
        try:
            await future
        finally:
            self._loop.remove_writer(self._fd)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()

    def peername(self) -> tuple[str, int] | None:
        try:
            name = self._sock.getpeername()
        except OSError:
            return None
        return (str(name[0]), int(name[1]))


class PlainIO(_FdIO):
    """Plain TCP: `recv_into` and `sendmsg` (scatter/gather, no concatenation)."""

    kind = "tcp-plain"

    async def recv_into(self, buffer: memoryview) -> int:
        while True:
            try:
                return self._sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                await self._readable()
            except OSError as exc:
                raise TransportClosed(f"connection lost: {exc}") from exc

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        while views:
            try:
                sent = self._sock.sendmsg(views[:_MAX_IOV])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            except OSError as exc:
                raise TransportClosed(f"connection lost: {exc}") from exc
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0


class TlsIO(_FdIO):
    """TLS over a non-blocking SSLSocket: `recv_into` in place, big buffers sent without copies."""

    kind = "tcp"

    def __init__(self, sock: ssl.SSLSocket) -> None:
        super().__init__(sock)
        self._ssl = sock

    async def handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._readable()
            except ssl.SSLWantWriteError:
                await self._writable()

    def peer_certificate(self) -> bytes | None:
        return self._ssl.getpeercert(binary_form=True)

    async def recv_into(self, buffer: memoryview) -> int:
        while True:
            try:
                return self._ssl.recv_into(buffer, len(buffer))
            except ssl.SSLWantReadError:
                await self._readable()
            except ssl.SSLWantWriteError:
                await asyncio.sleep(_CROSS_WAIT_S)
            except (ssl.SSLError, OSError) as exc:
                raise TransportClosed(f"connection lost: {exc}") from exc

    async def _send_one(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                sent = self._ssl.send(view)
            except ssl.SSLWantWriteError:
                await self._writable()
                continue
            except ssl.SSLWantReadError:
                await asyncio.sleep(_CROSS_WAIT_S)
                continue
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            except (ssl.SSLError, OSError) as exc:
                raise TransportClosed(f"connection lost: {exc}") from exc
            view = view[sent:]

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        # Small pieces (prefixes, headers, small payloads) go out together in one record; big
        # payloads are handed to SSL as they are (it encrypts them record by record).
        pending = bytearray()
        for buffer in buffers:
            if len(buffer) < _COALESCE_BELOW:
                pending += buffer
                continue
            if pending:
                await self._send_one(pending)
                pending = bytearray()
            await self._send_one(buffer)
        if pending:
            await self._send_one(pending)


SocketIO = PlainIO | TlsIO
