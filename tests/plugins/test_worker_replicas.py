"""A worker on several devices: one rank-0 worker process plus replica processes (Gloo on CPU).

Checks results, not speed: the gradients a 2-device worker exports are the mean over both ranks'
samples (each rank reading its own data stream), the replicas follow every parameter change, and
a replica that dies fails calls with a clear error instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from dedloc.plugins.tiny.workload import TINY
from dedloc.plugins.worker.replicas import parse_devices, replica_seed
from dedloc.rpc import ErrorCode, JsonRpcClient, RpcCallError

pytestmark = pytest.mark.asyncio(loop_scope="module")

SEED = 11
INIT_SEED = 5
CONFIG = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.1, "batch_size": 32}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(launch: Callable[..., Any]) -> AsyncIterator[tuple[Any, JsonRpcClient]]:
    process = launch()
    rpc = await process.connect()
    yield process, rpc
    await rpc.close()
    process.finish()


async def load(client: JsonRpcClient, device: str) -> dict[str, Any]:
    return await client.call("worker.load", {"workload": "tiny", "config": CONFIG, "seed": SEED,
                                             "init_seed": INIT_SEED, "device": device},
                             timeout=120.0)


async def served_by(client: JsonRpcClient) -> int:
    """The pid of the worker process that serves `client` (under a worker zygote, not the process
    the test started: plugins/worker/zygote.py)."""
    return int((await client.call("worker.hello"))["pid"])


def replicas_of(pid: int) -> list[int]:
    """The replica processes of worker `pid` (its children running multiprocessing's spawn)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:  # a thread may end between the listing and the read
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in children:
            with contextlib.suppress(FileNotFoundError):
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    return found


class ReferenceRanks:
    """Each rank's data stream, replayed here: the gradient the ranks should compute together."""

    def __init__(self, world: int) -> None:
        self.config = TINY.resolve_config(CONFIG)
        self.streams = [TINY.build_data(self.config, replica_seed(SEED, rank), "train")
                        for rank in range(world)]

    def gradient(self, params: np.ndarray, layout: list[dict[str, Any]], batches: int) -> np.ndarray:
        """Mean gradient at `params` over the next `batches` batches of every rank's stream."""
        model = TINY.build_model(self.config, torch.device("cpu"))
        flat = torch.from_numpy(params)
        with torch.no_grad():
            for slot, param in zip(layout, model.parameters(), strict=True):
                param.copy_(flat[slot["offset"]:slot["offset"] + slot["numel"]].view(slot["shape"]))
        total = len(self.streams) * batches * CONFIG["batch_size"]
        for stream in self.streams:
            for _ in range(batches):
                loss, size = TINY.loss(model, next(stream), torch.device("cpu"))
                (loss * size / total).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()


async def test_parse_devices() -> None:
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    assert parse_devices("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    for bad in ("cpu,,cpu", "auto,cpu", "cuda:all,cuda:0"):
        with pytest.raises(ValueError):
            parse_devices(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            parse_devices("cuda:all")
    assert replica_seed(SEED, 0) == SEED and replica_seed(SEED, 1) != SEED


async def test_two_ranks_export_the_mean_over_both_streams_and_follow_every_step(
        worker: tuple[Any, JsonRpcClient], buffers: Any) -> None:
    _, client = worker
    described = await load(client, "cpu,cpu")
    assert described["devices"] == ["cpu", "cpu"] and described["device"] == "cpu"
    assert len(replicas_of(await served_by(client))) == 1
    numel = described["total_numel"]
    layout = described["parameters"]
    name, array = buffers.make(numel)
    reference = ReferenceRanks(2)
    for round_number in range(3):
        await client.call("worker.export", {"what": "parameters", "buffer": name, "numel": numel})
        params = array.copy()
        # 128 samples: 64 per rank, two whole batches each.
        trained = await client.call("worker.train", {"samples": 128})
        assert trained["samples"] == 128, trained
        assert [rank["samples"] for rank in trained["ranks"]] == [64, 64]
        assert trained["accumulated_samples"] == 128
        assert trained["skipped_batches"] == 0  # all ranks' (none had a NaN)
        assert (await client.call("worker.describe"))["accumulated_samples"] == 128
        exported = await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
        assert exported["meta"]["accumulated_samples"] == 128
        # After a step, a replica still on the old parameters would give another gradient.
        expected = reference.gradient(params, layout, 2)
        np.testing.assert_allclose(array, expected, rtol=1e-4, atol=1e-6)
        grads = array.copy()
        applied = await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel})
        assert applied["step"] == round_number + 1
        await client.call("worker.export", {"what": "parameters", "buffer": name, "numel": numel})
        np.testing.assert_allclose(array, params - CONFIG["lr"] * grads, rtol=1e-5, atol=1e-6)


async def test_replicas_follow_applied_parameters(worker: tuple[Any, JsonRpcClient], buffers: Any) -> None:
    _, client = worker
    described = await load(client, "cpu,cpu")
    numel = described["total_numel"]
    name, array = buffers.make(numel)
    await client.call("worker.export", {"what": "parameters", "buffer": name, "numel": numel})
    shifted = array.copy() * 0.5 + 0.01
    array[:] = shifted
    await client.call("worker.apply", {"what": "parameters", "buffer": name, "numel": numel})
    # A fresh load restarts the streams: the gradient over both ranks' first batches, at the new
    # parameters, proves the replica computed with the parameters applied on rank 0.
    trained = await client.call("worker.train", {"samples": 64})
    assert [rank["samples"] for rank in trained["ranks"]] == [32, 32]
    await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
    expected = ReferenceRanks(2).gradient(shifted, described["parameters"], 1)
    np.testing.assert_allclose(array, expected, rtol=1e-4, atol=1e-6)
    # zero_grad clears the replica's sums as well.
    await client.call("worker.train", {"samples": 64})
    await client.call("worker.zero_grad")
    await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
    assert not array.any()


async def test_batches_every_rank_skipped_are_counted_and_give_no_samples(
        worker: tuple[Any, JsonRpcClient], buffers: Any) -> None:
    _, client = worker
    described = await load(client, "cpu,cpu")
    numel = described["total_numel"]
    name, array = buffers.make(numel)
    await client.call("worker.export", {"what": "parameters", "buffer": name, "numel": numel})
    good = array.copy()
    array[:] = 3e38  # finite parameters whose loss is not: every batch of every rank is skipped
    await client.call("worker.apply", {"what": "parameters", "buffer": name, "numel": numel})
    # (a time limit ends the call after its first batch on each rank: 8 in a row fail training)
    trained = await client.call("worker.train", {"samples": 128, "max_seconds": 1e-6})
    assert trained["samples"] == 0 and trained["loss"] == 0.0, trained
    assert [rank["samples"] for rank in trained["ranks"]] == [0, 0]
    assert trained["skipped_batches"] == 2, trained  # one on each rank (rank 0's alone said 1)
    assert trained["accumulated_samples"] == 0
    array[:] = good  # the model is usable again, and the count covers every call
    await client.call("worker.apply", {"what": "parameters", "buffer": name, "numel": numel})
    trained = await client.call("worker.train", {"samples": 64})
    assert trained["samples"] == 64 and trained["skipped_batches"] == 2, trained


async def test_reload_on_one_device_stops_the_replicas(worker: tuple[Any, JsonRpcClient]) -> None:
    _, client = worker
    await load(client, "cpu,cpu")
    assert len(replicas_of(await served_by(client))) == 1
    described = await load(client, "cpu")
    assert described["devices"] == ["cpu"]
    assert replicas_of(await served_by(client)) == []
    trained = await client.call("worker.train", {"samples": 64})
    assert trained["samples"] == 64 and "ranks" not in trained


async def test_a_dead_replica_fails_calls_clearly(worker: tuple[Any, JsonRpcClient]) -> None:
    _, client = worker
    await load(client, "cpu,cpu")
    (replica,) = replicas_of(await served_by(client))
    os.kill(replica, signal.SIGKILL)
    with pytest.raises(RpcCallError) as caught:
        await client.call("worker.train", {"samples": 64}, timeout=200.0)
    assert caught.value.code == ErrorCode.WORKLOAD_ERROR
    assert "replica on cpu exited" in caught.value.message and "restart" in caught.value.message
    with pytest.raises(RpcCallError) as again:
        await client.call("worker.train", {"samples": 64})
    assert "broken" in again.value.message
    # The worker itself still answers, and a new load works.
    assert (await load(client, "cpu"))["devices"] == ["cpu"]


async def test_bad_device_lists_are_refused(worker: tuple[Any, JsonRpcClient]) -> None:
    _, client = worker
    for bad in ("cpu,,cpu", "auto,cpu"):
        with pytest.raises(RpcCallError) as caught:
            await load(client, bad)
        assert caught.value.code == ErrorCode.INVALID_PARAMS and caught.value.data["param"] == "device"


async def test_replicas_rest_as_the_worker_does(launch: Callable[..., Any]) -> None:
    """`--duty-cycle`: every rank rests after its batches, and the speed is the sustained one."""
    process = launch("--duty-cycle", "0.5")
    rpc = await process.connect()
    try:
        await load(rpc, "cpu,cpu")
        trained = await rpc.call("worker.train", {"samples": 256}, timeout=120.0)
        assert trained["samples"] > 0 and trained["samples_per_second"] > 0
        assert len(trained["ranks"]) == 2
        assert all(rank["rested_seconds"] > 0 for rank in trained["ranks"]), trained["ranks"]
    finally:
        await rpc.close()
