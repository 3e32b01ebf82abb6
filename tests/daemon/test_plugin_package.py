"""A workload from a separately installed package (tests/example_plugin) is listed and runs."""

from __future__ import annotations

from importlib.metadata import distribution

from support import wait_until


async def test_third_party_workload_is_listed_and_trains(daemon) -> None:  # type: ignore[no-untyped-def]
    assert distribution("dedloc-example-workload")  # installed by `make test`
    listing = await daemon.call("workloads.list", {"refresh": True})
    names = {w["name"]: w for w in listing["workloads"]}
    assert {"tiny", "example-linear"} <= set(names)
    assert "dedloc-example-workload" in names["example-linear"]["plugin"]
    await daemon.call("run.start", {"workload": "example-linear", "target_batch_size": 64})

    async def trained() -> dict | None:
        (status,) = await daemon.call("run.status")
        assert status["state"] == "running", status
        return status if status["epoch"] >= 8 else None

    status = await wait_until(trained)
    assert status["epoch_losses"][-1] < status["epoch_losses"][0]
    await daemon.call("run.stop")
