"""With millisecond steps and min_peers = 4, four trainers started together take part in every
epoch's round from the first: nobody trains alone while the others are alive, no epoch is skipped."""

from __future__ import annotations

import asyncio
from typing import Any

from support import start_swarm, wait_until

PEERS = 4
EPOCHS = 8


async def test_four_fast_trainers_are_in_every_round_from_the_first(daemon_factory: Any) -> None:
    daemons = await start_swarm(daemon_factory, PEERS)
    # A batch of 8 points through a 16-wide MLP: about a millisecond per step, no sleeping.
    params = {"workload": "tiny", "name": "fast", "config": {"batch_size": 8, "hidden": 16},
              "target_batch_size": 64, "epochs": EPOCHS, "collaborative": True, "min_peers": PEERS,
              "checkpoint_every": 0}
    await asyncio.gather(*(d.call("run.start", params) for d in daemons))

    async def finished() -> list[dict[str, Any]] | None:
        statuses = [(await d.call("run.status", {"name": "fast"}))[0] for d in daemons]
        for status in statuses:
            assert status["state"] in ("running", "finished"), status
        return statuses if all(s["state"] == "finished" for s in statuses) else None

    statuses = await wait_until(finished, timeout=240)
    for status in statuses:
        history = [e for e in status["epoch_history"] if e["stepped"]]
        # Every epoch from the first, each in a round of all four trainers, none from a download.
        assert [e["epoch"] for e in history] == list(range(EPOCHS)), status["epoch_history"]
        assert {e["trainers"] for e in history} == {PEERS}, history
        assert status["state_downloads"] == 0
        assert status["run_epoch_overhead_seconds"] is None or status["run_epoch_overhead_seconds"] >= 0
        assert all(e["overhead_seconds"] >= 0 for e in history)
