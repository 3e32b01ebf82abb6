"""A JSON-RPC 2.0 server on a unix socket: one JSON message per line, batches, concurrent calls.

Used for the daemon's control API and by workers for the worker protocol. Lines longer than
`max_request_bytes` are refused without being read whole: the client gets an Invalid request
answer and the connection is closed. A client that disconnects mid-request is counted and
forgotten; nothing it sent can stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

import structlog

from .errors import ErrorCode
from .registry import MethodRegistry, error_response

log = structlog.get_logger(__name__)

_MAX_UNIX_PATH = 107  # sun_path is 108 bytes with its terminating NUL


class SocketInUseError(OSError):
    """Another live server already answers on the socket path."""


class JsonRpcServer:
    """Serves a `MethodRegistry` on a unix socket until `close()`."""

    def __init__(
        self,
        registry: MethodRegistry,
        path: Path,
        *,
        mode: int = 0o660,
        max_request_bytes: int = 1 << 20,
        max_connections: int = 64,
        max_inflight_per_connection: int = 16,
        idle_timeout: float | None = 3600.0,
        write_timeout: float = 30.0,
        on_hangup: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.path = Path(path)
        self.mode = mode
        self.max_request_bytes = max_request_bytes
        self.max_connections = max_connections
        self.max_inflight = max_inflight_per_connection
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.on_hangup = on_hangup
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._listening_clients = 0

    @property
    def clients(self) -> int:
        """Connections whose client has not hung up (calls of a gone client may still be running)."""
        return self._listening_clients

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.registry.counters)

    async def start(self) -> None:
        if len(os.fsencode(self.path)) > _MAX_UNIX_PATH:
            raise OSError(f"socket path {self.path} is longer than the {_MAX_UNIX_PATH} bytes unix "
                          "sockets allow; choose a shorter directory")
        await _remove_stale_socket(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old_umask = os.umask(0o777 & ~self.mode)
        try:
            self._server = await asyncio.start_unix_server(
                self._accept, path=str(self.path), limit=self.max_request_bytes
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        log.debug("rpc_listening", path=str(self.path))

    async def close(self) -> None:
        """Stop accepting, cancel every connection and remove the socket file."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            self.registry.counters["error.too_many_connections"] += 1
            await self._send(writer, error_response(
                ErrorCode.INVALID_REQUEST, "Invalid request",
                f"too many connections (limit {self.max_connections}); try again later"))
            await _close_writer(writer)
            return
        # The connection runs in a task this server owns, so that close() can cancel it without
        # cancelling asyncio's own callback task (which would log a spurious traceback).
        task = asyncio.create_task(self._serve_connection(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        await asyncio.wait([task])

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        finally:
            await _close_writer(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        inflight = asyncio.Semaphore(self.max_inflight)
        write_lock = asyncio.Lock()
        self.registry.counters["connections"] += 1
        async with asyncio.TaskGroup() as calls:
            self._listening_clients += 1
            try:
                await self._read_requests(reader, writer, calls, write_lock, inflight)
            finally:
                # Said before the calls in flight finish: the owner may want to cancel them.
                self._listening_clients -= 1
                if self.on_hangup is not None:
                    self.on_hangup()

    async def _read_requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             calls: asyncio.TaskGroup, write_lock: asyncio.Lock,
                             inflight: asyncio.Semaphore) -> None:
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout):
                    line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip():
                    self.registry.counters["error.incomplete_request"] += 1
                return
            except asyncio.LimitOverrunError:
                self.registry.counters["error.request_too_large"] += 1
                async with write_lock:
                    await self._send(writer, error_response(
                        ErrorCode.INVALID_REQUEST, "Invalid request",
                        f"request larger than {self.max_request_bytes} bytes; connection closed"))
                return
            except TimeoutError:
                self.registry.counters["idle_timeouts"] += 1
                return
            except ConnectionError:
                return
            if not line.strip():
                continue
            await inflight.acquire()
            calls.create_task(self._answer(line, writer, write_lock, inflight))

    async def _answer(self, line: bytes, writer: asyncio.StreamWriter, write_lock: asyncio.Lock,
                      inflight: asyncio.Semaphore) -> None:
        try:
            answer = await self.registry.dispatch(line)
            if answer is not None:
                async with write_lock:
                    await self._send(writer, answer)
        finally:
            inflight.release()

    async def _send(self, writer: asyncio.StreamWriter, message: bytes) -> None:
        if writer.is_closing():
            return
        try:
            writer.write(message + b"\n")
            async with asyncio.timeout(self.write_timeout):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            self.registry.counters["error.write_failed"] += 1
            writer.close()


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(1.0):
            await writer.wait_closed()


async def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a dead server; refuse if a live one answers there."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise SocketInUseError(f"{path} exists and is not a socket; remove it or choose another path")
    try:
        async with asyncio.timeout(2.0):
            _, writer = await asyncio.open_unix_connection(str(path))
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
        path.unlink(missing_ok=True)
        return
    await _close_writer(writer)
    raise SocketInUseError(f"another server is already listening on {path}; stop it first "
                           "(dedloc shutdown) or choose another socket path")
