"""A restarted daemon resumes its run from the newest intact checkpoint: never from one that a kill
cut short or that was damaged later (the previous one is loaded instead)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import orjson
from support import DaemonProcess, wait_until

PARAMS = {"workload": "tiny", "name": "saved", "target_batch_size": 64, "checkpoint_every": 1,
          "config": {"hidden": 256, "layers": 2}}


async def _train_to(daemon: Any, epoch: int) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        (status,) = await daemon.call("run.status", {"name": "saved"})
        assert status["state"] == "running", status
        return status if status["epoch"] >= epoch else None

    return await wait_until(reached, timeout=120)


def _listed(run_dir: Path) -> list[dict[str, Any]]:
    return orjson.loads((run_dir / "run.json").read_bytes())["checkpoints"]


async def _restart(daemon: Any) -> DaemonProcess:
    return await DaemonProcess.start(daemon.root)


async def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(daemon_factory: Any) -> None:
    first = await daemon_factory()
    await first.call("run.start", PARAMS)
    await _train_to(first, 3)
    stopped = await first.call("run.stop", {"name": "saved"})
    assert await first.terminate() == 0
    run_dir = first.root / "state" / "runs" / "saved" / stopped["fingerprint"]
    newest, previous = _listed(run_dir)[:2]
    assert newest["epoch"] == stopped["epoch"] and previous["epoch"] < newest["epoch"]
    path = run_dir / newest["file"]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short
    # What killed writes leave behind: a worker's temporary file, a file never listed.
    (run_dir / ".checkpoint-000000777.pt.x1.tmp").write_bytes(b"half a checkpoint")
    (run_dir / "checkpoint-000000999.pt").write_bytes(b"never vouched for")

    second = await _restart(first)
    try:
        resumed = await second.call("run.start", PARAMS)
        assert resumed["resumed_from"]["epoch"] == previous["epoch"]
        assert resumed["epoch"] == previous["epoch"]
        assert resumed["checkpoints_rejected"] == 1
        assert not (run_dir / ".checkpoint-000000777.pt.x1.tmp").exists()
        assert not (run_dir / "checkpoint-000000999.pt").exists()
        await _train_to(second, previous["epoch"] + 2)  # and it trains on from there
    finally:
        await second.kill()


async def test_a_kill_while_checkpointing_never_loads_a_torn_checkpoint(daemon_factory: Any) -> None:
    first = await daemon_factory()
    await first.call("run.start", {**PARAMS, "config": {"hidden": 1024, "layers": 3}})
    status = await _train_to(first, 2)  # the epoch-1 checkpoint is listed by now
    worker_pid = status["worker"]["pid"]
    deadline = time.monotonic() + 120
    while True:  # kill the daemon and its worker while a checkpoint is being written
        (status,) = await first.call("run.status", {"name": "saved"})
        if status["phase"] == "checkpointing":
            first.process.kill()
            break
        assert time.monotonic() < deadline, "the run was never seen checkpointing"
    os.kill(worker_pid, signal.SIGKILL)
    await first.kill()
    run_dir = first.root / "state" / "runs" / "saved" / status["fingerprint"]
    listed = _listed(run_dir)

    second = await _restart(first)
    try:
        resumed = await second.call("run.start", {**PARAMS, "config": {"hidden": 1024, "layers": 3}})
        # Exactly the newest checkpoint the record vouches for, whatever the kill interrupted.
        assert resumed["resumed_from"]["epoch"] == listed[0]["epoch"]
        assert resumed["checkpoints_rejected"] == 0
        names = {p.name for p in run_dir.iterdir()}
        assert names == {"run.json", *(entry["file"] for entry in listed)}
        await _train_to(second, listed[0]["epoch"] + 1)
    finally:
        await second.kill()
