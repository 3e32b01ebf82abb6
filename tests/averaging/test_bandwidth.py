"""The bandwidth estimator: starts at the guess, converges on observed rates, ignores tiny transfers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedloc.daemon.averaging.bandwidth import BandwidthEstimator

MB = 1_000_000


def test_starts_at_the_guess() -> None:
    estimator = BandwidthEstimator(1e6, 5e6)
    assert (estimator.upload, estimator.download, estimator.samples) == (1e6, 5e6, 0)


@given(st.floats(1e3, 1e10), st.floats(1e3, 1e10))
def test_converges_to_a_constant_rate(guess: float, rate: float) -> None:
    estimator = BandwidthEstimator(guess, guess)
    for _ in range(300):
        assert estimator.observe_upload(1e9, 1e9 / rate)  # 0.1 s to 11.6 days: all long enough
        assert estimator.observe_download(2e9, 2e9 / rate)
    assert estimator.upload == pytest.approx(rate, rel=1e-6)
    assert estimator.download == pytest.approx(rate, rel=1e-6)
    assert (estimator.upload_samples, estimator.download_samples) == (300, 300)


def test_half_life_in_samples() -> None:
    estimator = BandwidthEstimator(10 * MB, 10 * MB, half_life_samples=5)
    for _ in range(5):
        estimator.observe_download(20 * MB, 10.0)  # 2 MB/s
    assert estimator.download == pytest.approx(6 * MB)  # half way from 10 to 2
    assert estimator.upload == 10 * MB  # the other direction is untouched
    assert (estimator.download_samples, estimator.upload_samples, estimator.samples) == (5, 0, 5)


def test_ignores_tiny_transfers() -> None:
    estimator = BandwidthEstimator(MB, MB)
    assert not estimator.observe_upload(100 * 1024, 1.0)  # too few bytes: latency, not bandwidth
    assert not estimator.observe_upload(10 * MB, 0.005)  # too quick to time
    assert not estimator.observe_download(0, 0.0)
    assert estimator.samples == 0
    assert (estimator.upload, estimator.download) == (MB, MB)
    assert estimator.observe_upload(256 * 1024, 0.01)


def test_thresholds_are_configurable() -> None:
    estimator = BandwidthEstimator(MB, MB, min_bytes=0, min_seconds=0.0)
    assert estimator.observe_upload(1000, 0.001)
    assert not estimator.observe_upload(1000, 0.0)  # no duration: no rate


@given(st.floats(1e3, 1e9), st.lists(st.tuples(st.floats(3e5, 1e10), st.floats(0.01, 1e3)), max_size=30))
def test_estimate_stays_within_the_observed_range(guess: float, transfers: list[tuple[float, float]]) -> None:
    estimator = BandwidthEstimator(guess, guess, half_life_samples=2)
    twin = BandwidthEstimator(guess, guess, half_life_samples=2)
    for size, seconds in transfers:
        estimator.observe_upload(size, seconds)
        twin.observe_upload(size, seconds)
    rates = [guess] + [size / seconds for size, seconds in transfers]
    assert min(rates) * (1 - 1e-12) <= estimator.upload <= max(rates) * (1 + 1e-12)
    assert estimator.upload == twin.upload  # deterministic


@pytest.mark.parametrize("kwargs", [
    {"initial_upload": 0.0, "initial_download": 1.0},
    {"initial_upload": 1.0, "initial_download": math.nan},
    {"initial_upload": 1.0, "initial_download": 1.0, "half_life_samples": 0},
    {"initial_upload": 1.0, "initial_download": 1.0, "min_bytes": -1},
])
def test_rejects_bad_configuration(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BandwidthEstimator(**kwargs)


def test_rejects_impossible_transfers() -> None:
    estimator = BandwidthEstimator(MB, MB)
    with pytest.raises(ValueError):
        estimator.observe_upload(-1, 1.0)
    with pytest.raises(ValueError):
        estimator.observe_download(MB, math.inf)
