"""Who may use a JSON-RPC server: kernel credentials on the unix socket, a token on loopback TCP.

The unix-socket checks use real connections from forked children that take other credentials
(the tests run as root), so the server sees them through SO_PEERCRED and SO_PEERGROUPS.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import orjson
import pytest
from credentials import PING, connect_as_async

from dedloc.rpc import (
    AccessError,
    ErrorCode,
    JsonRpcClient,
    JsonRpcServer,
    LocalUsers,
    MethodRegistry,
    RpcCallError,
    load_or_create_token,
    loopback_address,
    read_token,
    rpc_method,
)
from dedloc.rpc.access import groups_from_proc_status

OWNER_UID, OWNER_GID = 4242, 4243  # the server's user and group in these tests (not root)
STRANGER = 5000

needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="taking other credentials needs root (CI runs as root)")


class Api:
    @rpc_method("ping")
    async def ping(self, n: int = 0) -> int:
        """Answer n."""
        return n


def registry() -> MethodRegistry:
    registry = MethodRegistry("t", "1")
    registry.register_object(Api())
    return registry


@pytest.fixture
async def open_server(short_tmp: Path):  # type: ignore[no-untyped-def]
    """A server owned by uid 4242/gid 4243 whose socket anyone may reach (mode 0666 in a directory
    others can search): only the credential check stands between a stranger and the methods."""
    os.chmod(short_tmp, 0o711)
    server = JsonRpcServer(registry(), short_tmp / "s.sock", mode=0o666,
                           access=LocalUsers(uid=OWNER_UID, gid=OWNER_GID))
    await server.start()
    yield server
    await server.close()


@needs_root
@pytest.mark.parametrize(("who", "uid", "gid", "groups"), [
    ("root", 0, 0, [0]),
    ("the server's user", OWNER_UID, 9999, []),
    ("a peer whose primary group is the server's", STRANGER, OWNER_GID, []),
    ("a member of the server's group (supplementary)", STRANGER, STRANGER, [7, OWNER_GID]),
])
async def test_admitted(open_server, who: str, uid: int, gid: int, groups: list[int]) -> None:  # type: ignore[no-untyped-def]
    answer = await connect_as_async(open_server.path, uid, gid, groups)
    assert answer == {"jsonrpc": "2.0", "result": 7, "id": 1}, who
    assert open_server.counters.get("error.access_denied", 0) == 0


@needs_root
async def test_stranger_refused_counted_and_server_serves_on(open_server) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2):
        answer = await connect_as_async(open_server.path, STRANGER, STRANGER, [7])
        error = answer["error"]
        assert error["code"] == ErrorCode.ACCESS_DENIED and error["message"] == "Access denied"
        assert f"uid {STRANGER} may not use this control socket" in error["data"]
        assert f"gid {OWNER_GID}" in error["data"] and "usermod -aG" in error["data"]
    assert open_server.counters["error.access_denied"] == 2
    assert open_server.counters[f"access_denied.uid.{STRANGER}"] == 2
    assert "requests" not in open_server.counters  # the refused requests were never dispatched
    async with await JsonRpcClient.connect(open_server.path) as client:
        assert await client.call("ping", {"n": 3}) == 3


@needs_root
async def test_file_mode_keeps_others_out(short_tmp: Path) -> None:
    os.chmod(short_tmp, 0o711)
    server = JsonRpcServer(registry(), short_tmp / "s.sock", mode=0o660,
                           access=LocalUsers(uid=OWNER_UID, gid=OWNER_GID))
    await server.start()
    try:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o660
        # connect() needs write permission on the socket file: the kernel refuses before we see it
        assert await connect_as_async(server.path, STRANGER, STRANGER, []) == "PermissionError"
        assert server.counters.get("error.access_denied", 0) == 0
    finally:
        await server.close()


@pytest.mark.parametrize(("mode", "dir_mode"), [(0o660, 0o750), (0o600, 0o700), (0o666, 0o755)])
async def test_socket_and_created_directory_modes(short_tmp: Path, mode: int, dir_mode: int) -> None:
    path = short_tmp / "run" / "dedloc" / "c.sock"
    old_umask = os.umask(0o022)  # the directory's mode must not depend on the caller's umask
    try:
        server = JsonRpcServer(registry(), path, mode=mode)
        await server.start()
    finally:
        os.umask(old_umask)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == dir_mode
    finally:
        await server.close()


async def test_client_reports_why_the_server_hung_up(short_tmp: Path) -> None:
    """A refused client sees ACCESS_DENIED, not just "connection closed" (a stand-in server that
    refuses like JsonRpcServer does, before or after the request arrives)."""
    refusal = (b'{"jsonrpc": "2.0", "error": {"code": 1017, "message": "Access denied", '
               b'"data": "uid 5000 may not use this control socket"}, "id": null}\n')

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(refusal)
        writer.close()

    server = await asyncio.start_unix_server(refuse, path=str(short_tmp / "r.sock"))
    try:
        for delay in (0.0, 0.2):
            async with await JsonRpcClient.connect(short_tmp / "r.sock") as client:
                await asyncio.sleep(delay)
                with pytest.raises(RpcCallError) as caught:
                    await client.call("ping", timeout=10)
            assert caught.value.code == ErrorCode.ACCESS_DENIED
            assert "uid 5000" in str(caught.value)
    finally:
        server.close()
        await server.wait_closed()


def test_groups_from_proc_status() -> None:
    text = "Name:\tbash\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 27 1000 \nNgid:\t0\n"
    assert groups_from_proc_status(text) == frozenset({4, 24, 27, 1000})
    assert groups_from_proc_status("Groups:\n") == frozenset()
    assert groups_from_proc_status("Name:\tx\n") is None


# Loopback TCP with a token ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("127.3.4.5:7300", ("127.3.4.5", 7300)),
    ("[::1]:7300", ("::1", 7300)),
])
def test_loopback_addresses(text: str, expected: tuple[str, int]) -> None:
    assert loopback_address(text) == expected


@pytest.mark.parametrize(("text", "reason"), [
    ("0.0.0.0:7300", "not a loopback address"),
    ("192.168.1.20:7300", "not a loopback address"),
    ("[::]:7300", "not a loopback address"),
    ("localhost:7300", "not an IP address"),
    ("127.0.0.1", "not HOST:PORT"),
    ("127.0.0.1:70000", "from 0 to 65535"),
])
def test_other_addresses_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        loopback_address(text)


def test_token_file(short_tmp: Path) -> None:
    path = short_tmp / "state" / "rpc-token"
    token = load_or_create_token(path)
    assert len(token) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_token(path) == token == read_token(path)  # kept
    os.chmod(path, 0o640)
    with pytest.raises(AccessError, match="mode 0640"):
        load_or_create_token(path)
    os.chmod(path, 0o600)
    path.write_text("short\n")
    with pytest.raises(AccessError, match="no valid token"):
        read_token(path)
    link = short_tmp / "link"
    link.symlink_to(path)
    with pytest.raises(AccessError, match="cannot read"):
        read_token(link)
    with pytest.raises(FileNotFoundError):
        read_token(short_tmp / "none")


@pytest.fixture
async def tcp_server(short_tmp: Path):  # type: ignore[no-untyped-def]
    server = JsonRpcServer(registry(), short_tmp / "s.sock", tcp_listen="127.0.0.1:0",
                           token_file=short_tmp / "rpc-token", auth_timeout=1.0,
                           max_unauthenticated=2)
    await server.start()
    yield server, read_token(short_tmp / "rpc-token")
    await server.close()


async def tcp_exchange(server: JsonRpcServer, *lines: bytes, closed: bool) -> list[Any]:
    """Send lines one by one, each after the answer to the previous one; return the answers.
    `closed`: whether the server must have closed the connection after its last answer."""
    assert server.tcp_address is not None
    reader, writer = await asyncio.open_connection(*server.tcp_address)
    answers = []
    try:
        async with asyncio.timeout(10):
            for line in lines:
                writer.write(line)
                await writer.drain()
                answer = await reader.readline()
                if not answer:
                    break
                answers.append(orjson.loads(answer))
            if closed:
                assert await reader.read() == b"", "the server kept the connection open"
            else:
                assert len(answers) == len(lines), "the server closed the connection"
    finally:
        writer.close()
    return answers


def authenticate(token: Any, request_id: int = 1) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "method": "rpc.authenticate", "params": {"token": token},
                         "id": request_id}) + b"\n"


async def test_tcp_needs_the_token_first(tcp_server) -> None:  # type: ignore[no-untyped-def]
    server, token = tcp_server
    answers = await tcp_exchange(server, PING, closed=True)
    assert answers[0]["error"]["code"] == ErrorCode.ACCESS_DENIED
    assert "authenticate first" in answers[0]["error"]["data"] and answers[0]["id"] == 1
    answers = await tcp_exchange(server, b"not json\n", closed=True)
    assert answers[0]["error"]["code"] == ErrorCode.ACCESS_DENIED
    answers = await tcp_exchange(server, authenticate(token), PING, closed=False)
    assert answers == [{"jsonrpc": "2.0", "result": {"authenticated": True}, "id": 1},
                       {"jsonrpc": "2.0", "result": 7, "id": 1}]
    assert server.counters["error.unauthenticated"] == 2
    assert server.counters["tcp_authenticated"] == 1


async def test_tcp_wrong_tokens_counted_and_bounded(tcp_server) -> None:  # type: ignore[no-untyped-def]
    server, token = tcp_server
    wrong = "x" * len(token)
    answers = await tcp_exchange(server, authenticate(wrong), authenticate(12),
                                 authenticate(wrong), authenticate(token), closed=True)
    assert len(answers) == 3  # three attempts, then the connection is closed
    assert all(a["error"]["code"] == ErrorCode.ACCESS_DENIED for a in answers)
    assert "2 attempts left" in answers[0]["error"]["data"]
    assert "no attempts left" in answers[2]["error"]["data"]
    assert server.counters["error.bad_token"] == 3
    # a wrong token, then the right one on the same connection
    answers = await tcp_exchange(server, authenticate(wrong), authenticate(token, 2), PING,
                                 closed=False)
    assert answers[1] == {"jsonrpc": "2.0", "result": {"authenticated": True}, "id": 2}
    assert answers[2]["result"] == 7
    # the client: a wrong token is refused at connect time, the right one works
    with pytest.raises(RpcCallError) as caught:
        await JsonRpcClient.connect_tcp(f"127.0.0.1:{server.tcp_address[1]}", wrong)
    assert caught.value.code == ErrorCode.ACCESS_DENIED
    async with await JsonRpcClient.connect_tcp(server.tcp_address_text, token) as client:
        assert await client.call("ping", {"n": 9}) == 9
    assert server.counters["error.bad_token"] == 5


async def test_tcp_positional_notification_authenticates(tcp_server) -> None:  # type: ignore[no-untyped-def]
    server, token = tcp_server
    notification = orjson.dumps({"jsonrpc": "2.0", "method": "rpc.authenticate",
                                 "params": [token]}) + b"\n"
    answers = await tcp_exchange(server, notification + PING, closed=False)
    assert answers == [{"jsonrpc": "2.0", "result": 7, "id": 1}]


async def test_tcp_silent_and_waiting_connections_are_bounded(tcp_server) -> None:  # type: ignore[no-untyped-def]
    server, token = tcp_server
    silent = [await asyncio.open_connection(*server.tcp_address) for _ in range(2)]
    async with asyncio.timeout(10):
        while server.counters.get("tcp_connections", 0) < 2:  # both accepted, neither answered  # noqa: ASYNC110 - the server state is only visible by polling
            await asyncio.sleep(0.01)
    answers = await tcp_exchange(server, authenticate(token), closed=True)
    assert "too many connections are waiting" in answers[0]["error"]["data"]
    for reader, writer in silent:  # each gets its answer once the authentication time is up
        async with asyncio.timeout(10):
            answer = orjson.loads(await reader.readline())
            assert "no rpc.authenticate request within 1 s" in answer["error"]["data"]
            assert await reader.read() == b""
        writer.close()
    assert server.counters["error.auth_timeout"] == 2
    async with await JsonRpcClient.connect_tcp(server.tcp_address_text, token) as client:
        assert await client.call("ping") == 0


async def test_client_never_sends_a_token_off_the_machine() -> None:
    with pytest.raises(ValueError, match="not a loopback address"):
        await JsonRpcClient.connect_tcp("192.0.2.1:7300", "secret-token-0123456789")
