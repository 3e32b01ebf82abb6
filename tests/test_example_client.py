"""examples/dedloc-client.sh (bash, socat and jq: no Python) drives a real daemon."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "dedloc-client.sh"
EPOCHS = 3
TARGET = 256


def require_tools() -> None:
    """socat and jq are test dependencies: missing, the test fails (never skips)."""
    missing = [tool for tool in ("bash", "socat", "jq") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the shell client's test needs {' and '.join(missing)}: `make test` installs "
                    "them (its system-deps target), or apt-get install socat jq", pytrace=False)


async def run_client(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(SCRIPT), *args, env={**os.environ, **(env or {})},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(240):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_shell_client_trains_and_stops_a_run(daemon: Any) -> None:
    require_tools()
    code, out, err = await run_client(env={
        "DEDLOC_SOCKET": str(daemon.socket_path), "DEDLOC_RUN": "from-shell",
        "DEDLOC_EPOCHS": str(EPOCHS), "DEDLOC_TARGET": str(TARGET)})
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    lines = out.splitlines()
    info = await daemon.call("node.info")
    assert lines[0].startswith(f"daemon {info['peer_id']} (dedlocd {info['version']})")
    assert lines[1].startswith("started run from-shell: workload tiny, target batch 256")
    progress = [line for line in lines if line.startswith("epoch ")]
    assert progress and all("samples/s" in line for line in progress)
    assert any(int(line.split()[1].split("/")[0]) >= EPOCHS for line in progress)

    summary = orjson.loads(lines[-1])
    assert summary["peer_id"] == info["peer_id"]
    assert summary["run"] == "from-shell" and summary["workload"] == "tiny"
    assert summary["state"] == "stopped"
    assert summary["epochs"] >= EPOCHS and summary["samples"] >= EPOCHS * TARGET

    # What the daemon itself saw, through the Python client.
    (status,) = await daemon.call("run.status", {"name": "from-shell"})
    assert status["state"] == "stopped"
    assert status["target_batch_size"] == TARGET
    assert status["epoch"] == summary["epoch"] >= EPOCHS
    assert len(status["epoch_losses"]) >= EPOCHS
    assert status["samples"] >= EPOCHS * TARGET
    assert status["loss"] == summary["loss"]
    assert info["counters"]["requests"] >= 4  # the script's node.info, run.start, run.status, run.stop


async def test_shell_client_reports_errors(daemon: Any, short_tmp: Path) -> None:
    require_tools()
    # An error answer: its message, code and data on stderr, exit 1, and no run started.
    code, out, err = await run_client(str(daemon.socket_path), env={"DEDLOC_RUN": "not a name"})
    assert code == 1, err
    assert "run.start: Invalid params (code -32602)" in err and '"param":"name"' in err
    assert out.startswith("daemon ")  # node.info went through first
    assert await daemon.call("run.status") == []

    # No daemon there: exit 3 with what to do.
    code, _, err = await run_client(str(short_tmp / "none.sock"))
    assert code == 3 and "no daemon socket" in err and "DEDLOC_SOCKET" in err

    # A bad setting: exit 2 before any call.
    code, _, err = await run_client(str(daemon.socket_path), env={"DEDLOC_EPOCHS": "three"})
    assert code == 2 and "DEDLOC_EPOCHS" in err
