"""`workers.duty_cycle`: a worker that trains computes that share of the time and rests after
each batch for the remainder, on a clock of the test's own (a batch takes 0.1 s of it, a rest
takes what it asks for), so no test here waits for real time."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dedloc.daemon.errors import ConfigError
from dedloc.daemon.workers.settings import WorkerSettings
from dedloc.plugins.catalog import CatalogEntry
from dedloc.plugins.tiny.workload import TINY
from dedloc.plugins.worker import session as session_module
from dedloc.plugins.worker.main import parse_args
from dedloc.plugins.worker.session import Session

BATCH = 8
BATCH_SECONDS = 0.1


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _TimedBatches:
    """The workload, with each loss() taking BATCH_SECONDS of the test's clock."""

    def __init__(self, workload: Any, clock: _Clock) -> None:
        self._workload, self._clock = workload, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workload, name)

    def loss(self, model: Any, batch: Any, device: Any) -> tuple[torch.Tensor, int]:
        self._clock.now += BATCH_SECONDS
        return self._workload.loss(model, batch, device)


class _Rests(threading.Event):
    """A cancel event whose waits take no real time: each is recorded and moves the clock on;
    `cancel_after` rests, the next one is interrupted (the call was cancelled meanwhile)."""

    def __init__(self, clock: _Clock, cancel_after: int | None = None) -> None:
        super().__init__()
        self._clock, self._cancel_after = clock, cancel_after
        self.rests: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None and timeout > 0
        if self._cancel_after is not None and len(self.rests) >= self._cancel_after:
            self.set()
            self.rests.append(0.0)
            return True
        self.rests.append(timeout)
        self._clock.now += timeout
        return False


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(session_module, "time", SimpleNamespace(perf_counter=clock))
    return clock


def _session(clock: _Clock) -> Session:
    config = TINY.resolve_config({"batch_size": BATCH, "hidden": 8})
    session = Session(CatalogEntry(TINY, "tiny (test)"), config, seed=1, init_seed=5,
                      device=torch.device("cpu"))
    session.workload = _TimedBatches(session.workload, clock)  # type: ignore[assignment]
    return session


def test_a_full_duty_cycle_never_rests(clock: _Clock) -> None:
    rests = _Rests(clock)
    result = _session(clock).train(4 * BATCH, None, rests)
    assert result["samples"] == 4 * BATCH and rests.rests == []
    assert result["samples_per_second"] == pytest.approx(BATCH / BATCH_SECONDS)


@pytest.mark.parametrize("duty", [0.25, 0.5, 0.05])
def test_each_batch_is_followed_by_its_rest_and_the_speed_counts_them(clock: _Clock,
                                                                      duty: float) -> None:
    rests = _Rests(clock)
    result = _session(clock).train(4 * BATCH, None, rests, duty_cycle=duty)
    assert result["samples"] == 4 * BATCH
    rest = BATCH_SECONDS * (1 / duty - 1)
    assert rests.rests == pytest.approx([rest] * 4)
    assert result["seconds"] == pytest.approx(4 * BATCH_SECONDS / duty)
    assert result["samples_per_second"] == pytest.approx(duty * BATCH / BATCH_SECONDS)


def test_a_rest_ends_with_the_calls_time(clock: _Clock) -> None:
    """max_seconds 0.25 at a quarter duty: one batch (0.1 s) and a rest cut to 0.15 s, not 0.3 s."""
    rests = _Rests(clock)
    result = _session(clock).train(100 * BATCH, 0.25, rests, duty_cycle=0.25)
    assert result["samples"] == BATCH
    assert rests.rests == pytest.approx([0.15])


def test_a_cancelled_rest_ends_the_call(clock: _Clock) -> None:
    rests = _Rests(clock, cancel_after=2)
    result = _session(clock).train(100 * BATCH, None, rests, duty_cycle=0.25)
    assert result["samples"] == 3 * BATCH  # the third rest was interrupted: no fourth batch
    assert rests.rests[:2] == pytest.approx([0.3, 0.3]) and len(rests.rests) == 3


@pytest.mark.parametrize("bad", [0.0, 0.04, 1.5, float("nan")])
def test_a_duty_cycle_out_of_bounds_is_refused_by_daemon_and_worker(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"workers\.duty_cycle"):
        WorkerSettings(duty_cycle=bad)
    with pytest.raises(SystemExit):
        parse_args(["--socket", "/tmp/s", "--duty-cycle", repr(bad)])
    assert WorkerSettings(duty_cycle=0.05).duty_cycle == 0.05
    assert parse_args(["--socket", "/tmp/s", "--duty-cycle", "0.3"]).duty_cycle == 0.3
    assert parse_args(["--socket", "/tmp/s"]).duty_cycle == 1.0


def test_what_a_call_had_no_time_for_is_rested_at_the_start_of_the_next(clock: _Clock) -> None:
    session, rests = _session(clock), _Rests(clock)
    first = session.train(100 * BATCH, 0.25, rests, duty_cycle=0.25)
    assert first["samples"] == BATCH and first["rested_seconds"] == pytest.approx(0.15)
    second = session.train(2 * BATCH, None, rests, duty_cycle=0.25)
    # the 0.15 s owed first, then two batches, each with its rest
    assert rests.rests == pytest.approx([0.15, 0.15, 0.3, 0.3])
    assert second["samples"] == 2 * BATCH and second["rested_seconds"] == pytest.approx(0.75)


@pytest.mark.parametrize("duty", [0.25, 0.1])
def test_calls_shorter_than_a_batch_still_compute_only_the_duty_cycles_share(clock: _Clock,
                                                                             duty: float) -> None:
    """The daemon asks for 0.5 s at a time, less than a CPU batch takes (here: calls of half a
    batch): the rests carry over from call to call, so the share holds over many calls, and
    calls that only rest report no samples."""
    session, rests = _session(clock), _Rests(clock)
    began, samples, empty = clock.now, 0, 0
    for _ in range(200):
        result = session.train(100 * BATCH, BATCH_SECONDS / 2, rests, duty_cycle=duty)
        samples += result["samples"]
        empty += result["samples"] == 0
        if result["samples"]:
            assert result["samples_per_second"] == pytest.approx(duty * BATCH / BATCH_SECONDS)
    computed, elapsed = samples / BATCH * BATCH_SECONDS, clock.now - began
    assert computed - BATCH_SECONDS <= duty * elapsed  # (the last batch's rest may be under way)
    assert computed >= duty * elapsed * 0.8  # (and it does compute)
    assert empty > 0


class _NanBatches(_TimedBatches):
    def loss(self, model: Any, batch: Any, device: Any) -> tuple[torch.Tensor, int]:
        loss, size = super().loss(model, batch, device)
        return loss * float("nan"), size


def test_a_batch_skipped_for_a_nan_is_owed_its_rest_too(clock: _Clock) -> None:
    session, rests = _session(clock), _Rests(clock)
    session.workload = _NanBatches(session.workload._workload, clock)  # type: ignore[attr-defined]
    result = session.train(BATCH, 0.35, rests, duty_cycle=0.5)
    assert result["samples"] == 0 and session.skipped_batches >= 1
    assert rests.rests[0] == pytest.approx(0.1)
