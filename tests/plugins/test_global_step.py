"""`worker.apply` of gradients at the run's global step: `meta.step` positions the LR schedule.

The protocol tests drive real `dedloc-worker` processes running `tiny` with plain SGD (no
momentum, no weight decay) and all-ones gradients, so every parameter moves by exactly the
learning rate the step used; the schedule is tiny's linear warm-up (LambdaLR). The unit tests
check `position_scheduler` against stepping each of torch's schedulers one step at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from torch.optim import lr_scheduler

from dedloc.plugins.worker.scheduler_position import position_scheduler, scheduler_start
from dedloc.rpc import ErrorCode, JsonRpcClient, RpcCallError

LR = 0.01
WARMUP = 20


def warmup_lr(step: int) -> float:
    """tiny's schedule: the learning rate of global step `step` (counted from 0)."""
    return LR * min(1.0, (step + 1) / WARMUP)


# --- protocol ---------------------------------------------------------------------------------------

Clients = tuple[JsonRpcClient, JsonRpcClient]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(launch: Callable[..., Any]) -> AsyncIterator[Clients]:
    workers = [launch(), launch()]
    rpcs = [await worker.connect() for worker in workers]
    yield rpcs[0], rpcs[1]
    for worker, rpc in zip(workers, rpcs, strict=True):
        await rpc.call("worker.stop")
        await rpc.close()
        assert await worker.wait() == 0, worker.log()


async def load(client: JsonRpcClient, warmup_steps: int = WARMUP) -> int:
    described = await client.call("worker.load", {
        "workload": "tiny", "seed": 1, "init_seed": 7, "device": "cpu",
        "config": {"optimizer": "sgd", "momentum": 0.0, "lr": LR, "warmup_steps": warmup_steps}})
    assert described["step"] == 0
    return int(described["total_numel"])


async def parameters(client: JsonRpcClient, buffers: Any, numel: int) -> np.ndarray:
    name, array = buffers.make(numel)
    await client.call("worker.export", {"what": "parameters", "buffer": name, "numel": numel})
    return array.copy()


async def step(client: JsonRpcClient, buffers: Any, numel: int, meta: Any = None,
               **params: Any) -> tuple[dict[str, Any], float]:
    """Apply all-ones gradients; the answer and how far the parameters moved (the lr used)."""
    before = await parameters(client, buffers, numel)
    name, _ = buffers.make(numel, fill=1.0)
    answer = await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel,
                                                "meta": meta, **params})
    moved = before - await parameters(client, buffers, numel)
    np.testing.assert_allclose(moved, moved[0], rtol=1e-3, atol=1e-7)  # one lr for every parameter
    return answer, float(moved.mean())


