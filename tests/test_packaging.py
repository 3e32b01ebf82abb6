"""The package layout: every package listed, and the daemon side never imports torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"dedloc": "dedloc", "dedloc.daemon": "daemon", "dedloc.rpc": "rpc",
          "dedloc.plugins": "plugins", "dedloc.cli": "cli"}


def test_every_package_is_listed_in_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in LAYERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    assert found == listed


def test_daemon_and_cli_do_not_import_torch_or_plugins() -> None:
    code = ("import sys, dedloc.daemon.main, dedloc.cli.main, dedloc.cli.demo; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('dedloc.plugins')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rpc_imports_nothing_else_of_ours() -> None:
    for path in (ROOT / "rpc").rglob("*.py"):
        text = path.read_text()
        for layer in ("dedloc.daemon", "dedloc.plugins", "dedloc.cli"):
            assert layer not in text, f"{path} imports {layer}"
