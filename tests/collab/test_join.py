"""Joining a run by its name: the manifest comes from the DHT; a newcomer downloads the state,
follows the run's learning-rate schedule and contributes. Another manifest under the same name is
another run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import join_by_name, p2p_address, wait_until

from dedloc.rpc import ErrorCode, RpcCallError

# A warmup far longer than the test runs: the learning rate stays on its ramp (epoch-dependent).
LR, WARMUP = 0.01, 10_000_000
PARAMS = {"workload": "tiny", "name": "open", "target_batch_size": 128, "collaborative": True,
          "min_peers": 2, "config": {"warmup_steps": WARMUP, "lr": LR}, "checkpoint_every": 0}


async def _status(daemon: Any) -> dict[str, Any]:
    (status,) = await daemon.call("run.status", {"name": "open"})
    return status


async def test_a_newcomer_joins_by_name_downloads_and_contributes(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    second = await daemon_factory("--net.bootstrap", address)
    await asyncio.gather(first.call("run.start", PARAMS), second.call("run.start", PARAMS))

    async def at_epoch(daemon: Any, n: int) -> dict[str, Any] | None:
        status = await _status(daemon)
        assert status["state"] == "running", status
        return status if status["epoch"] >= n else None

    await wait_until(lambda: at_epoch(first, 3), timeout=120)
    late = await daemon_factory("--net.bootstrap", address)

    async def late_joined_the_dht() -> bool:
        return bool((await late.call("node.info"))["dht"]["joined"])

    await wait_until(late_joined_the_dht, timeout=60)
    with pytest.raises(RpcCallError) as refused:  # a name nobody publishes
        await late.call("run.start", {"name": "no-such-run"})
    assert "no peer publishes" in refused.value.message

    async def join() -> dict[str, Any] | None:
        try:
            return await late.call("run.start", {"name": "open"})  # no workload: join by name
        except RpcCallError as exc:
            if "no peer publishes" in exc.message:
                return None
            raise

    joined = await wait_until(join, timeout=60)
    reference = await _status(first)
    assert joined["fingerprint"] == reference["fingerprint"]
    assert joined["manifest"] == reference["manifest"]

    async def contributing() -> dict[str, Any] | None:
        status = await _status(late)
        last = status["last_round"]
        return status if last and last["senders"] == 3 and status["lr"] is not None else None

    status = await wait_until(contributing, timeout=120)
    assert status["state_downloads"] >= 1 and status["epoch"] > 3
    # Its learning rate is the schedule's at the run's epoch, not at its own few steps.
    assert status["lr"] == pytest.approx(LR * status["epoch"] / WARMUP, rel=1e-6)


async def test_a_newcomer_to_a_finished_run_downloads_its_final_state(daemon_factory: Any) -> None:
    """The trainers finished and stopped their workers; a peer that joins the run later (as one
    restarted from an old checkpoint does) still finds its final state: each finished trainer
    serves it from a file and reports the final head (final_state.py). Before, nobody was left
    to download from and the late peer waited for trainers forever."""
    import torch

    first = await daemon_factory()
    address = await p2p_address(first)
    second = await daemon_factory("--net.bootstrap", address)
    run = {**PARAMS, "name": "done", "epochs": 3, "checkpoint_every": 1}
    await asyncio.gather(first.call("run.start", run), second.call("run.start", run))

    async def serving(daemon: Any) -> dict[str, Any] | None:
        (status,) = await daemon.call("run.status", {"name": "done"})
        assert status["state"] in ("running", "finished"), status
        return status if status["final_state_served_until"] is not None \
            and status["worker"]["state"] == "exited" else None

    done = [await wait_until(lambda d=d: serving(d), timeout=180) for d in (first, second)]
    late = await daemon_factory("--net.bootstrap", address)
    await join_by_name(late, "done")

    async def finished() -> dict[str, Any] | None:
        (status,) = await late.call("run.status", {"name": "done"})
        assert status["state"] in ("running", "finished"), status
        return status if status["state"] == "finished" else None

    status = await wait_until(finished, timeout=120)
    assert status["epoch"] == 3 and status["state_downloads"] >= 1, status
    served = [(await d.call("run.status", {"name": "done"}))[0]["states_served"]
              for d in (first, second)]
    assert sum(served) >= 1, served

    def final_model(daemon: Any, status: dict[str, Any]) -> dict[str, Any]:
        path = (daemon.root / "state" / "runs" / "done" / status["fingerprint"]
                / "checkpoint-000000003.pt")
        return torch.load(path, weights_only=False)["model"]

    reference = final_model(first, done[0])
    for daemon, daemon_status in ((second, done[1]), (late, status)):
        for name, tensor in final_model(daemon, daemon_status).items():
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)

    # a stop ends the serving: the report is a farewell, the file gone
    stopped = await first.call("run.stop", {"name": "done"})
    assert stopped["final_state_served_until"] is None, stopped
    run_dir = first.root / "state" / "runs" / "done" / done[0]["fingerprint"]
    assert not (run_dir / "final-state.f32").exists()
    assert list(run_dir.glob("checkpoint-*.pt"))  # (the checkpoints stay)

    # started again (as a restarted daemon's autojoin starts it), it loads its last checkpoint,
    # finds the run finished and serves the final state again
    await first.call("run.start", run)
    again = await wait_until(lambda: serving(first), timeout=180)
    assert again["epoch"] == 3 and (run_dir / "final-state.f32").exists(), again


async def test_another_manifest_under_the_same_name_is_another_run(daemon_factory: Any) -> None:
    first = await daemon_factory()
    address = await p2p_address(first)
    other = await daemon_factory("--net.bootstrap", address)
    started = await first.call("run.start", {**PARAMS, "min_peers": 1})

    async def published() -> dict[str, Any] | None:
        status = await other.call("run.start", {**PARAMS, "min_peers": 1, "target_batch_size": 64})
        if status["other_manifests"]:
            return status
        await other.call("run.stop", {"name": "open"})
        return None

    mine = await wait_until(published, timeout=60)
    assert mine["fingerprint"] != started["fingerprint"]
    assert [m["fingerprint"] for m in mine["other_manifests"]] == [started["fingerprint"]]

    async def stepped(daemon: Any) -> dict[str, Any] | None:
        status = await _status(daemon)
        return status if status["epoch"] >= 3 else None

    for daemon in (first, other):
        status = await wait_until(lambda d=daemon: stepped(d), timeout=120)
        assert status["last_round"]["group_size"] == 1  # they never average together
        assert status["run_peers"] == 1


def _texts() -> list[str]:
    """English sentences from a few standard-library docstrings (no network, no big corpus)."""
    import argparse
    import json
    import pathlib
    import textwrap

    docs = [module.__doc__ or "" for module in (argparse, json, pathlib, textwrap)]
    docs += [obj.__doc__ or "" for module in (argparse, json, pathlib) for obj in vars(module).values()
             if callable(obj)]
    return [doc for doc in docs if len(doc) > 40]


async def test_a_peer_with_another_tokenizer_is_refused(daemon_factory: Any, tmp_path: Any) -> None:
    """albert's vocabulary is not in the config: the run's manifest carries its fingerprint, and a
    joiner whose tokenizer file (at the same tokenizer_path) differs gets a clear MANIFEST_ERROR."""
    from dedloc.plugins.albert.tokenizer import train_tokenizer

    texts = _texts()
    data = tmp_path / "data"
    data.mkdir()
    for index in range(0, len(texts), 10):
        (data / f"doc{index}.txt").write_text("\n\n".join(texts[index:index + 10]))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(train_tokenizer(iter(texts), 400).to_str())
    config = {"preset": "albert-tiny", "batch_size": 4, "max_seq_length": 32, "data_dir": str(data),
              "tokenizer_path": str(tokenizer), "cache_dir": str(tmp_path / "cache")}
    first = await daemon_factory("--workers.threads", "1")
    address = await p2p_address(first)
    started = await first.call("run.start", {"workload": "albert", "name": "tok", "config": config,
                                             "collaborative": True, "target_batch_size": 64,
                                             "checkpoint_every": 0})
    assert started["manifest"]["task"].startswith("vocab-")
    tokenizer.write_text(train_tokenizer(iter(texts), 300).to_str())  # this machine's file differs
    late = await daemon_factory("--net.bootstrap", address, "--workers.threads", "1")

    async def refused() -> RpcCallError | None:
        try:
            await late.call("run.start", {"name": "tok"})
        except RpcCallError as exc:
            waiting = ("no peer publishes" in exc.message or "not joined the network" in exc.message)
            return None if waiting else exc
        raise AssertionError("a peer with another tokenizer joined the run")

    error = await wait_until(refused, timeout=90)
    assert error.code == ErrorCode.MANIFEST_ERROR, error
    assert "tokenizer" in error.message and error.data["run_task"] == started["manifest"]["task"]
    assert error.data["task"].startswith("vocab-") and error.data["task"] != error.data["run_task"]
    with pytest.raises(RpcCallError, match="no run named"):  # nothing was left half-started
        await late.call("run.status", {"name": "tok"})
