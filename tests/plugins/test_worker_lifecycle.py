"""How a worker process starts and ends: stop, a closed connection, SIGTERM, a dead parent."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dedloc.plugins.worker.main import ZYGOTE_ENV
from dedloc.rpc import ErrorCode, RpcCallError

SHM = Path("/dev/shm")


@pytest.fixture(autouse=True)
def _started_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the worker a daemon starts itself, not one forked from a zygote
    (tests/plugins/test_worker_zygote.py)."""
    monkeypatch.delenv(ZYGOTE_ENV, raising=False)


async def test_stop_answers_then_exits_zero(launch: Callable[..., Any]) -> None:
    worker = launch()
    client = await worker.connect()
    try:
        try:
            await client.call("worker.describe")
        except RpcCallError as exc:
            assert exc.code == ErrorCode.RUN_NOT_ACTIVE and "worker.load" in exc.message
        else:
            raise AssertionError("describe before load must fail")
        assert await client.call("worker.stop") == {}
        assert await worker.wait() == 0, worker.log()
    finally:
        await client.close()
    assert not worker.socket.exists()
    assert '"event":"worker_stopped"' in worker.log()


async def test_closing_the_connection_exits_zero(launch: Callable[..., Any]) -> None:
    worker = launch()
    client = await worker.connect()
    await client.call("worker.hello")
    await client.close()
    assert await worker.wait() == 0, worker.log()
    assert "connection closed" in worker.log()


async def test_sigterm_exits_zero(launch: Callable[..., Any]) -> None:
    worker = launch()
    client = await worker.connect()
    await client.call("worker.load", {"workload": "tiny"})
    worker.process.send_signal(signal.SIGTERM)
    assert await worker.wait() == 0, worker.log()
    await client.close()


async def test_exits_when_its_parent_dies(launch: Callable[..., Any]) -> None:
    parent = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        worker = launch("--parent-pid", str(parent.pid))
        client = await worker.connect()
        await client.call("worker.hello")
        parent.kill()
        assert await worker.wait() == 0, worker.log()
        assert "worker_parent_gone" in worker.log()
        await client.close()
    finally:
        if parent.returncode is None:
            parent.kill()
        await parent.wait()


async def test_no_shared_memory_left_behind(launch: Callable[..., Any], buffers: Any) -> None:
    before = set(os.listdir(SHM))
    worker = launch()
    client = await worker.connect()
    numel = (await client.call("worker.load", {"workload": "tiny"}))["total_numel"]
    name, array = buffers.make(numel)
    await client.call("worker.train", {"samples": 64})
    await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
    assert np.abs(array).sum() > 0
    await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel})
    await client.call("worker.stop")
    assert await worker.wait() == 0, worker.log()
    await client.close()
    await asyncio.sleep(0)
    assert (SHM / name).exists(), "the worker must never unlink the daemon's buffer"
    del array
    buffers.close()
    # Only what this test and its worker made: other processes on the machine use /dev/shm too
    # (and other tests run at the same time: unnamed `psm_` segments cannot be told apart).
    ours = (f"torch_{worker.process.pid}_", f"dedloc-{os.getpid()}-")
    assert {n for n in set(os.listdir(SHM)) - before if n.startswith(ours)} == set()
    assert "resource_tracker" not in worker.log()


def test_the_gpu_memory_cap_reaches_the_worker_and_its_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap travels in the environment (replicas inherit it); on a machine without a GPU it
    is a no-op that still reports the fraction. Whether torch enforces it needs a GPU."""
    from dedloc.plugins.worker.main import GPU_MEMORY_ENV, cap_gpu_memory, parse_args

    monkeypatch.delenv(GPU_MEMORY_ENV, raising=False)
    assert cap_gpu_memory() is None
    assert parse_args(["--socket", "/tmp/s", "--gpu-memory-fraction", "0.5"]).gpu_memory_fraction == 0.5
    monkeypatch.setenv(GPU_MEMORY_ENV, "0.5")
    assert cap_gpu_memory() == 0.5
    with pytest.raises(SystemExit):
        parse_args(["--socket", "/tmp/s", "--gpu-memory-fraction", "1.5"])
