"""`dedloc service install|uninstall` and `dedloc run create`.

The dry run's unit passes `systemd-analyze verify` and its config loads with the choices; without
root nothing happens; the real path is run against a temporary root with stand-ins for systemctl,
useradd, userdel and groupdel on PATH that record their arguments (nothing on this machine is
touched); `dedloc run create` against a real daemon writes a manifest and prints a line that parses
back into a `dedloc service install` command.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import dedloc_cli, p2p_address

from dedloc.cli import service_steps
from dedloc.cli.main import build_parser, main
from dedloc.daemon.collab.autojoin import read_manifest_file
from dedloc.daemon.collab.secrecy import RunSecret
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.config import load_config
from dedloc.daemon.identity import Identity

ROOT = Path(__file__).resolve().parents[1]
DEDLOCD = Path(sys.executable).with_name("dedlocd")
PEER = "/ip4/203.0.113.5/tcp/4100/p2p/12D3KooWExamplePeer"


def _token(tmp_path: Path, run: str, role: str = "trainer") -> str:
    owner = Identity.load_or_create(tmp_path / "owner")
    member = Identity.load_or_create(tmp_path / "member")
    return MembershipToken.issue(owner, run, member.peer_id, role, 3600.0, RunSecret.generate()).encode()


@pytest.fixture
def no_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any command run (useradd, systemctl) fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a command was run: {args}")

    monkeypatch.setattr(service_steps, "run_command", refuse)


def test_dry_run_writes_a_unit_that_verifies_and_the_chosen_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        no_commands: None) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: `make system-deps` installs it (package systemd)"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a dry run needs no root
    token = _token(tmp_path, "club")
    out_dir = tmp_path / "dry"
    code = main(["service", "install", "--join", "club", "--token", token, "--bootstrap", PEER,
                 "--device", "cpu", "--threads", "2", "--duty-cycle", "0.5",
                 "--upload", "10MB/s", "--download", "80Mbit/s",
                 "--hours", "22:00-07:00", "--idle-only", "--set", "net.listen=/ip4/0.0.0.0/tcp/4100",
                 "--dry-run", "--dry-run-dir", str(out_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    unit, config = out_dir / "dedlocd.service", out_dir / "dedlocd.toml"
    assert f"  {unit}\n" in out and f"  {config}\n" in out
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr
    text = unit.read_text()
    assert f"ExecStart={DEDLOCD} --config /etc/dedloc/dedlocd.toml\n" in text
    assert "User=dedloc\n" in text and "Group=dedloc\n" in text
    # Everything else is the packaged template, which is systemd/dedlocd.service itself.
    template = (ROOT / "systemd" / "dedlocd.service").read_text()
    assert text.splitlines()[1:] == [line if not line.startswith("ExecStart=") else
                                     f"ExecStart={DEDLOCD} --config /etc/dedloc/dedlocd.toml"
                                     for line in template.splitlines()]
    loaded = load_config(config)
    assert loaded.run.join == "club" and loaded.run.token_file == "/etc/dedloc/run-token"
    assert loaded.run.token == "" and not loaded.run.aux
    assert loaded.net.bootstrap == [PEER] and loaded.net.listen == ["/ip4/0.0.0.0/tcp/4100"]
    assert loaded.net.upload_bytes_per_second == 10e6
    assert loaded.net.download_bytes_per_second == 10e6
    assert loaded.workers.device == "cpu" and loaded.workers.threads == 2
    assert loaded.workers.duty_cycle == 0.5
    assert loaded.limits.hours == "22:00-07:00" and loaded.limits.idle_only
    assert loaded.log.format == "json"
    # The steps, in order; the token is never printed.
    assert token not in out
    order = ["$ useradd --system --user-group --home-dir /var/lib/dedloc --shell /usr/sbin/nologin "
             "dedloc", "write /etc/systemd/system/dedlocd.service (mode 0644)",
             "write /etc/dedloc/dedlocd.toml (mode 0644)",
             "write /etc/dedloc/run-token (mode 0600, owner dedloc): (a secret, not shown)",
             "$ systemctl daemon-reload", "$ systemctl enable dedlocd", "$ systemctl restart dedlocd"]
    positions = [out.index(step) for step in order]
    assert positions == sorted(positions), out

    assert main(["service", "uninstall", "--purge", "--dry-run"]) == 0
    out = capsys.readouterr().out
    order = ["$ systemctl disable --now dedlocd", "remove /etc/systemd/system/dedlocd.service",
             "$ systemctl daemon-reload", "remove /etc/dedloc", "remove /var/lib/dedloc",
             "$ userdel dedloc", "$ groupdel dedloc"]
    positions = [out.index(step) for step in order]
    assert positions == sorted(positions), out


def test_bad_choices_are_refused_before_anything_is_done(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_commands: None) -> None:
    dry = ["--dry-run", "--dry-run-dir", str(tmp_path)]
    cases = [(["--join", "club", "--bootstrap", "/ip4/1.2.3.4/tcp/4100"], "names no peer"),
             (["--join", "club", "--hours", "25:00-26:00"], "limits.hours"),
             (["--join", "bad name!"], "run.join"),
             (["--join", "other", "--token", _token(tmp_path, "club")], "not 'other'"),
             (["--token", _token(tmp_path, "club", role="aux")], "--aux"),
             (["--token", "garbage"], "--token"),
             (["--join", "club", "--set", "no.such=1"], "known key"),
             (["--join", "club", "--user", "root\nExecStartPre=/bin/sh"], "not a user name"),
             (["--manifest", str(tmp_path / "missing.json")], "--manifest")]
    for extra, expected in cases:
        assert main(["service", "install", *extra, *dry]) == 1, extra
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "dedlocd.service").exists()


@pytest.mark.parametrize("verb", ["install", "uninstall"])
def test_without_root_nothing_is_done(verb: str, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, no_commands: None) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["service", verb]) == 1
    err = capsys.readouterr().err
    assert "must run as root" in err and "sudo" in err and "--dry-run" in err


FAKE = """#!/bin/sh
echo "${0##*/} $*" >> "$FAKE_LOG"
if [ "${0##*/}" = useradd ]; then
    echo "dedloc:x:$FAKE_UID:$FAKE_GID::/var/lib/dedloc:/usr/sbin/nologin" >> "$FAKE_ROOT/etc/passwd"
    echo "dedloc:x:$FAKE_GID:" >> "$FAKE_ROOT/etc/group"
