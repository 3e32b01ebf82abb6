"""A JSON-RPC 2.0 server on a unix socket: one JSON message per line, batches, concurrent calls.

Used for the daemon's control API and by workers for the worker protocol. Lines longer than
`max_request_bytes` are refused without being read whole: the client gets an Invalid request
answer and the connection is closed. A client that disconnects mid-request is counted and
forgotten; nothing it sent can stop the server.

Access (rpc/access.py): the socket file gets `mode`, and every accepted connection is checked
by its kernel credentials (`LocalUsers`: root, the server's user, members of its group); a refused
one gets one ACCESS_DENIED answer and is closed. An optional loopback TCP listener (`tcp_listen`)
serves the same methods to clients whose first request is `rpc.authenticate` with the token in
`token_file`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import structlog

from .access import (
    TOKEN_METHOD,
    AccessError,
    LocalUsers,
    PeerCredentials,
    load_or_create_token,
    loopback_address,
    tokens_match,
)
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
        access: LocalUsers | None = None,
        tcp_listen: str | None = None,
        token_file: Path | None = None,
        auth_timeout: float = 10.0,
        max_auth_attempts: int = 3,
        max_unauthenticated: int = 8,
    ) -> None:
        """`access`: who may use the unix socket (default: root, this process's user and group).
        `tcp_listen`: a loopback HOST:PORT to serve on as well, to clients that authenticate with
        the token in `token_file` (created if missing) within `auth_timeout` seconds, with at most
        `max_auth_attempts` tokens per connection and `max_unauthenticated` connections waiting."""
        self.registry = registry
        self.path = Path(path)
        self.mode = mode
        self.max_request_bytes = max_request_bytes
        self.max_connections = max_connections
        self.max_inflight = max_inflight_per_connection
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.on_hangup = on_hangup
        self.access = access or LocalUsers()
        if tcp_listen and token_file is None:
            raise ValueError("a TCP listener needs a token file")
        self.tcp_listen = tcp_listen or None
        self.token_file = token_file
        self.auth_timeout = auth_timeout
        self.max_auth_attempts = max_auth_attempts
        self.max_unauthenticated = max_unauthenticated
        self.tcp_address: tuple[str, int] | None = None
        self._token = ""
        self._server: asyncio.AbstractServer | None = None
        self._tcp_server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._listening_clients = 0
        self._unauthenticated = 0

    @property
    def clients(self) -> int:
        """Connections whose client has not hung up (calls of a gone client may still be running)."""
        return self._listening_clients

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.registry.counters)

    @property
    def tcp_address_text(self) -> str | None:
        """The TCP listener's address as HOST:PORT ([HOST]:PORT for IPv6); None when there is none."""
        if self.tcp_address is None:
            return None
        host, port = self.tcp_address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def start(self) -> None:
        """Listen on the unix socket (and the TCP address); AccessError if the token file or the
        TCP address cannot be used, OSError if a socket cannot be made."""
        if len(os.fsencode(self.path)) > _MAX_UNIX_PATH:
            raise OSError(f"socket path {self.path} is longer than the {_MAX_UNIX_PATH} bytes unix "
                          "sockets allow; choose a shorter directory")
        tcp_host, tcp_port = None, 0
        if self.tcp_listen is not None:
            assert self.token_file is not None
            try:
                tcp_host, tcp_port = loopback_address(self.tcp_listen)
            except ValueError as exc:
                raise AccessError(f"TCP listen address: {exc}") from None
            self._token = load_or_create_token(self.token_file)
        await _remove_stale_socket(self.path)
        self._make_directory()
        old_umask = os.umask(0o777 & ~self.mode)
        try:
            self._server = await asyncio.start_unix_server(
                self._accept, path=str(self.path), limit=self.max_request_bytes
            )
        finally:
            os.umask(old_umask)
        try:
            os.chmod(self.path, self.mode)
            log.debug("rpc_listening", path=str(self.path), mode=f"{self.mode:04o}",
                      admits=self.access.describe())
            if tcp_host is not None:
                self._tcp_server = await asyncio.start_server(
                    functools.partial(self._accept, tcp=True), tcp_host, tcp_port,
                    limit=self.max_request_bytes)
                self.tcp_address = self._tcp_server.sockets[0].getsockname()[:2]
                log.info("rpc_tcp_listening", address=self.tcp_address_text,
                         token_file=str(self.token_file))
        except BaseException:
            await self.close()
            raise

    def _make_directory(self) -> None:
        """Create the socket's directory if it is missing, open to the classes the socket mode
        admits (0660 gives 0750); an existing one is left alone, with a hint if it shuts out the
        group that the mode admits."""
        parent = self.path.parent
        try:
            parent.mkdir(parents=True)
        except FileExistsError:
            dir_mode = stat.S_IMODE(parent.stat().st_mode)
            if self.mode & 0o060 and not dir_mode & 0o010:
                log.info("rpc_socket_directory_private", directory=str(parent),
                         mode=f"{dir_mode:04o}", hint="only its owner can reach the socket; for the "
                         "group to use it, choose a socket directory the group may search")
            return
        os.chmod(parent, _directory_mode(self.mode))

    async def close(self) -> None:
        """Stop accepting, cancel every connection and remove the socket file."""
        if self._server is not None:
            self._server.close()
        if self._tcp_server is not None:
            self._tcp_server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._tcp_server is not None:
            await self._tcp_server.wait_closed()
            self._tcp_server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                      tcp: bool = False) -> None:
        if len(self._connections) >= self.max_connections:
            self.registry.counters["error.too_many_connections"] += 1
            await self._send(writer, error_response(
                ErrorCode.INVALID_REQUEST, "Invalid request",
                f"too many connections (limit {self.max_connections}); try again later"))
            await _close_writer(writer)
            return
        # The connection runs in a task this server owns, so that close() can cancel it without
        # cancelling asyncio's own callback task (which would log a spurious traceback).
        task = asyncio.create_task(self._serve_connection(reader, writer, tcp))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        await asyncio.wait([task])

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter, tcp: bool) -> None:
        try:
            admitted = (await self._authenticate(reader, writer) if tcp
                        else await self._check_peer(reader, writer))
            if admitted:
                await self._serve(reader, writer)
        finally:
            await _close_writer(writer)

    async def _check_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Admit a unix client by its kernel credentials; answer and count a refusal."""
        sock = writer.get_extra_info("socket")
        try:
            if sock is None:
                raise OSError("the transport has no socket")
            credentials = PeerCredentials.of(sock)
        except OSError as exc:
            self.registry.counters["error.access_denied"] += 1
            log.warning("rpc_access_denied", reason="no peer credentials", error=str(exc))
            await self._refuse(reader, writer, f"the server cannot learn who connected "
                               f"({exc.strerror or exc}), so it admits nobody")
            return False
        if self.access.admits(credentials, sock):
            return True
        self.registry.counters["error.access_denied"] += 1
        self.registry.counters[f"access_denied.uid.{credentials.uid}"] += 1
        log.warning("rpc_access_denied", uid=credentials.uid, gid=credentials.gid,
                    pid=credentials.pid, socket=str(self.path))
        await self._refuse(reader, writer, self.access.refusal(credentials))
        return False

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """A TCP client's first request must be rpc.authenticate with the token; True once it is."""
        counters = self.registry.counters
        counters["tcp_connections"] += 1
        if self._unauthenticated >= self.max_unauthenticated:
            counters["error.auth_pending_limit"] += 1
            await self._refuse(reader, writer, f"too many connections are waiting to authenticate "
                               f"(limit {self.max_unauthenticated}); try again later")
            return False
        self._unauthenticated += 1
        answer: bytes | None
        try:
            async with asyncio.timeout(self.auth_timeout):
                answer, admitted = await self._read_token(reader, writer)
        except TimeoutError:
            counters["error.auth_timeout"] += 1
            answer, admitted = _access_denied(
                None, f"no {TOKEN_METHOD} request within {self.auth_timeout:g} s; connection "
                      "closed"), False
        finally:
            self._unauthenticated -= 1
        if admitted:
            counters["tcp_authenticated"] += 1
            if answer is not None:
                await self._send(writer, answer)
            return True
        if answer is not None:
            await self._refuse(reader, writer, answer)
        return False

    async def _read_token(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> tuple[bytes | None, bool]:
        """Read requests until the token is right (answer, True), or what to answer before closing
        the connection (None: nothing) and False."""
        counters = self.registry.counters
        peer = _peer_name(writer)
        attempts = 0
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial.strip():
                    counters["error.incomplete_request"] += 1
                return None, False
            except asyncio.LimitOverrunError:
                counters["error.request_too_large"] += 1
                return error_response(ErrorCode.INVALID_REQUEST, "Invalid request",
                                      f"request larger than {self.max_request_bytes} bytes; "
                                      "connection closed"), False
            except ConnectionError:
                return None, False
            if not line.strip():
                continue
            request_id, token = _parse_authenticate(line)
            if token is None:
                counters["error.unauthenticated"] += 1
                log.warning("rpc_unauthenticated_request", peer=peer)
                return _access_denied(request_id, (
                    f"authenticate first: the first request on a TCP connection must be "
                    f'{{"jsonrpc": "2.0", "method": "{TOKEN_METHOD}", "params": {{"token": '
                    f'"..."}}, "id": 1}} with the token in the daemon\'s token file '
                    f"{self.token_file}; connection closed")), False
            if tokens_match(token, self._token):
                log.debug("rpc_authenticated", peer=peer)
                if request_id is _NO_ID:
                    return None, True
                return orjson.dumps({"jsonrpc": "2.0", "result": {"authenticated": True},
                                     "id": request_id}), True
            attempts += 1
            counters["error.bad_token"] += 1
            left = self.max_auth_attempts - attempts
            log.warning("rpc_bad_token", peer=peer, attempts_left=left)
            reason = (f"wrong token (the token is in the daemon's token file {self.token_file}); "
                      + (f"{left} attempt{'s' if left > 1 else ''} left on this connection"
                         if left > 0 else "no attempts left: connection closed"))
            if left <= 0:
                return _access_denied(request_id, reason), False
            await self._send(writer, _access_denied(request_id, reason))

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      answer: bytes | str) -> None:
        """Send the one answer a refused connection gets, then let the client read it before the
        connection is closed (closing with its request unread could reset the connection and
        lose the answer). Bounded: at most 1 s and 64 KiB of what the client still sends."""
        if isinstance(answer, str):
            answer = _access_denied(_NO_ID, answer)
        await self._send(writer, answer)
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        drained = 0
        with contextlib.suppress(OSError):  # TimeoutError included
            async with asyncio.timeout(1.0):
                while drained < 1 << 16 and (chunk := await reader.read(4096)):
                    drained += len(chunk)

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


