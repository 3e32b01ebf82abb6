"""The service unit passes `systemd-analyze verify` with no warning at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from dedloc.daemon.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_unit_verifies_cleanly(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: `make test` installs it (package systemd)"
    unit = (ROOT / "systemd" / "dedlocd.service").read_text()
    # Point ExecStart at this environment's dedlocd: verify checks that the binary exists.
    dedlocd = Path(sys.executable).with_name("dedlocd")
    assert dedlocd.exists()
    path = tmp_path / "dedlocd.service"
    path.write_text(unit.replace("/usr/local/bin/dedlocd", str(dedlocd)))
    result = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_unit_has_what_a_volunteer_service_needs() -> None:
    unit = (ROOT / "systemd" / "dedlocd.service").read_text()
    settings = dict(line.split("=", 1) for line in unit.splitlines()
                    if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify"
    assert settings["Restart"] == "on-failure"
    assert settings["WatchdogSec"]
    for key in ("StateDirectory", "RuntimeDirectory", "ConfigurationDirectory", "Nice",
                "IOSchedulingClass", "NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
                "RestrictAddressFamilies"):
        assert key in settings, key
    assert settings["ProtectSystem"] == "strict"


def test_sample_config_is_valid() -> None:
    path = ROOT / "systemd" / "dedlocd.toml"
    tomllib.loads(path.read_text())
    load_config(path)
