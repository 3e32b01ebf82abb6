"""A batch whose loss or gradients are NaN or Inf (an fp16 overflow, a bad sample) is skipped and
training goes on; a model that gives nothing else (it has diverged) fails with a workload error
that says so. In process, on the `tiny` workload with a loss that goes bad on chosen batches."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from dedloc.plugins.catalog import CatalogEntry
from dedloc.plugins.errors import WorkloadError
from dedloc.plugins.tiny.workload import TINY
from dedloc.plugins.worker.outer import LocalUpdates
from dedloc.plugins.worker.session import MAX_NONFINITE_STREAK, Session

CONFIG = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "batch_size": 8, "hidden": 16,
          "warmup_steps": 0}


class _BadBatches:
    """The workload, with the loss of the calls numbered in `bad` made `value` (NaN, Inf), or
    (`where` "gradients") left finite with an infinite gradient."""

    def __init__(self, workload: Any, bad: set[int], value: float, where: str) -> None:
        self._workload, self.bad, self.value, self.where, self.calls = workload, bad, value, where, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workload, name)

    def loss(self, model: Any, batch: Any, device: Any) -> tuple[torch.Tensor, int]:
        loss, size = self._workload.loss(model, batch, device)
        self.calls += 1
        if self.calls in self.bad:
            if self.where == "loss":
                loss = loss * self.value
            else:  # a finite loss (+ sqrt(0)) whose gradient is infinite (1 / (2 sqrt(0)))
                first = next(model.parameters()).reshape(-1)[0]
                loss = loss + torch.sqrt(first - first.detach())
                assert torch.isfinite(loss)
        return loss, size


def _session(bad: set[int], value: float, where: str, local: bool) -> Session:
    resolved = TINY.resolve_config(dict(CONFIG))
    settings = LocalUpdates(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                            clip=0) if local else None
    session = Session(CatalogEntry(TINY, "tiny (test)"), resolved, seed=1, init_seed=5,
                      device=torch.device("cpu"), local=settings)
    session.workload = _BadBatches(session.workload, bad, value, where)  # type: ignore[assignment]
    return session


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize(("value", "where"), [(float("nan"), "loss"), (float("inf"), "loss"),
                                              (float("inf"), "gradients")])
def test_a_bad_batch_is_skipped_and_training_goes_on(local: bool, value: float, where: str) -> None:
    session = _session({2, 3}, value, where, local)
    before = [p.detach().clone() for p in session.params]
    result = session.train(32, None, threading.Event())
    assert result["samples"] == 32 and result["skipped_batches"] == 2
    assert session.accumulated_samples == 32
    assert all(torch.isfinite(p).all() for p in session.params)
    if local:  # four good inner steps were taken
        assert any(not torch.equal(a, b) for a, b in zip(before, session.params, strict=True))


@pytest.mark.parametrize("local", [False, True])
def test_a_model_that_gives_only_bad_batches_fails_saying_it_diverged(local: bool) -> None:
    session = _session(set(range(2, 2 + MAX_NONFINITE_STREAK)), float("nan"), "loss", local)
    with pytest.raises(WorkloadError, match="diverged") as raised:
        session.train(10_000, None, threading.Event())
    assert raised.value.data["skipped_batches"] == MAX_NONFINITE_STREAK
    assert raised.value.data["samples"] == 8  # the first batch, good, was trained


def test_a_cancelled_call_ends_after_a_skipped_batch_with_nothing_trained() -> None:
    # (the daemon cancels a call to stop or pause: it does not wait out a streak of bad batches)
    session = _session(set(range(1, 1 + MAX_NONFINITE_STREAK)), float("nan"), "loss", local=False)
    cancel = threading.Event()
    cancel.set()
    result = session.train(10_000, None, cancel)
    assert result["samples"] == 0 and result["loss"] == 0.0 and result["skipped_batches"] == 1
    assert result["samples_per_second"] is None
    assert session.workload.calls == 1
    with pytest.raises(WorkloadError, match="diverged"):  # the streak goes on across calls
        session.train(8, None, threading.Event())
    assert session.skipped_batches == MAX_NONFINITE_STREAK
