"""A daemon takes part in the run its config's [run] section names, by itself: a volunteer's joins
the run from the line `dedloc run create` printed (through `dedloc service install`'s config), one
started before the run exists joins once it appears, a run the volunteer stops stays stopped
(restarts included), and an owner's daemon starts its run again from the manifest file."""

from __future__ import annotations

import random
import shlex
from pathlib import Path
from typing import Any

import pytest
from support import DaemonProcess, dedloc_cli, join_by_name, p2p_address, wait_until

from dedloc.cli.main import main as dedloc_main
from dedloc.daemon.collab.autojoin import BASE_DELAY, backoff_delay
from dedloc.daemon.collab.secrecy import RunSecret
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.config import ConfigError, build_config
from dedloc.daemon.identity import Identity


async def _run(daemon: Any, name: str) -> dict[str, Any] | None:
    runs = [r for r in await daemon.call("run.status") if r["name"] == name]
    return runs[0] if runs else None


def _events(daemon: DaemonProcess, event: str) -> list[dict[str, Any]]:
    return [e for e in daemon.events() if e.get("event") == event]


async def _logged(daemon: DaemonProcess, event: str) -> bool:
    return bool(_events(daemon, event))


async def test_a_volunteer_joins_from_the_pasted_line_and_the_owner_restarts_its_run(
        daemon_factory: Any, tmp_path: Path) -> None:
    owner = await daemon_factory()
    manifest = tmp_path / "pasted.manifest.json"
    code, out, err = await dedloc_cli(owner.socket_path, "run", "create", "tiny", "--name", "pasted",
                                      "--target-batch-size", "64", "--output", str(manifest))
    assert code == 0, err
    argv = shlex.split(out.strip().splitlines()[-1])  # sudo dedloc service install --join ...
    assert dedloc_main([*argv[2:], "--dry-run", "--dry-run-dir", str(tmp_path / "service")]) == 0
    volunteer = await daemon_factory("--config", str(tmp_path / "service" / "dedlocd.toml"))

    async def joined() -> dict[str, Any] | None:
        status = await _run(volunteer, "pasted")
        return status if status and status["state"] == "running" else None

    status = await wait_until(joined, timeout=120)
    started = await _run(owner, "pasted")
    assert started is not None and status["fingerprint"] == started["fingerprint"]
    # (the run is running once run.start has set it so; autojoin logs it after that call has
    # returned: a moment later, longer on a loaded machine, where CI once read the log between)
    await wait_until(lambda: _logged(volunteer, "run_autojoined"), timeout=60, interval=0.1)

    # The owner's daemon, restarted with the manifest file, starts its run again by itself.
    assert await owner.terminate() == 0
    again = await DaemonProcess.start(owner.root, "--run.manifest", str(manifest))
    try:
        status = await wait_until(lambda: _run(again, "pasted"), timeout=120)
        assert status["fingerprint"] == started["fingerprint"] and status["state"] == "running"
    finally:
        await again.kill()


async def test_it_joins_once_the_run_appears_and_a_stop_by_the_volunteer_sticks(
        daemon_factory: Any) -> None:
    first = await daemon_factory()
    args = ("--net.bootstrap", await p2p_address(first), "--run.join", "later",
            "--run.retry_max_seconds", "2")
    second = await daemon_factory(*args)

    async def waiting() -> bool:
        return any("no peer publishes" in e["error"] for e in _events(second, "run_autojoin_waiting"))

    await wait_until(waiting, timeout=60)
    assert await _run(second, "later") is None
    await first.call("run.start", {"workload": "tiny", "name": "later", "collaborative": True,
                                   "target_batch_size": 64, "checkpoint_every": 0})

    async def running() -> dict[str, Any] | None:
        status = await _run(second, "later")
        return status if status and status["state"] == "running" else None

    # (a safety net: both daemons start a worker, which on a loaded 2-core machine took longer
    # than 120 s together)
    await wait_until(running, timeout=360)
    await second.call("run.stop", {"name": "later"})
    await wait_until(lambda: _logged(second, "run_autojoin_remembers_stop"), timeout=30)
    assert (await _run(second, "later"))["state"] == "stopped"

    # Restarted (a reboot, Restart=on-failure): the volunteer's stop holds.
    assert await second.terminate() == 0
    again = await DaemonProcess.start(second.root, *args)
    try:
        await wait_until(lambda: _logged(again, "run_autojoin_skipped"), timeout=30)
        assert await _run(again, "later") is None

        await join_by_name(again, "later")  # `dedloc join later`
        await wait_until(lambda: _logged(again, "run_autojoin_resumed"), timeout=30)
        assert not (again.root / "state" / "autojoin-stopped").exists()
    finally:
        await again.kill()


def test_the_run_section_refuses_what_can_never_work(tmp_path: Path) -> None:
    owner = Identity.load_or_create(tmp_path / "owner")
    token = MembershipToken.issue(owner, "club", owner.peer_id, "trainer", 3600.0,
                                  RunSecret.generate()).encode()
    assert build_config({"run": {"token": token, "join": "club"}}).run.join == "club"
    for run, key in (({"join": "no spaces"}, "run.join"), ({"token": "garbage"}, "run.token"),
                     ({"token": token, "join": "other"}, "run.token"),
                     ({"token": token, "token_file": "/etc/dedloc/run-token"}, "run.token"),
                     ({"manifest": "/x.json", "join": "club"}, "run.manifest"),
                     ({"join": "club", "retry_max_seconds": 0.5}, "run.retry_max_seconds")):
        with pytest.raises(ConfigError) as refused:
            build_config({"run": run})
        assert refused.value.key == key, run


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    rng = random.Random(1)
    for attempt, full in enumerate([2, 4, 8, 16, 32, 60, 60, 60]):
        delays = [backoff_delay(attempt, 60.0, rng) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays) and len(set(delays)) > 1
    assert backoff_delay(10_000, 60.0, rng) <= 60.0
    assert BASE_DELAY == 2.0