@pytest.mark.asyncio(loop_scope="module")
async def test_a_fresh_worker_steps_at_the_global_step(clients: Clients, buffers: Any) -> None:
    client, _ = clients
    numel = await load(client)
    answer, moved = await step(client, buffers, numel, {"step": 7})
    assert answer == {"step": 8, "lr": pytest.approx(warmup_lr(7), rel=1e-12)}
    assert answer["lr"] == pytest.approx(LR * 8 / 20, rel=1e-12)
    assert moved == pytest.approx(warmup_lr(7), rel=1e-3)
    assert (await client.call("worker.describe"))["step"] == 8
    answer, moved = await step(client, buffers, numel, {"step": 8})
    assert answer == {"step": 9, "lr": pytest.approx(warmup_lr(8), rel=1e-12)}
    assert moved == pytest.approx(warmup_lr(8), rel=1e-3)
    # Without meta.step the worker goes on from its own count, now the global one.
    answer, moved = await step(client, buffers, numel)
    assert answer == {"step": 10, "lr": pytest.approx(warmup_lr(9), rel=1e-12)}
    assert moved == pytest.approx(warmup_lr(9), rel=1e-3)
    # A worker ahead of the run (e.g. its own count ran on) is moved back, schedule included.
    answer, moved = await step(client, buffers, numel, {"step": 2})
    assert answer == {"step": 3, "lr": pytest.approx(warmup_lr(2), rel=1e-12)}
    assert moved == pytest.approx(warmup_lr(2), rel=1e-3)
    # Past the warm-up, the schedule's value is the plain lr.
    answer, _ = await step(client, buffers, numel, {"step": 1000})
    assert answer == {"step": 1001, "lr": pytest.approx(LR, rel=1e-12)}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_peer_that_jumps_uses_the_same_lr_as_one_that_stepped(clients: Clients,
                                                                        buffers: Any) -> None:
    steady, late = clients
    numel = await load(steady)
    assert await load(late) == numel
    used: list[float] = []
    donor_state: tuple[np.ndarray, dict[str, Any]] | None = None
    for expected in range(10):
        if expected == 5:  # the donor's state at step 5, as a late joiner would download it
            state_numel = (await steady.call("worker.describe"))["state_numel"]
            name, array = buffers.make(state_numel)
            exported = await steady.call("worker.export", {"what": "state", "buffer": name,
                                                           "numel": state_numel})
            donor_state = (array[:exported["numel"]].copy(), exported["meta"])
        answer, _ = await step(steady, buffers, numel, {"step": expected} if expected % 2 else None)
        assert answer["step"] == expected + 1
        used.append(answer["lr"])
    assert used == pytest.approx([warmup_lr(s) for s in range(10)], rel=1e-12)

    assert donor_state is not None
    values, meta = donor_state
    assert meta["step"] == 5
    name, array = buffers.make(len(values))
    array[:] = values
    assert await late.call("worker.apply", {"what": "state", "buffer": name, "numel": len(values),
                                            "meta": meta}) == {"step": 5}
    # Its averaging rounds for steps 5 to 8 failed: it steps next at the run's step 9.
    answer, moved = await step(late, buffers, numel, {"step": 9})
    assert answer == {"step": 10, "lr": used[9]}
    assert moved == pytest.approx(used[9], rel=1e-3)
    answer, _ = await step(late, buffers, numel, {"step": 10})
    assert answer == {"step": 11, "lr": pytest.approx(warmup_lr(10), rel=1e-12)}


@pytest.mark.asyncio(loop_scope="module")
async def test_without_meta_step_the_own_count_drives_the_schedule(clients: Clients,
                                                                     buffers: Any) -> None:
    client, _ = clients
    numel = await load(client)
    for expected, meta in enumerate([None, {}, {"accumulated_samples": 64}, None]):
        answer, moved = await step(client, buffers, numel, meta)
        assert answer == {"step": expected + 1, "lr": pytest.approx(warmup_lr(expected), rel=1e-12)}
        assert moved == pytest.approx(warmup_lr(expected), rel=1e-3)
    # The meta of worker.export of gradients carries the worker's own step: passing it back
    # unchanged is a step at the own count.
    name, _ = buffers.make(numel)
    exported = await client.call("worker.export", {"what": "gradients", "buffer": name, "numel": numel})
    assert exported["meta"]["step"] == 4
    answer, _ = await step(client, buffers, numel, exported["meta"])
    assert answer == {"step": 5, "lr": pytest.approx(warmup_lr(4), rel=1e-12)}
    # No schedule: the lr is the optimizer's, whatever meta.step says.
    numel = await load(client, warmup_steps=0)
    answer, moved = await step(client, buffers, numel)
    assert answer == {"step": 1, "lr": LR}
    answer, moved = await step(client, buffers, numel, {"step": 41})
    assert answer == {"step": 42, "lr": LR}
    assert moved == pytest.approx(LR, rel=1e-3)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("bad", [True, False, -1, 1.5, 3.0, "3", None, [3], {"step": 3}])
async def test_a_bad_meta_step_is_refused_and_changes_nothing(clients: Clients, buffers: Any,
                                                              bad: Any) -> None:
    client, _ = clients
    numel = await load(client)
    await step(client, buffers, numel, {"step": 3})
    await client.call("worker.train", {"samples": 64})
    before = await parameters(client, buffers, numel)
    described = await client.call("worker.describe")
    name, _ = buffers.make(numel, fill=1.0)
    with pytest.raises(RpcCallError) as caught:
        await client.call("worker.apply", {"what": "gradients", "buffer": name, "numel": numel,
                                           "meta": {"step": bad}})
    assert caught.value.code == ErrorCode.BUFFER_ERROR
    assert "meta.step must be a non-negative integer" in caught.value.message
    assert caught.value.data["key"] == "meta.step"
    np.testing.assert_array_equal(await parameters(client, buffers, numel), before)
    after = await client.call("worker.describe")
    assert after["step"] == described["step"] == 4
    assert after["accumulated_samples"] == described["accumulated_samples"] == 64
    # The schedule did not move either: the next step is step 4 at step 4's lr.
    answer, _ = await step(client, buffers, numel)
    assert answer == {"step": 5, "lr": pytest.approx(warmup_lr(4), rel=1e-12)}


