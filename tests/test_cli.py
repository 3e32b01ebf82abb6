"""The `dedloc` CLI against a real daemon, and when there is none."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import orjson
import pytest
from support import dedloc_cli

from dedloc.cli.main import _request, build_parser

dedloc = dedloc_cli


async def test_no_daemon_tells_how_to_start_it(short_tmp: Path) -> None:
    code, _, err = await dedloc(short_tmp / "none.sock", "info")
    assert code == 3
    assert "Traceback" not in err
    assert "dedlocd" in err and "cannot reach the daemon" in err


async def test_cli_drives_a_daemon(daemon) -> None:  # type: ignore[no-untyped-def]
    socket = daemon.socket_path
    code, out, _ = await dedloc(socket, "info")
    assert code == 0 and "peer id" in out
    code, out, _ = await dedloc(socket, "--json", "info")
    assert orjson.loads(out)["peer_id"]
    code, out, _ = await dedloc(socket, "workloads")
    assert code == 0 and "tiny" in out
    code, out, err = await dedloc(socket, "start", "tiny", "--set", "no_such_key=3")
    assert code == 1 and "no_such_key" in err
    code, out, _ = await dedloc(socket, "--json", "start", "tiny", "--target-batch-size", "32",
                                "--epochs", "3")
    assert code == 0 and orjson.loads(out)["target_batch_size"] == 32
    code, out, _ = await dedloc(socket, "status", "--watch", "--interval", "0.2")
    assert code == 0  # returns once the run has finished its 3 epochs
    assert "finished" in out and "epoch 3/3" in out
    code, out, _ = await dedloc(socket, "call", "run.status", '{"name": "tiny"}')
    (status,) = orjson.loads(out)
    assert status["state"] == "finished" and status["epoch"] == 3
    code, out, err = await dedloc(socket, "call", "run.status", '{"name": 3}')
    assert code == 1 and "Invalid params" in err and "name" in err
    code, out, _ = await dedloc(socket, "shutdown")
    assert code == 0
    assert await daemon.wait_exit() == 0


async def test_status_watch_redraws_until_ctrl_c(daemon) -> None:  # type: ignore[no-untyped-def]
    socket = daemon.socket_path
    code, _, _ = await dedloc(socket, "start", "tiny", "--target-batch-size", "32", "--epochs", "100000")
    assert code == 0
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dedloc.cli", "--socket", str(socket), "status", "--watch",
        "--interval", "0.1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    out = b""
    try:
        async with asyncio.timeout(120):  # (a safety net)
            while out.count(b"tiny [tiny]") < 3:  # three updates, each its own block (not a terminal)
                out += await process.stdout.read(4096)
            process.send_signal(signal.SIGINT)
            rest, err = await process.communicate()
    except TimeoutError:
        process.kill()
        rest, err = await process.communicate()
        raise AssertionError(f"the watch did not end: {out + rest!r} {err!r}") from None
    assert process.returncode == 0, err.decode()
    assert b"Traceback" not in err
    blocks = (out + rest).decode().split("\n\n")
    assert len(blocks) >= 3 and all(block.startswith("tiny [tiny]  ") for block in blocks)
    assert "\x1b[" not in blocks[1] and "next step" in blocks[1] and "epoch " in blocks[1]
    code, _, _ = await dedloc(socket, "stop")
    assert code == 0


async def test_join_a_run_by_name_as_aux(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    from support import p2p_address, wait_until

    first = await daemon_factory()
    second = await daemon_factory("--net.bootstrap", await p2p_address(first))
    code, out, _ = await dedloc(first.socket_path, "--json", "start", "tiny", "--name", "shared",
                                "--collaborative", "--average-state-every", "3", "--compression", "fp16")
    assert code == 0
    started = orjson.loads(out)
    assert started["manifest"]["average_state_every"] == 3 and started["manifest"]["compression"] == "fp16"
    code, _, err = await dedloc(second.socket_path, "join", "nobody-runs-this")
    assert code == 1 and "Traceback" not in err
    assert "no peer publishes" in err or "not joined the network yet" in err

    async def joined() -> dict | None:
        code, out, err = await dedloc(second.socket_path, "--json", "join", "shared", "--aux")
        assert code in (0, 1), err
        return orjson.loads(out) if code == 0 else None

    status = await wait_until(joined, timeout=60)
    assert status["role"] == "aux" and status["fingerprint"] == started["fingerprint"]
    code, out, _ = await dedloc(second.socket_path, "status")
    assert code == 0 and "aux" in out


async def test_tokens_and_pause_from_the_cli(daemon) -> None:  # type: ignore[no-untyped-def]
    """The owner's token commands, pause/resume, and join's argument checks."""
    from dedloc.daemon.identity import Identity

    socket = daemon.socket_path
    volunteer = Identity.generate().peer_id
    code, out, err = await dedloc(socket, "token", "issue", "club", volunteer, "--days", "2")
    assert code == 0, err
    assert f"token for {volunteer} (trainer" in out and "dedloc join --token dlt2." in out
    code, out, _ = await dedloc(socket, "--json", "token", "list", "club")
    (issued,) = orjson.loads(out)["tokens"]
    assert issued["peer"] == volunteer and not issued["revoked"]
    code, out, err = await dedloc(socket, "token", "revoke", "club")
    assert code == 2 and "--serial or --peer" in err
    code, out, _ = await dedloc(socket, "token", "revoke", "club", "--serial", issued["serial"])
    assert code == 0 and issued["serial"] in out
    code, out, _ = await dedloc(socket, "token", "list", "club")
    assert "revoked" in out
    code, out, err = await dedloc(socket, "token", "issue", "club", "not-a-peer-id")
    assert code == 1 and "peer id" in err
    code, out, _ = await dedloc(socket, "pause")
    assert code == 0 and "training waits: paused by the volunteer" in out
    code, out, _ = await dedloc(socket, "resume")
    assert code == 0 and "training goes on" in out
    code, out, err = await dedloc(socket, "join")
    assert code == 2 and "--token" in err


def test_start_sends_a_local_runs_inner_lr_scale() -> None:
    def params(*extra: str) -> dict[str, object]:
        args = build_parser().parse_args(["start", "tiny", "--sync", "local", "--inner-steps", "4",
                                          *extra])
        method, sent = _request(args)
        assert method == "run.start" and isinstance(sent, dict)
        return sent

    assert "inner_lr_scale" not in params()  # the daemon's default (auto)
    assert params("--inner-lr-scale", "AUTO")["inner_lr_scale"] == "auto"
    assert params("--inner-lr-scale", "0.25")["inner_lr_scale"] == 0.25
    with pytest.raises(SystemExit):  # argparse: "expected auto or a number"
        params("--inner-lr-scale", "half")
    # the outer settings: what is given is sent; NaN would go out as JSON null (the default)
    assert "feedback_decay" not in params() and "outer_lr" not in params()
    sent = params("--feedback-decay", "0.9", "--outer-lr", "2", "--outer-momentum", "0")
    assert (sent["feedback_decay"], sent["outer_lr"], sent["outer_momentum"]) == (0.9, 2.0, 0.0)
    for option in ("--feedback-decay", "--outer-lr", "--outer-momentum", "--outer-clip"):
        for bad in ("nan", "inf", "x"):
            with pytest.raises(SystemExit):
                params(option, bad)