_NO_ID: Any = object()  # a notification: no id, so no answer on success


def _parse_authenticate(line: bytes) -> tuple[Any, str | None]:
    """(id, token) of an rpc.authenticate request; the token is None if the line is anything else
    and "" if the request carries no string token. The id is None when it cannot be echoed."""
    try:
        request = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(request, dict):
        return None, None
    request_id = request.get("id", _NO_ID)
    if request_id is not _NO_ID and not isinstance(request_id, str | int | float | None):
        request_id = None
    if request.get("method") != TOKEN_METHOD:
        return (None if request_id is _NO_ID else request_id), None
    params = request.get("params")
    if isinstance(params, dict):
        token = params.get("token")
    elif isinstance(params, list) and len(params) == 1:
        token = params[0]
    else:
        token = None
    return request_id, token if isinstance(token, str) else ""


def _access_denied(request_id: Any, reason: str) -> bytes:
    error = {"code": int(ErrorCode.ACCESS_DENIED), "message": "Access denied", "data": reason}
    return orjson.dumps({"jsonrpc": "2.0", "error": error,
                         "id": None if request_id is _NO_ID else request_id})


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


def _directory_mode(socket_mode: int) -> int:
    """The mode of a socket directory the server creates: r-x for each class the socket admits."""
    mode = 0o700
    if socket_mode & 0o070:
        mode |= 0o050
    if socket_mode & 0o007:
        mode |= 0o005
    return mode


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
