"""A small HTTP/1.1 server for the dashboard: GET and HEAD only, on a loopback address only.

It serves a fixed table of paths (no files are looked up, so no path can reach the disk). Each
connection carries one request and is closed after the answer (`Connection: close`). Every read
and write has a deadline; a request head longer than `max_request_bytes` is refused (431) without
being read whole; bodies are refused (400: nothing served here takes one); other methods get 405.
A `Host` header that names another host than the listener is refused (403): a web page elsewhere
cannot read the dashboard through DNS rebinding. Answers are never cached (`Cache-Control:
no-store`). What the server refused is counted (`counters`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import structlog

from dedloc.rpc.access import loopback_address

log = structlog.get_logger(__name__)

REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable",
           505: "HTTP Version Not Supported"}
METHODS = ("GET", "HEAD")
LINGER_SECONDS = 1.0  # after an answer, how long the client may take to hang up ...
LINGER_BYTES = 1 << 20  # ... and how much of what it still sends is read and dropped meanwhile
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
}


def loopback_listen_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[HOST]:PORT`) whose host is a loopback IP literal; ValueError otherwise."""
    return loopback_address(text, "the dashboard shows this node's runs, peers and paths without "
                                  "asking who looks, so it only listens on loopback")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[], Awaitable[Response]]


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


class HttpServer:
    """Serves `routes` (exact paths; the query string is ignored) until `close()`."""

    def __init__(self, listen: str, routes: Mapping[str, Handler], *, max_request_bytes: int = 8192,
                 read_timeout: float = 10.0, write_timeout: float = 10.0,
                 handler_timeout: float = 15.0, max_connections: int = 32) -> None:
        self.listen = listen
        self.routes = dict(routes)
        self.max_request_bytes = max_request_bytes
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.handler_timeout = handler_timeout
        self.max_connections = max_connections
        self.address: tuple[str, int] | None = None
        self.counters: Counter[str] = Counter()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._hosts: set[str] = set()

    @property
    def url(self) -> str | None:
        """http://HOST:PORT/ once listening; None before."""
        if self.address is None:
            return None
        host, port = self.address
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    async def start(self) -> None:
        """Listen; ValueError for an address that is not loopback, OSError if it cannot be bound."""
        host, port = loopback_listen_address(self.listen)
        self._server = await asyncio.start_server(self._accept, host, port,
                                                  limit=self.max_request_bytes)
        self.address = self._server.sockets[0].getsockname()[:2]
        bound = self.address[1]
        shown = f"[{host}]" if ":" in host else host
        self._hosts = {f"{shown}:{bound}", f"localhost:{bound}"}
        if bound == 80:  # browsers leave the default port out
            self._hosts |= {shown, "localhost"}
        log.info("dashboard_listening", url=self.url)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self.max_connections:
            self.counters["refused_busy"] += 1
            await self._answer(reader, writer, "GET", _error(503, "too many connections; try again"))
            return
        self._connections.add(task)
        try:
            method, response = await self._handle(reader)
            await self._answer(reader, writer, method, response)
        finally:
            self._connections.discard(task)

    async def _handle(self, reader: asyncio.StreamReader) -> tuple[str, Response]:
        self.counters["requests"] += 1
        method = "GET"
        try:
            try:
                async with asyncio.timeout(self.read_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise HttpError(431, f"the request head is over {self.max_request_bytes} bytes") from None
            except asyncio.IncompleteReadError as exc:
                if len(exc.partial) >= self.max_request_bytes:
                    raise HttpError(431, f"the request head is over {self.max_request_bytes} "
                                         "bytes") from None
                raise HttpError(400, "the request ended before its head did") from None
            except TimeoutError:
                raise HttpError(408, f"no complete request within {self.read_timeout} s") from None
            method, path = self._parse(head)
            handler = self.routes.get(path)
            if handler is None:
                raise HttpError(404, f"nothing here at {path[:200]}; try /")
            try:
                async with asyncio.timeout(self.handler_timeout):
                    return method, await handler()
            except TimeoutError:
                raise HttpError(503, "the answer took too long; try again") from None
        except HttpError as exc:
            self.counters[f"error.{exc.status}"] += 1
            return method, _error(exc.status, str(exc), exc.headers)
        except Exception:
            self.counters["error.500"] += 1
            log.exception("dashboard_request_failed")
            return method, _error(500, "internal error (logged by the daemon)")

    def _parse(self, head: bytes) -> tuple[str, str]:
        """(method, path) of a request head, or HttpError."""
        try:
            text = head.decode("ascii")
        except UnicodeDecodeError:
            raise HttpError(400, "the request head is not ASCII") from None
        request_line, *header_lines = text[:-4].split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3:
            raise HttpError(400, "malformed request line")
        method, target, version = parts
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are spoken here")
        headers: dict[str, str] = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise HttpError(400, "malformed header line")
            headers[name.lower()] = value.strip()
        if method not in METHODS:
            raise HttpError(405, f"{method[:20]} is not served; only GET and HEAD",
                            {"Allow": ", ".join(METHODS)})
        if "transfer-encoding" in headers or headers.get("content-length", "0") != "0":
            raise HttpError(400, "a request body is not accepted")
        host = headers.get("host")
        if host is None and version == "HTTP/1.1":
            raise HttpError(400, "HTTP/1.1 needs a Host header")
        if host is not None and host.lower() not in self._hosts:
            raise HttpError(403, "the Host header names another host than this listener")
        if not target.startswith("/"):
            raise HttpError(400, "the request target must be a path")
        return method, target.split("?", 1)[0].split("#", 1)[0]

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
                      response: Response) -> None:
        headers = {"Content-Type": response.content_type,
                   "Content-Length": str(len(response.body)), "Connection": "close",
                   **SECURITY_HEADERS, **response.headers}
        lines = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Unknown')}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if method != "HEAD":
            data += response.body
        try:
            writer.write(data)
            async with asyncio.timeout(self.write_timeout):
                await writer.drain()
            # Half-close, then let the client read the answer before we close: closing with its
            # unread bytes (say, the rest of an oversized request) pending would reset the
            # connection and could destroy the answer in flight. Bounded in bytes and time.
            if writer.can_write_eof():
                writer.write_eof()
            with contextlib.suppress(TimeoutError, asyncio.LimitOverrunError, ValueError):
                async with asyncio.timeout(LINGER_SECONDS):
                    left = LINGER_BYTES
                    while left > 0 and (chunk := await reader.read(min(left, 65536))):
                        left -= len(chunk)
        except (ConnectionError, TimeoutError):
            self.counters["write_failed"] += 1
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(self.write_timeout):
                    await writer.wait_closed()


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(status, f"{status} {REASONS.get(status, '')}: {message}\n".encode(),
                    headers=dict(headers or {}))


__all__ = ["HttpError", "HttpServer", "Response", "loopback_listen_address"]
