"""Error feedback (error_feedback.py): the residual carries what the codec did not convey to the
next round, so the sum of what was conveyed tracks the sum of the inputs; checkpoints; resets."""

from __future__ import annotations

import numpy as np
import pytest

from dedloc.daemon.averaging.compression import get_codec
from dedloc.daemon.averaging.error_feedback import ErrorFeedback, chunk_ranges, conveyed

BOUNDS = ((0, 3000), (3000, 3000), (3000, 10_000))  # an empty part (a client's) in the middle
CHUNK = 1024


def test_chunk_ranges_cut_each_part_as_the_allreduce_does() -> None:
    assert list(chunk_ranges(((0, 5), (5, 5), (5, 12)), 4)) == [(0, 4), (4, 5), (5, 9), (9, 12)]
    with pytest.raises(ValueError):
        list(chunk_ranges(((0, 5),), 0))


@pytest.mark.parametrize("name", ["topk", "uint8"])
def test_sum_conveyed_converges_to_sum_of_inputs(name: str) -> None:
    codec = get_codec(name)
    rng = np.random.default_rng(2)
    gradient = rng.standard_normal(10_000).astype(np.float32)
    feedback = ErrorFeedback()
    total = np.zeros(gradient.size, np.float64)
    residual_norms = []
    rounds = 600
    for _ in range(rounds):
        prepared = feedback.prepare(gradient)
        sent = conveyed(codec, prepared, BOUNDS, CHUNK)
        feedback.settle(sent)
        total += sent
        assert feedback.residual is not None
        residual_norms.append(float(np.abs(feedback.residual).max()))
    # telescoping: sum(conveyed) = T * gradient - residual_T, and the residual stays bounded
    assert np.abs(total - rounds * gradient.astype(np.float64) + feedback.residual).max() < 1e-3 * rounds
    late, early = max(residual_norms[rounds // 2:]), max(residual_norms[rounds // 6:rounds // 2])
    assert late <= 1.2 * early
    mean_error = np.abs(total / rounds - gradient).max()
    assert mean_error <= late / rounds + 1e-5
    if name == "topk":  # without feedback, 63 values in 64 would never be conveyed at all
        plain = conveyed(codec, gradient, BOUNDS, CHUNK)
        assert np.abs(plain - gradient).max() > 20 * mean_error


def test_settle_codec_matches_settle_with_conveyed() -> None:
    codec = get_codec("topk")
    rng = np.random.default_rng(3)
    a, b = ErrorFeedback(), ErrorFeedback()
    for _ in range(5):
        vector = rng.standard_normal(10_000).astype(np.float32)
        prepared_a, prepared_b = a.prepare(vector), b.prepare(vector)
        assert np.array_equal(prepared_a, prepared_b)
        a.settle(conveyed(codec, prepared_a, BOUNDS, CHUNK))
        prepared_b[:] = 0  # the all-reduce overwrites what it sent: settle_codec does not read it
        b.settle_codec(codec, BOUNDS, CHUNK)
        assert a.residual is not None and b.residual is not None
        assert np.array_equal(a.residual, b.residual)
    b.prepare(np.zeros(10_000, np.float32))
    with pytest.raises(ValueError, match="cover"):
        b.settle_codec(codec, ((0, 5000),), CHUNK)
    with pytest.raises(ValueError, match="outside"):
        b.settle_codec(codec, ((0, 10_001),), CHUNK)


def test_lossless_codec_leaves_no_residual_and_abandon_keeps_it() -> None:
    feedback = ErrorFeedback()
    vector = np.linspace(-1, 1, 500, dtype=np.float32)
    feedback.prepare(vector)
    feedback.settle_codec(get_codec("none"), ((0, 500),), 128)
    assert feedback.residual is not None and not feedback.residual.any()
    feedback.prepare(vector)
    feedback.settle_codec(get_codec("topk"), ((0, 500),), 128)
    before = feedback.state()
    feedback.prepare(vector * 3)
    assert feedback.pending
    feedback.abandon()  # the round failed: nothing went out
    assert not feedback.pending and np.array_equal(feedback.state(), before)
    with pytest.raises(RuntimeError):
        feedback.settle(vector)
    with pytest.raises(RuntimeError):
        feedback.settle_codec(get_codec("topk"), ((0, 500),), 128)


def test_checkpoint_round_trip_and_resets() -> None:
    feedback = ErrorFeedback()
    assert feedback.residual is None and feedback.state().size == 0
    vector = np.random.default_rng(4).standard_normal(2000).astype(np.float32)
    feedback.prepare(vector)
    feedback.settle_codec(get_codec("topk"), ((0, 2000),), 1000)
    state = feedback.state()
    assert state.dtype == np.float32 and state.shape == (2000,) and state.any()
    restored = ErrorFeedback()
    restored.load(state, size=2000)
    assert np.array_equal(restored.prepare(vector), feedback.prepare(vector))
    state[:] = 0  # the checkpoint is a copy
    assert restored.state().any()
    with pytest.raises(ValueError, match="read-only"):
        restored.residual[0] = 1  # type: ignore[index]
    # a vector of another size starts from zero
    other = np.ones(3000, np.float32)
    assert np.array_equal(restored.prepare(other), other)
    # a checkpoint of another size, or empty, starts from zero too
    fresh = ErrorFeedback()
    fresh.load(np.ones(5, np.float32), size=2000)
    assert fresh.residual is None
    fresh.load(np.zeros(0, np.float32))
    assert fresh.residual is None
    for bad in (np.array([1.0, np.nan], np.float32), np.ones(4, np.float64), np.ones((2, 2), np.float32)):
        with pytest.raises(ValueError):
            fresh.load(bad)
    fresh.reset()
    assert fresh.residual is None


def test_prepare_refuses_non_finite_and_bad_shapes() -> None:
    feedback = ErrorFeedback()
    with pytest.raises(ValueError, match="NaN or Inf"):
        feedback.prepare(np.array([1.0, np.inf], np.float32))
    with pytest.raises(ValueError, match="one-dimensional"):
        feedback.prepare(np.ones((2, 2), np.float32))
    feedback.prepare(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="shape"):
        feedback.settle(np.ones(3, np.float32))
