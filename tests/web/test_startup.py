"""The daemon and its dashboard listener at start-up: refused addresses, a port in use, off by default."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def dedlocd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dedloc.daemon", *args], capture_output=True,
                          text=True, timeout=120)


def test_a_non_loopback_dashboard_is_refused_by_name() -> None:
    result = dedlocd("--dashboard.listen", "0.0.0.0:8470")
    assert result.returncode == 2
    assert "dashboard.listen" in result.stderr and "not a loopback address" in result.stderr


def test_the_default_config_documents_the_dashboard() -> None:
    result = dedlocd("--print-default-config")
    assert result.returncode == 0
    assert '[dashboard]\n' in result.stdout and '\nlisten = ""\n' in result.stdout


def test_a_dashboard_port_in_use_fails_the_start_with_its_reason(short_tmp: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = dedlocd("--node.state_dir", str(short_tmp / "state"), "--node.runtime_dir",
                         str(short_tmp), "--net.listen", "/ip4/127.0.0.1/tcp/0", "--log.format",
                         "json", "--dashboard.listen", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert "dashboard" in result.stderr and "dedlocd_failed" in result.stderr


async def test_off_by_default(daemon: Any) -> None:
    info = await daemon.call("node.info")
    assert info["dashboard"] is None
    assert not any(name.startswith("dashboard.") for name in info["counters"])
