"""The unix-socket server with real sockets: framing, limits, hostile clients, shutdown."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import orjson
import pytest

from dedloc.rpc import (
    ErrorCode,
    JsonRpcClient,
    JsonRpcServer,
    MethodRegistry,
    RpcCallError,
    RpcConnectionError,
    SocketInUseError,
    rpc_method,
)


class Api:
    def __init__(self) -> None:
        self.release = asyncio.Event()

    @rpc_method("wait")
    async def wait(self) -> str:
        """Answer once released."""
        await self.release.wait()
        return "released"

    @rpc_method("ping")
    async def ping(self, n: int = 0) -> int:
        """Answer n."""
        return n


@pytest.fixture
async def served(short_tmp: Path):  # type: ignore[no-untyped-def]
    api = Api()
    registry = MethodRegistry("t", "1")
    registry.register_object(api)
    server = JsonRpcServer(registry, short_tmp / "s.sock", max_request_bytes=4096, max_connections=4)
    await server.start()
    yield server, api
    await server.close()


async def raw_exchange(path: Path, data: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(data)
    await writer.drain()
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    return answer


async def test_socket_mode_and_removal(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o660
    await server.close()
    assert not server.path.exists()


async def test_oversized_line_is_refused_and_connection_closed(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    answer = await raw_exchange(server.path, b'{"jsonrpc": "2.0", "x": "' + b"a" * 100_000)
    error = orjson.loads(answer.splitlines()[0])["error"]
    assert error["code"] == ErrorCode.INVALID_REQUEST
    assert "larger than 4096" in error["data"]
    assert server.counters["error.request_too_large"] == 1
    async with await JsonRpcClient.connect(server.path) as client:
        assert await client.call("ping", {"n": 3}) == 3


async def test_client_that_disconnects_mid_request(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    _, writer = await asyncio.open_unix_connection(str(server.path))
    writer.write(b'{"jsonrpc": "2.0", "method": "pi')
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    async with await JsonRpcClient.connect(server.path) as client:
        assert await client.call("ping", {"n": 1}) == 1
    assert server.counters["error.incomplete_request"] == 1


async def test_calls_on_one_connection_run_concurrently(served) -> None:  # type: ignore[no-untyped-def]
    server, api = served
    async with await JsonRpcClient.connect(server.path) as client:
        waiting = asyncio.create_task(client.call("wait"))
        assert await client.call("ping", {"n": 5}) == 5  # answered while "wait" is pending
        api.release.set()
        assert await waiting == "released"


async def test_connection_limit(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    clients = [await JsonRpcClient.connect(server.path) for _ in range(4)]
    for client in clients:
        assert await client.call("ping") == 0
    extra = await JsonRpcClient.connect(server.path)
    with pytest.raises((RpcCallError, RpcConnectionError)):
        await extra.call("ping", timeout=10)
    for client in [*clients, extra]:
        await client.close()


async def test_stale_socket_is_replaced_and_live_one_refused(short_tmp: Path) -> None:
    path = short_tmp / "stale.sock"
    import socket

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # a file with nobody listening
    registry = MethodRegistry("t", "1")
    first = JsonRpcServer(registry, path)
    await first.start()
    second = JsonRpcServer(MethodRegistry("t", "1"), path)
    with pytest.raises(SocketInUseError):
        await second.start()
    await first.close()


async def test_close_fails_pending_calls(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    client = await JsonRpcClient.connect(server.path)
    pending = asyncio.create_task(client.call("wait"))
    await asyncio.sleep(0.1)
    await server.close()
    with pytest.raises(RpcConnectionError):
        await pending
    await client.close()


async def test_unreachable_socket_says_so(short_tmp: Path) -> None:
    with pytest.raises(RpcConnectionError, match="nothing is listening"):
        await JsonRpcClient.connect(short_tmp / "none.sock")
