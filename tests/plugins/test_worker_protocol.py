"""The worker protocol against one real `dedloc-worker` process running the built-in `tiny`."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from dedloc.plugins.tiny.workload import TINY
from dedloc.rpc import ErrorCode, JsonRpcClient, RpcCallError

pytestmark = pytest.mark.asyncio(loop_scope="module")

TINY_SEED = 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(launch: Callable[..., Any]) -> AsyncIterator[JsonRpcClient]:
    worker = launch()
    rpc = await worker.connect()
    yield rpc
    await rpc.call("worker.stop")
    await rpc.close()
    assert await worker.wait() == 0, worker.log()


async def load_tiny(client: JsonRpcClient, **config: Any) -> dict[str, Any]:
    return await client.call("worker.load", {"workload": "tiny", "config": config, "seed": TINY_SEED,
                                             "init_seed": 7, "device": "cpu"})


async def export(client: JsonRpcClient, buffers: Any, what: str, numel: int
                 ) -> tuple[np.ndarray, dict[str, Any]]:
    name, array = buffers.make(numel)
    answer = await client.call("worker.export", {"what": what, "buffer": name, "numel": numel})
    return array[:answer["numel"]].copy(), answer["meta"]


async def apply(client: JsonRpcClient, buffers: Any, what: str, values: np.ndarray,
                meta: dict[str, Any] | None = None) -> dict[str, Any]:
    name, array = buffers.make(len(values))
    array[:] = values
    return await client.call("worker.apply", {"what": what, "buffer": name, "numel": len(values),
                                              "meta": meta})


async def expect_error(code: ErrorCode, call: Any) -> RpcCallError:
    with pytest.raises(RpcCallError) as caught:
        await call
    assert caught.value.code == code, caught.value
    return caught.value


async def test_hello_and_discover(client: JsonRpcClient) -> None:
    hello = await client.call("worker.hello")
    assert hello["protocol"] == 1 and hello["implementation"] == "dedloc-worker"
    assert isinstance(hello["pid"], int) and hello["version"]
    document = await client.call("rpc.discover")
    names = {method["name"] for method in document["methods"]}
    assert {"worker.hello", "worker.load", "worker.describe", "worker.train", "worker.export",
            "worker.apply", "worker.zero_grad", "worker.checkpoint_save", "worker.checkpoint_load",
            "worker.evaluate", "worker.stop"} <= names


async def test_load_errors(client: JsonRpcClient) -> None:
    error = await expect_error(ErrorCode.UNKNOWN_WORKLOAD, client.call("worker.load", {"workload": "nope"}))
    assert "tiny" in error.data["installed"]
    error = await expect_error(ErrorCode.INVALID_WORKLOAD_CONFIG, load_tiny(client, hiden=3))
    assert error.data["key"] == "hiden"
    error = await expect_error(ErrorCode.INVALID_WORKLOAD_CONFIG, load_tiny(client, lr="fast"))
    assert error.data["key"] == "lr" and "number" in error.data["reason"]
    error = await expect_error(ErrorCode.INVALID_PARAMS, client.call(
        "worker.load", {"workload": "tiny", "device": "toaster"}))
    assert error.data["param"] == "device"
    await expect_error(ErrorCode.INVALID_PARAMS, client.call("worker.train", {"samples": 0}))


async def test_loss_drops_over_train_export_apply_rounds(client: JsonRpcClient, buffers: Any) -> None:
    described = await load_tiny(client)
    assert described["device"] == "cpu" and described["step"] == 0
    numel = described["total_numel"]
    assert numel == sum(p["numel"] for p in described["parameters"])
    name, _ = buffers.make(numel)
    losses = []
    for _ in range(20):
        trained = await client.call("worker.train", {"samples": 64})
        assert trained["samples"] == 64 and trained["accumulated_samples"] == 64
        losses.append(trained["loss"])
        exported = await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
        assert exported["meta"]["accumulated_samples"] == 64 and exported["dtype"] == "float32"
        applied = await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel})
        assert applied["lr"] == pytest.approx(0.01)
    assert applied["step"] == 20
    assert losses[0] == pytest.approx(math.log(4), abs=0.2)
    assert sum(losses[-3:]) / 3 < math.log(4) / 2
    described = await client.call("worker.describe")
    assert described["accumulated_samples"] == 0 and described["samples_per_second"] > 0
    assert described["state_numel"] == 3 * numel  # Adam: parameters, exp_avg, exp_avg_sq
    evaluated = await client.call("worker.evaluate", {"samples": 256})
    assert evaluated["samples"] == 256 and evaluated["metrics"]["accuracy"] > 0.8
    assert evaluated["loss"] < math.log(4) / 2
    assert (await client.call("worker.describe"))["accumulated_samples"] == 0


async def test_exported_gradients_are_the_mean_per_sample(client: JsonRpcClient, buffers: Any) -> None:
    described = await load_tiny(client)
    numel = described["total_numel"]
    params, _ = await export(client, buffers, "parameters", numel)
    assert (await client.call("worker.train", {"samples": 100}))["samples"] == 128  # whole batches
    grads, meta = await export(client, buffers, "gradients", numel)
    assert meta["accumulated_samples"] == 128
    # The same computation here, from the exported parameters and the same data stream.
    config = TINY.resolve_config({})
    model = TINY.build_model(config, torch.device("cpu"))
    flat = torch.from_numpy(params)
    for slot, param in zip(described["parameters"], model.parameters(), strict=True):
        with torch.no_grad():
            param.copy_(flat[slot["offset"]:slot["offset"] + slot["numel"]].view(slot["shape"]))
    data = TINY.build_data(config, TINY_SEED, "train")
    for _ in range(2):
        loss, size = TINY.loss(model, next(data), torch.device("cpu"))
        (loss * size / 128).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(grads, expected, rtol=1e-4, atol=1e-6)
    assert (await client.call("worker.zero_grad")) == {"accumulated_samples": 0}
    zeros, meta = await export(client, buffers, "gradients", numel)
    assert meta["accumulated_samples"] == 0 and not zeros.any()


async def test_describe_answers_while_training_and_a_second_train_is_refused(client: JsonRpcClient) -> None:
    await load_tiny(client)
    training = asyncio.ensure_future(client.call("worker.train", {"samples": 10**9, "max_seconds": 1.0}))
    async with asyncio.timeout(10):
        while (await client.call("worker.describe"))["running"] != "worker.train":  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # the worker's state is only visible by asking
    error = await expect_error(ErrorCode.RUN_NOT_ACTIVE, client.call("worker.train", {"samples": 1}))
    assert error.data == {"busy": "worker.train"}
    done = await training
    assert done["samples"] >= 64 and done["accumulated_samples"] == done["samples"]
    assert (await client.call("worker.describe"))["running"] is None


async def test_parameters_round_trip(client: JsonRpcClient, buffers: Any) -> None:
    numel = (await load_tiny(client))["total_numel"]
    original, meta = await export(client, buffers, "parameters", numel)
    assert meta == {"step": 0}
    assert (await apply(client, buffers, "parameters", original + 1, {"step": 5})) == {"step": 5}
    shifted, meta = await export(client, buffers, "parameters", numel)
    np.testing.assert_array_equal(shifted, original + 1)
    assert meta == {"step": 5}
    await apply(client, buffers, "parameters", original)
    again, _ = await export(client, buffers, "parameters", numel)
    np.testing.assert_array_equal(again, original)


async def test_state_round_trip(client: JsonRpcClient, buffers: Any) -> None:
    described = await load_tiny(client, warmup_steps=10)
    numel = described["total_numel"]
    grad_buffer, _ = buffers.make(numel)
    for _ in range(3):
        await client.call("worker.train", {"samples": 64})
        await client.call("worker.export", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
        await client.call("worker.apply", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
    state_numel = (await client.call("worker.describe"))["state_numel"]
    saved, meta = await export(client, buffers, "state", state_numel + 10)  # capacity may be larger
    assert len(saved) == state_numel == 3 * numel and meta["step"] == 3
    assert [entry["key"] for entry in meta["layout"]["optimizer"][:2]] == ["exp_avg", "exp_avg_sq"]
    await client.call("worker.train", {"samples": 64})
    await client.call("worker.export", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
    stepped = await client.call("worker.apply", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
    assert stepped["step"] == 4
    assert (await apply(client, buffers, "state", saved, meta)) == {"step": 3}
    restored, restored_meta = await export(client, buffers, "state", state_numel)
    np.testing.assert_array_equal(restored, saved)
    assert restored_meta == meta
    # The learning-rate warm-up resumes where the state was taken.
    await client.call("worker.train", {"samples": 64})
    await client.call("worker.export", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
    again = await client.call("worker.apply", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
    assert again == stepped


async def test_bad_buffers_change_nothing(client: JsonRpcClient, buffers: Any) -> None:
    numel = (await load_tiny(client))["total_numel"]
    await client.call("worker.train", {"samples": 64})
    before, _ = await export(client, buffers, "parameters", numel)
    small, _ = buffers.make(numel - 1)
    error = await expect_error(ErrorCode.BUFFER_ERROR, client.call(
        "worker.export", {"what": "parameters", "buffer": small, "numel": numel - 1}))
    assert error.data["needed"] == numel and error.data["given"] == numel - 1
    error = await expect_error(ErrorCode.BUFFER_ERROR, client.call(
        "worker.export", {"what": "parameters", "buffer": small, "numel": numel}))
    assert "fewer than numel" in error.message
    await expect_error(ErrorCode.BUFFER_ERROR, apply(client, buffers, "parameters", np.zeros(numel + 1)))
    await expect_error(ErrorCode.BUFFER_ERROR, client.call(
        "worker.export", {"what": "parameters", "buffer": "dedloc-no-such-buffer", "numel": numel}))
    await expect_error(ErrorCode.BUFFER_ERROR, client.call(
        "worker.export", {"what": "parameters", "buffer": "../etc/passwd", "numel": numel}))
    poisoned = before.copy()
    poisoned[numel // 2] = np.nan
    for what in ("parameters", "gradients"):
        error = await expect_error(ErrorCode.BUFFER_ERROR, apply(client, buffers, what, poisoned))
        assert error.data["non_finite"] == 1
    poisoned[numel // 2] = np.inf
    await expect_error(ErrorCode.BUFFER_ERROR, apply(client, buffers, "parameters", poisoned))
    after, _ = await export(client, buffers, "parameters", numel)
    np.testing.assert_array_equal(after, before)
    described = await client.call("worker.describe")
    assert described["step"] == 0 and described["accumulated_samples"] == 64
    state, meta = await export(client, buffers, "state", described["state_numel"])
    meta["layout"]["parameters"][0]["shape"] = [1, meta["layout"]["parameters"][0]["numel"]]
    await expect_error(ErrorCode.BUFFER_ERROR, apply(client, buffers, "state", state, meta))
    await expect_error(ErrorCode.BUFFER_ERROR, apply(client, buffers, "state", state))  # no meta


async def test_non_finite_loss_is_a_workload_error(client: JsonRpcClient, buffers: Any) -> None:
    numel = (await load_tiny(client))["total_numel"]
    await apply(client, buffers, "parameters", np.full(numel, 3e38, dtype=np.float32))
    error = await expect_error(ErrorCode.WORKLOAD_ERROR, client.call("worker.train", {"samples": 64}))
    assert "gradients were discarded" in error.message
    assert (await client.call("worker.describe"))["accumulated_samples"] == 0


async def test_checkpoint_round_trip(client: JsonRpcClient, buffers: Any,
                                     launch: Callable[..., Any], tmp_path: Path) -> None:
    numel = (await load_tiny(client, hidden=32))["total_numel"]
    grad_buffer, _ = buffers.make(numel)
    for _ in range(2):
        await client.call("worker.train", {"samples": 64})
        await client.call("worker.export", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
        await client.call("worker.apply", {"what": "gradients", "buffer": grad_buffer, "numel": numel})
    path = tmp_path / "tiny.ckpt"
    saved = await client.call("worker.checkpoint_save", {"path": str(path)})
    assert saved == {"path": str(path), "bytes": path.stat().st_size, "step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.ckpt"]  # no temporary file left
    params, _ = await export(client, buffers, "parameters", numel)
    state_numel = (await client.call("worker.describe"))["state_numel"]
    state, _ = await export(client, buffers, "state", state_numel)

    fresh_worker = launch()
    fresh = await fresh_worker.connect()
    try:
        await fresh.call("worker.load", {"workload": "tiny", "config": {"hidden": 32}, "seed": 9})
        assert await fresh.call("worker.checkpoint_load", {"path": str(path)}) == {"step": 2}
        np.testing.assert_array_equal((await export(fresh, buffers, "parameters", numel))[0], params)
        np.testing.assert_array_equal((await export(fresh, buffers, "state", state_numel))[0], state)
        await fresh.call("worker.load", {"workload": "tiny", "config": {"hidden": 16}})
        error = await expect_error(ErrorCode.CHECKPOINT_ERROR, fresh.call(
            "worker.checkpoint_load", {"path": str(path)}))
        assert "hidden" in error.message
        await expect_error(ErrorCode.CHECKPOINT_ERROR, fresh.call(
            "worker.checkpoint_load", {"path": str(tmp_path / "missing.ckpt")}))
        (tmp_path / "corrupt.ckpt").write_bytes(path.read_bytes()[:100])
        await expect_error(ErrorCode.CHECKPOINT_ERROR, fresh.call(
            "worker.checkpoint_load", {"path": str(tmp_path / "corrupt.ckpt")}))
        await expect_error(ErrorCode.CHECKPOINT_ERROR, fresh.call(
            "worker.checkpoint_save", {"path": str(tmp_path / "no-such-dir" / "x.ckpt")}))
    finally:
        await fresh.close()
    assert await fresh_worker.wait() == 0, fresh_worker.log()  # its connection closed: it exits 0