fi
exit "${FAKE_EXIT:-0}"
"""


def test_install_and_uninstall_into_a_root_with_stand_in_commands(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, root, log = tmp_path / "bin", tmp_path / "root", tmp_path / "calls.log"
    bin_dir.mkdir()
    (root / "etc").mkdir(parents=True)
    for name in ("systemctl", "useradd", "userdel", "groupdel"):
        (bin_dir / name).write_text(FAKE)
        (bin_dir / name).chmod(0o755)
    # Only the stand-ins can be found: nothing real is ever run.
    monkeypatch.setenv("PATH", str(bin_dir))
    for key, value in (("FAKE_LOG", log), ("FAKE_ROOT", root), ("FAKE_UID", os.getuid()),
                       ("FAKE_GID", os.getgid())):
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    token = _token(tmp_path, "club")
    install = ["service", "install", "--prefix", str(root), "--token", token, "--bootstrap", PEER]
    assert main(install) == 0, capsys.readouterr()
    assert log.read_text().splitlines() == [
        f"useradd --prefix {root} --system --user-group --home-dir /var/lib/dedloc --shell "
        "/usr/sbin/nologin dedloc", f"systemctl --root={root} enable dedlocd"]
    unit = root / "etc/systemd/system/dedlocd.service"
    assert f"ExecStart={DEDLOCD} --config /etc/dedloc/dedlocd.toml" in unit.read_text()
    config = load_config(root / "etc/dedloc/dedlocd.toml")
    assert config.run.join == "" and config.run.token_file == "/etc/dedloc/run-token"
    token_file = root / "etc/dedloc/run-token"
    assert token_file.read_text().strip() == token
    info = token_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and (info.st_uid, info.st_gid) == (os.getuid(), os.getgid())
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644

    # Again, with other choices: the user exists, the old config is kept, the token removed.
    log.unlink()
    assert main(["service", "install", "--prefix", str(root), "--join", "open", "--aux"]) == 0
    assert log.read_text().splitlines() == [f"systemctl --root={root} enable dedlocd"]
    assert load_config(root / "etc/dedloc/dedlocd.toml").run.aux
    assert load_config(root / "etc/dedloc/dedlocd.toml.old").run.token_file
    assert not token_file.exists()

    # A failing command stops with what failed.
    monkeypatch.setenv("FAKE_EXIT", "1")
    capsys.readouterr()
    assert main(["service", "install", "--prefix", str(root), "--join", "open"]) == 1
    assert "systemctl --root=" in capsys.readouterr().err
    monkeypatch.delenv("FAKE_EXIT")

    log.unlink()
    assert main(["service", "uninstall", "--prefix", str(root), "--purge"]) == 0
    assert log.read_text().splitlines() == [f"systemctl --root={root} disable dedlocd",
                                            f"userdel --prefix {root} dedloc",
                                            f"groupdel --prefix {root} dedloc"]
    assert not unit.exists() and not (root / "etc/dedloc").exists()


def test_the_unit_template_ships_with_the_package() -> None:
    from importlib import resources

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "dedlocd.service" in project["tool"]["setuptools"]["package-data"]["dedloc.cli"]
    packaged = resources.files("dedloc.cli").joinpath("dedlocd.service").read_text()
    assert packaged == (ROOT / "systemd" / "dedlocd.service").read_text()


async def test_run_create_writes_the_manifest_and_the_line_volunteers_paste(
        daemon: Any, tmp_path: Path) -> None:
    output = tmp_path / "made.json"
    code, out, err = await dedloc_cli(daemon.socket_path, "run", "create", "tiny", "--name", "made",
                                      "--target-batch-size", "64", "--set", "lr=0.02",
                                      "--output", str(output))
    assert code == 0, err
    (status,) = await daemon.call("run.status", {"name": "made"})
    assert status["collaborative"] and status["state"] == "running"
    info = await daemon.call("node.info")
    document = orjson.loads(output.read_bytes())
    assert document["fingerprint"] == status["fingerprint"] and document["owner"] == info["peer_id"]
    name, manifest, fingerprint = read_manifest_file(output)  # what [run] manifest reads
    assert (name, manifest.workload, manifest.target_batch_size) == ("made", "tiny", 64)
    assert manifest.config["lr"] == 0.02 and fingerprint == status["fingerprint"]
    line = out.strip().splitlines()[-1]
    argv = shlex.split(line)
    assert argv[:2] == ["sudo", "dedloc"]
    args = build_parser().parse_args(argv[2:])
    assert (args.command, args.service_command, args.join) == ("service", "install", "made")
    assert args.bootstrap == [await p2p_address(daemon)]  # loopback only here: it says so
    assert "volunteers elsewhere may not reach them" in err


def test_the_line_of_a_closed_run_and_the_best_addresses() -> None:
    from dedloc.cli.run_create import bootstrap_addresses, join_line

    peer = "12D3KooWExamplePeer"
    addresses = [f"/ip4/127.0.0.1/tcp/4100/p2p/{peer}", f"/ip4/192.168.1.7/tcp/4100/p2p/{peer}",
                 f"/ip4/198.51.100.1/tcp/4100/p2p/R/p2p-circuit/p2p/{peer}",
                 f"/ip4/93.184.216.34/tcp/4100/p2p/{peer}"]
    assert bootstrap_addresses(addresses)[0] == [addresses[3]]  # public first
    assert bootstrap_addresses(addresses[:3])[0] == [addresses[1]]  # then the LAN
    assert bootstrap_addresses(addresses[:1])[0] == addresses[:1]  # loopback: the last resort
    line = join_line("sealed", addresses[3:], closed=True)
    args = build_parser().parse_args(shlex.split(line)[2:])
    assert (args.join, args.bootstrap, args.token) == ("sealed", addresses[3:], "TOKEN")
