"""A real dedlocd: discover its API, train the tiny workload through it, stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from support import wait_until

CONTROL_METHODS = {"node.info", "node.shutdown", "node.peers", "node.connect", "dht.store", "dht.get",
                   "averaging.average", "averaging.status",
                   "workloads.list", "run.start", "run.status", "run.stop", "run.restart",
                   "token.issue", "token.revoke", "token.list",
                   "node.pause", "node.resume", "node.availability", "rpc.discover",
                   "node.bandwidth", "node.set_bandwidth"}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_discover_lists_every_method_with_schemas(daemon) -> None:  # type: ignore[no-untyped-def]
    doc = await daemon.call("rpc.discover")
    methods = {m["name"]: m for m in doc["methods"]}
    assert set(methods) == CONTROL_METHODS
    start_params = {p["name"]: p for p in methods["run.start"]["params"]}
    assert start_params["workload"]["required"] is False  # null: join a run by its name
    assert start_params["role"]["schema"]["anyOf"][0]["enum"] == ["trainer", "aux"]
    assert start_params["target_batch_size"]["schema"]["minimum"] == 1
    for method in methods.values():
        assert method["summary"], method["name"]
    info = await daemon.call("node.info")
    assert info["peer_id"] and info["addresses"]["control"] == f"unix:{daemon.socket_path}"


async def test_train_tiny_then_sigterm(daemon) -> None:  # type: ignore[no-untyped-def]
    listing = await daemon.call("workloads.list")
    tiny = next(w for w in listing["workloads"] if w["name"] == "tiny")
    assert tiny["description"] and tiny["config_schema"]["properties"]

    started = await daemon.call("run.start", {"workload": "tiny", "target_batch_size": 64,
                                              "config": {"seed": 1} if "seed" in tiny["config_schema"]
                                              ["properties"] else {}})
    assert started["state"] == "running" and started["parameters"] > 0

    async def trained() -> dict | None:
        (status,) = await daemon.call("run.status", {"name": "tiny"})
        assert status["state"] == "running", status
        return status if status["epoch"] >= 12 else None

    status = await wait_until(trained)
    losses = status["epoch_losses"]
    assert status["samples"] >= 12 * 64
    assert losses[-1] < losses[0], losses
    assert status["loss"] < status["loss_first"]
    worker_pid = status["worker"]["pid"]
    assert pid_alive(worker_pid)

    assert await daemon.terminate(signal.SIGTERM) == 0
    assert not daemon.socket_path.exists()
    assert not pid_alive(worker_pid)
    events = [e["event"] for e in daemon.events()]
    assert "dedlocd_stopping" in events and "dedlocd_stopped" in events
    run_dir = daemon.root / "state" / "runs" / "tiny" / status["fingerprint"]
    assert (run_dir / "run.json").exists() and list(run_dir.glob("checkpoint-*.pt"))


async def test_restart_of_the_daemon_resumes_the_run(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    first = await daemon_factory()
    await first.call("run.start", {"workload": "tiny", "target_batch_size": 32})

    async def some_epochs() -> bool:
        (status,) = await first.call("run.status")
        return status["epoch"] >= 3

    await wait_until(some_epochs)
    await first.call("run.stop")
    (stopped,) = await first.call("run.status")
    assert stopped["state"] == "stopped"
    assert await first.terminate() == 0

    # Same state directory, new process: the run resumes at the epoch it stopped at.
    from support import DaemonProcess

    second = await DaemonProcess.start(first.root)
    try:
        resumed = await second.call("run.start", {"workload": "tiny", "target_batch_size": 32})
        assert resumed["epoch"] == stopped["epoch"]
        assert resumed["samples"] == stopped["samples"] - stopped["accumulated"]
        assert await second.call("node.shutdown") == {"stopping": True}
        assert await second.wait_exit() == 0
    finally:
        if second.process.returncode is None:
            await second.kill()


async def test_sigusr1_writes_every_threads_stack_and_the_daemon_goes_on(daemon) -> None:  # type: ignore[no-untyped-def]
    # what a daemon that stopped answering is doing, even with its event loop blocked
    await daemon.dump_stacks(wait=0)
    await wait_until(lambda: _read(daemon.root / "stacks.txt"), timeout=30)
    stacks = (daemon.root / "stacks.txt").read_text()
    assert "base_events.py" in stacks and "run_forever" in stacks, stacks  # the event loop's
    assert (await daemon.call("node.info"))["peer_id"]


async def _read(path) -> bool:  # type: ignore[no-untyped-def]
    return path.exists() and "most recent call first" in path.read_text()


async def test_the_duty_cycle_reaches_the_worker_and_it_still_trains(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = await daemon_factory("--workers.duty_cycle", "0.25")
    await daemon.call("run.start", {"workload": "tiny", "target_batch_size": 64})

    async def trained() -> dict | None:
        (status,) = await daemon.call("run.status", {"name": "tiny"})
        assert status["state"] == "running", status
        return status if status["epoch"] >= 3 else None

    status = await wait_until(trained)
    argv = Path(f"/proc/{status['worker']['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--duty-cycle") + 1] == b"0.25"