# --- position_scheduler against torch's schedulers ------------------------------------------------

def _optimizer() -> torch.optim.Optimizer:
    weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.SGD([{"params": [weights[0]], "lr": 0.1},
                            {"params": [weights[1]], "lr": 0.05}], momentum=0.9)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]] = {
    "step": lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "multistep": lambda o: lr_scheduler.MultiStepLR(o, milestones=[2, 5, 9], gamma=0.3),
    "constant": lambda o: lr_scheduler.ConstantLR(o, factor=0.25, total_iters=4),
    "linear": lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=6),
    "exponential": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "polynomial": lambda o: lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    "cosine": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=0.001),
    "lambda": lambda o: lr_scheduler.LambdaLR(o, [lambda s: 1 / (s + 1), lambda s: min(1.0, (s + 1) / 4)]),
    "multiplicative": lambda o: lr_scheduler.MultiplicativeLR(o, lambda s: 0.9 if s % 2 else 0.95),
    "onecycle": lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.2, 0.1], total_steps=40),
    "cyclic": lambda o: lr_scheduler.CyclicLR(o, base_lr=0.001, max_lr=[0.1, 0.2], step_size_up=4),
    "warm_restarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2),
    "sequential": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            lr_scheduler.ExponentialLR(o, gamma=0.9)], milestones=[3]),
    "chained": lambda o: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3), lr_scheduler.ExponentialLR(o, gamma=0.9)],
        o),
}


def _lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def _stepped_one_by_one(make: Callable[..., lr_scheduler.LRScheduler], steps: int) -> list[list[float]]:
    """The learning rates each step 0..steps-1 uses when the scheduler steps after every step."""
    optimizer = _optimizer()
    scheduler = make(optimizer)
    used = []
    for _ in range(steps):
        used.append(_lrs(optimizer))
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_position_scheduler_matches_stepping_one_by_one(name: str) -> None:
    make = SCHEDULERS[name]
    reference = _stepped_one_by_one(make, 30)
    optimizer = _optimizer()
    scheduler = make(optimizer)
    start = scheduler_start(optimizer, scheduler)
    for target in [7, 3, 12, 12, 0, 20, 19, 28]:  # forward, back, in place, to the start
        position_scheduler(scheduler, target, start)
        assert _lrs(optimizer) == pytest.approx(reference[target], rel=1e-9), target
        counter = scheduler._schedulers[0] if name == "chained" else scheduler  # type: ignore[attr-defined]
        assert counter.last_epoch == target
        optimizer.step()
        scheduler.step()
        assert _lrs(optimizer) == pytest.approx(reference[target + 1], rel=1e-9), target


def test_a_scheduler_without_a_start_copy_is_not_rewound() -> None:
    optimizer = _optimizer()
    scheduler = SCHEDULERS["sequential"](optimizer)
    position_scheduler(scheduler, 6)  # forward needs no start copy
    at_six = _lrs(optimizer)
    assert at_six == pytest.approx(_stepped_one_by_one(SCHEDULERS["sequential"], 7)[6], rel=1e-9)
    position_scheduler(scheduler, 2)  # it cannot go back: the lr stays, with a warning logged
    assert _lrs(optimizer) == at_six


def test_reduce_on_plateau_is_left_alone() -> None:
    optimizer = _optimizer()
    scheduler = lr_scheduler.ReduceLROnPlateau(optimizer)
    position_scheduler(scheduler, 9, scheduler_start(optimizer, scheduler))
    assert _lrs(optimizer) == [0.1, 0.05]


def test_the_position_error_of_an_exhausted_schedule_leaves_it_as_it_was() -> None:
    optimizer = _optimizer()
    scheduler = SCHEDULERS["onecycle"](optimizer)
    before = _lrs(optimizer)
    with pytest.raises(ValueError, match="total steps"):
        position_scheduler(scheduler, 41)
    assert scheduler.last_epoch == 0 and _lrs(optimizer) == before

