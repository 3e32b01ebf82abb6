"""An asyncio JSON-RPC 2.0 client for unix sockets (one JSON message per line).

Many calls may be in flight on one connection; answers are matched by id. Every call has a
deadline. A broken connection fails every pending call with `RpcConnectionError`, or with the
error the server sent before closing it (a refused connection gets ACCESS_DENIED). A daemon's
loopback TCP listener is reached with `connect_tcp`, which authenticates with its token first.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path
from typing import Any

import orjson

from .access import TOKEN_METHOD, loopback_address
from .errors import RpcCallError, RpcConnectionError, RpcProtocolError, RpcTimeoutError


class JsonRpcClient:
    """A connection to a JSON-RPC server. Use `await JsonRpcClient.connect(path)`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 path: Path | str, default_timeout: float) -> None:
        """`path`: the unix socket, or the TCP address as HOST:PORT (used in messages)."""
        self._reader = reader
        self._writer = writer
        self.path = path
        self.default_timeout = default_timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._closed: BaseException | None = None
        self._server_error: RpcCallError | None = None  # sent with no id: why the server hangs up
        self._read_task = asyncio.create_task(self._read_answers(), name=f"rpc-client-{path}")

    @classmethod
    async def connect(cls, path: str | Path, *, timeout: float = 10.0,
                      default_timeout: float = 60.0, max_response_bytes: int = 64 << 20
                      ) -> JsonRpcClient:
        path = Path(path)
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(str(path), limit=max_response_bytes)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise RpcConnectionError(f"nothing is listening on {path} ({exc.strerror})") from exc
        except PermissionError as exc:
            raise RpcConnectionError(f"no permission to connect to {path}: ask for membership of "
                                     "the socket's group or run as its owner") from exc
        except TimeoutError as exc:
            raise RpcConnectionError(f"connecting to {path} timed out after {timeout} s") from exc
        return cls(reader, writer, path, default_timeout)

    @classmethod
    async def connect_tcp(cls, address: str, token: str, *, timeout: float = 10.0,
                          default_timeout: float = 60.0, max_response_bytes: int = 64 << 20
                          ) -> JsonRpcClient:
        """Connect to a loopback HOST:PORT and authenticate with `token` (rpc.authenticate).

        ValueError for an address that is not loopback (a token is never sent off the machine),
        RpcConnectionError if nothing answers, RpcCallError (ACCESS_DENIED) for a wrong token."""
        host, port = loopback_address(address)
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port, limit=max_response_bytes)
        except OSError as exc:
            raise RpcConnectionError(f"nothing is listening on {address} ({exc.strerror or exc})"
                                     ) from exc
        except TimeoutError as exc:
            raise RpcConnectionError(f"connecting to {address} timed out after {timeout} s") from exc
        client = cls(reader, writer, address, default_timeout)
        try:
            await client.call(TOKEN_METHOD, {"token": token}, timeout=timeout)
        except BaseException:
            await client.close()
            raise
        return client

    async def __aenter__(self) -> JsonRpcClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def call(self, method: str, params: dict[str, Any] | list[Any] | None = None, *,
                   timeout: float | None = None) -> Any:
        """Call `method` and return its result; raise `RpcCallError` for an error answer."""
        request_id = next(self._ids)
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            message["params"] = params
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        deadline = self.default_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                await self._send(orjson.dumps(message))
                answer = await future
        except TimeoutError as exc:
            raise RpcTimeoutError(f"{method} got no answer from {self.path} within {deadline} s") from exc
        finally:
            self._pending.pop(request_id, None)
        if "error" in answer:
            error = answer["error"]
            raise RpcCallError(error.get("code", 0), error.get("message", ""), error.get("data"))
        return answer.get("result")

    async def notify(self, method: str, params: dict[str, Any] | list[Any] | None = None) -> None:
        """Send a notification (no answer expected)."""
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        async with asyncio.timeout(self.default_timeout):
            await self._send(orjson.dumps(message))

    async def _send(self, data: bytes) -> None:
        if isinstance(self._closed, RpcCallError):
            raise self._closed
        if self._closed is not None:
            raise RpcConnectionError(f"connection to {self.path} is closed") from self._closed
        try:
            self._writer.write(data + b"\n")
            await self._writer.drain()
        except ConnectionError as exc:
            raise RpcConnectionError(f"connection to {self.path} broke: {exc}") from exc

    async def _read_answers(self) -> None:
        reason: BaseException
        try:
            while True:
                line = await self._reader.readuntil(b"\n")
                self._deliver(orjson.loads(line))
        except asyncio.IncompleteReadError as exc:
            reason = RpcConnectionError(f"{self.path} closed the connection")
            reason.__cause__ = exc
        except (ConnectionError, asyncio.LimitOverrunError, orjson.JSONDecodeError,
                RpcProtocolError) as exc:
            reason = RpcConnectionError(f"connection to {self.path} failed: {exc}")
            reason.__cause__ = exc
        if self._server_error is not None:
            reason = self._server_error  # e.g. ACCESS_DENIED: more useful than "closed"
        self._closed = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(reason)

    def _deliver(self, answer: Any) -> None:
        for item in answer if isinstance(answer, list) else [answer]:
            if not isinstance(item, dict) or ("result" not in item and "error" not in item):
                raise RpcProtocolError(f"not a JSON-RPC answer: {item!r:.200}")
            future = self._pending.get(item.get("id"))  # type: ignore[arg-type]
            if future is not None and not future.done():
                future.set_result(item)
            elif item.get("id") is None and "error" in item:
                # An error the server could not tie to a request (e.g. request too large, access
                # denied): it fails the calls in flight and the ones made before the server hangs up.
                error = item["error"]
                exc = RpcCallError(error.get("code", 0), error.get("message", ""), error.get("data"))
                self._server_error = exc
                for pending in self._pending.values():
                    if not pending.done():
                        pending.set_exception(exc)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def close(self) -> None:
        self._writer.close()
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError, TimeoutError):
            async with asyncio.timeout(1.0):
                await self._writer.wait_closed()
            await self._read_task
