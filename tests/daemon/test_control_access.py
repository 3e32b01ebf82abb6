"""Access to a real daemon's control API: its socket's mode, its users' credentials, and the
loopback TCP listener with its token. The daemon keeps serving through every refusal."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from credentials import connect_as_async
from support import DaemonProcess

from dedloc.daemon.config import ConfigError, build_config
from dedloc.rpc import ErrorCode, JsonRpcClient, RpcCallError

NOBODY = 65534
NODE_INFO = b'{"jsonrpc": "2.0", "method": "node.info", "id": 1}\n'

needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="taking other credentials needs root (CI runs as root)")


@needs_root
async def test_other_users_refused_and_counted(daemon_factory, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    """The daemon runs as root (uid 0, gid 0). Its socket is made world-connectable here, so the
    kernel lets anybody connect and the credential check alone decides."""
    daemon = await daemon_factory("--rpc.socket_mode", "0o666")
    for directory in (short_tmp, daemon.root):
        os.chmod(directory, 0o711)
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o666

    answer = await connect_as_async(daemon.socket_path, NOBODY, NOBODY, [], NODE_INFO)
    error = answer["error"]
    assert error["code"] == ErrorCode.ACCESS_DENIED
    assert f"uid {NOBODY} may not use this control socket" in error["data"]
    assert "usermod -aG root USER" in error["data"]
    # members of the daemon's group are admitted, by primary or supplementary group
    for gid, groups in ((0, []), (NOBODY, [0])):
        answer = await connect_as_async(daemon.socket_path, NOBODY, gid, groups, NODE_INFO)
        assert answer["result"]["peer_id"], answer
    info = await daemon.call("node.info")  # root, the daemon's own user
    assert info["counters"]["error.access_denied"] == 1
    assert info["counters"][f"access_denied.uid.{NOBODY}"] == 1
    refusals = [e for e in daemon.events() if e.get("event") == "rpc_access_denied"]
    assert [(e["uid"], e["gid"]) for e in refusals] == [(NOBODY, NOBODY)]
    assert daemon.process.returncode is None


@needs_root
async def test_socket_mode_and_its_directory(daemon_factory, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    """The default mode 0660 on the socket, and a socket directory the daemon creates opens only
    to the socket's group (0750): another user cannot even reach the socket."""
    path = short_tmp / "run" / "ctl" / "dedlocd.sock"
    daemon = await daemon_factory("--rpc.socket", str(path))
    daemon.socket_path = path
    os.chmod(short_tmp, 0o711)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o750
    assert await connect_as_async(path, NOBODY, NOBODY, [], NODE_INFO) == "PermissionError"
    assert (await daemon.call("node.info"))["addresses"]["control_tcp"] is None


async def dedloc_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dedloc.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def raw_tcp(address: str, *lines: bytes) -> list[dict]:
    """Send the lines at once; collect answers until the server closes the connection."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"".join(lines))
    await writer.drain()
    answers = []
    async with asyncio.timeout(30):
        while line := await reader.readline():
            answers.append(orjson.loads(line))
    writer.close()
    return answers


async def test_tcp_listener_with_token(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = await daemon_factory("--rpc.tcp_listen", "127.0.0.1:0")
    address = (await daemon.call("node.info"))["addresses"]["control_tcp"]
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    token_file = daemon.root / "state" / "rpc-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()

    # no token: the first request is refused and the connection closed
    answers = await raw_tcp(address, NODE_INFO)
    assert len(answers) == 1 and answers[0]["error"]["code"] == ErrorCode.ACCESS_DENIED
    assert "authenticate first" in answers[0]["error"]["data"]
    # wrong token: refused and counted
    with pytest.raises(RpcCallError) as caught:
        await JsonRpcClient.connect_tcp(address, "not-the-token-" + "x" * 30)
    assert caught.value.code == ErrorCode.ACCESS_DENIED and "wrong token" in str(caught.value)
    # right token: the API answers
    async with await JsonRpcClient.connect_tcp(address, token) as client:
        info = await client.call("node.info")
    assert info["peer_id"] and info["counters"]["error.bad_token"] == 1
    assert info["counters"]["error.unauthenticated"] == 1

    # the CLI: --tcp with the token file; a wrong token file; no token file
    code, out, err = await dedloc_cli("--tcp", address, "--token-file", str(token_file), "info")
    assert code == 0 and "peer id" in out and f"tcp:{address}" in out, err
    wrong = daemon.root / "wrong-token"
    wrong.write_text("y" * 43 + "\n")
    code, _, err = await dedloc_cli("--tcp", address, "--token-file", str(wrong), "info")
    assert code == 1 and "Access denied" in err and "wrong token" in err
    code, _, err = await dedloc_cli("--tcp", address, "--token-file", str(daemon.root / "none"), "info")
    assert code == 2 and "does not exist" in err and "--token-file" in err
    assert (await daemon.call("node.info"))["counters"]["error.bad_token"] == 2
    assert daemon.process.returncode is None

    # the token is kept across restarts
    assert await daemon.terminate() == 0
    again = await DaemonProcess.start(daemon.root, "--rpc.tcp_listen", "127.0.0.1:0")
    try:
        address = (await again.call("node.info"))["addresses"]["control_tcp"]
        assert token_file.read_text().strip() == token
        async with await JsonRpcClient.connect_tcp(address, token) as client:
            assert (await client.call("node.info"))["peer_id"] == info["peer_id"]
    finally:
        await again.kill()


@pytest.mark.parametrize(("address", "reason"), [
    ("0.0.0.0:7300", "not a loopback address"),
    ("[::]:0", "not a loopback address"),
    ("192.0.2.7:7300", "not a loopback address"),
    ("localhost:7300", "not an IP address"),
])
def test_non_loopback_tcp_listen_refused_at_start(tmp_path: Path, address: str, reason: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dedloc.daemon", "--node.state_dir", str(tmp_path / "state"),
         "--rpc.tcp_listen", address], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "rpc.tcp_listen" in result.stderr and reason in result.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made


@pytest.mark.parametrize(("rpc", "reason"), [
    ({"socket_mode": 660}, "write it in octal"),  # decimal 660 is 0o1224
    ({"socket_mode": 0o440}, "include 0o600"),
    ({"socket_mode": -1}, "not a permission mode"),
    ({"tcp_listen": "0.0.0.0:7300"}, "not a loopback address"),
    ({"tcp_listen": "127.0.0.1"}, "not HOST:PORT"),
])
def test_rpc_config_checked(rpc: dict, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"rpc": rpc})
    assert caught.value.key == f"rpc.{next(iter(rpc))}" and reason in str(caught.value)
    assert build_config({"rpc": {"socket_mode": 0o600, "tcp_listen": "[::1]:0"}})
