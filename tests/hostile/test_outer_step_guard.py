"""A local-update run with a peer that sends pseudo-gradients 300 times too large (below the
screening's norm rule of 1000, so nobody rejects them): the outer-step guard scales every outer
step down to at most 4 times the running norm of the steps before it, the same on every trainer.
The attacker is a real daemon made to misbehave below its API (DEDLOC_TEST_CORRUPT_PARTS)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from reference_trainer import full_config
from support import swarm_with_odd_one, wait_until

from dedloc.plugins.tiny.workload import TINY

EPOCHS = 6
PARAMS = {"workload": "tiny", "name": "pushed", "target_batch_size": 64, "epochs": EPOCHS,
          "collaborative": True, "min_peers": 4, "average_state_every": 0, "checkpoint_every": 1,
          "config": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "batch_size": 16},
          "sync": "local", "inner_steps": 2,  # outer_clip: the default, 4
          # the inner steps at the full lr 0.1: the pushed first outer step then always passes
          # the guard's first bound (a tenth of the parameters' norm); with "auto" (0.025) it
          # did not always, the running norm grew with the push, and no step stood out
          "inner_lr_scale": 1}


async def test_a_pushing_peer_moves_the_outer_parameters_no_further_than_the_guard_allows(
        daemon_factory: Any) -> None:
    daemons = await swarm_with_odd_one(daemon_factory, (), "pusher", {
        "DEDLOC_TESTING": "1", "DEDLOC_TEST_CORRUPT_PARTS": "scale=300"})
    honest = daemons[:3]
    await asyncio.gather(*(d.call("run.start", PARAMS) for d in daemons))

    async def finished() -> list[dict[str, Any]] | None:
        statuses = [(await d.call("run.status", {"name": "pushed"}))[0] for d in honest]
        for status in statuses:
            assert status["state"] in ("running", "finished"), status
        return statuses if all(s["state"] == "finished" for s in statuses) else None

    statuses = await wait_until(finished, timeout=300)
    final = []
    for daemon, status in zip(honest, statuses, strict=True):
        assert status["sync"]["clipped_steps"] >= 1, status["sync"]  # the guard bit
        path = (daemon.root / "state" / "runs" / "pushed" / status["fingerprint"]
                / f"checkpoint-{EPOCHS:09d}.pt")
        final.append(torch.load(path, weights_only=False)["outer"]["parameters"])
    for outer in final[1:]:  # the same factor on every trainer: one outer state
        torch.testing.assert_close(outer, final[0], rtol=0, atol=1e-6)
    assert bool(torch.isfinite(final[0]).all())
    # the guard: each averaged pseudo-gradient at most 4x the running mean of those before it
    # (so the mean grows by at most 1.3x a step), the first at most a tenth of the parameters'
    # norm; then the outer optimizer (lr 0.7, Nesterov 0.9) moves the parameters by at most
    # lr * (|delta| + 0.9 * |momentum|) a step
    config = full_config(PARAMS["config"])
    torch.manual_seed(0)  # the manifest's init_seed
    model = TINY.build_model(config, torch.device("cpu"))
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    delta = mean = 0.1 * float(initial.norm())
    momentum = total = 0.0
    for step in range(EPOCHS):
        if step:
            delta = 4 * mean
            mean = 0.9 * mean + 0.1 * delta
        momentum = 0.9 * momentum + delta
        total += 0.7 * (delta + 0.9 * momentum)
    moved = float((final[0] - initial).norm())
    assert moved <= total * 1.001, (moved, total)
