"""The reducers' linear rules (aggregation.py), pure: the norm-clipped weighted mean leaves honest
chunks exactly their weighted mean, clips a far larger contribution to 4 times the median norm
whatever its weight, and is the plain weighted mean below 3 senders."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dedloc.daemon.averaging.aggregation import (
    NEGLIGIBLE_SHARE,
    NORM_CLIP_FACTOR,
    check_aggregation,
    clip_scales,
    l2_norm,
    weighted_mean,
)
from dedloc.daemon.collab.grid import LISTENING_SHARE

N = 4096


def honest(count: int, seed: int = 0) -> list[np.ndarray]:
    """Gradients of one model over different batches: a shared direction plus noise."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(N)
    return [(base + 0.5 * rng.standard_normal(N)).astype(np.float32) for _ in range(count)]


def aggregate(rows: list[np.ndarray], weights: list[float], clip: bool = True) -> np.ndarray:
    norms = [l2_norm(r) for r in rows]
    scales = clip_scales(weights, norms) if clip else None
    return weighted_mean(rows, weights, np.empty(N, np.float32), scales)


def test_honest_contributions_are_exactly_their_weighted_mean() -> None:
    rows, weights = honest(5), [1.0, 2.0, 3.0, 12.0, 0.5]
    assert clip_scales(weights, [l2_norm(r) for r in rows]) == (1.0,) * 5
    plain = weighted_mean(rows, weights, np.empty(N, np.float32))
    assert np.array_equal(aggregate(rows, weights), plain)  # bit for bit
    expected = sum(w * r.astype(np.float64) for r, w in zip(rows, weights, strict=True)) / sum(weights)
    np.testing.assert_allclose(plain, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attacker_weight", [1.0, 1e6])
def test_a_vector_a_million_times_larger_is_clipped_to_four_times_the_median_norm(
        attacker_weight: float) -> None:
    rows = honest(4)
    attack = rows[0] * np.float32(-1e6)
    weights = [1.0, 1.0, 1.0, 1.0, attacker_weight]
    norms = [l2_norm(r) for r in [*rows, attack]]
    scales = clip_scales(weights, norms)
    tau = NORM_CLIP_FACTOR * float(np.median(norms))
    assert scales[:4] == (1.0,) * 4  # the honest ones are untouched
    assert scales[4] * norms[4] == pytest.approx(tau, rel=1e-12)
    assert tau < NORM_CLIP_FACTOR * max(norms[:4])  # a huge weight does not move the median
    result = aggregate([*rows, attack], weights)
    # R - H = (w_a / W) (s_a x_a - H): the attacker moves the honest mean by at most its share of
    # (tau + ||H||), however large its vector
    honest_mean = np.mean([r.astype(np.float64) for r in rows], axis=0)
    share = attacker_weight / sum(weights)
    bound = share * (tau + float(np.linalg.norm(honest_mean)))
    moved = float(np.linalg.norm(result - honest_mean))
    assert moved <= bound * (1 + 1e-5)
    assert moved > 0.5 * bound  # (it does move: the rule bounds the damage, it does not refuse)
    plain = aggregate([*rows, attack], weights, clip=False)
    assert float(np.linalg.norm(plain - honest_mean)) > 1e4 * moved  # what the mean let through


def test_the_denominator_is_not_renormalised() -> None:
    rows = [np.ones(N, np.float32), np.ones(N, np.float32), np.ones(N, np.float32),
            np.full(N, 100.0, np.float32)]
    result = aggregate(rows, [1.0] * 4)
    # the outlier is clipped to 4 x the median norm (that of a vector of ones), then everything is
    # divided by the whole weight: (1 + 1 + 1 + 4) / 4
    np.testing.assert_allclose(result, 7.0 / 4.0, rtol=1e-6)


def test_below_three_senders_it_is_the_weighted_mean() -> None:
    small, huge = np.ones(N, np.float32), np.full(N, 1e6, np.float32)
    assert clip_scales([1.0, 1.0], [l2_norm(small), l2_norm(huge)]) == (1.0, 1.0)
    # a member that sends nothing (weight 0) does not count toward the three, nor the median
    assert clip_scales([1.0, 1.0, 0.0], [1.0, 1e6, 0.0]) == (1.0, 1.0, 1.0)
    assert clip_scales([1.0, 1.0, 1.0], [1.0, 1e6, 1.0])[1] == pytest.approx(4e-6)


def test_a_negligible_weight_counts_neither_for_the_clip_nor_in_its_median() -> None:
    # a grid helper listening for the mean (2**-40 of its block's weight) beside two cells
    # whose norms differ 5x: as with the two cells alone, nothing is clipped
    assert clip_scales([10.0, 12.0, 10.0 * 2.0 ** -40], [1.0, 5.0, 1.0]) == (1.0, 1.0, 1.0)
    assert clip_scales([10.0, 12.0, 11.0], [1.0, 5.0, 1.0]) == (1.0, 0.8, 1.0)
    assert NEGLIGIBLE_SHARE > 2.0 ** 8 * LISTENING_SHARE


def test_zero_vectors_and_a_zero_median() -> None:
    # two of three contributions are zero: tau is 0, a nonzero one is scaled to nothing, zeros stay
    assert clip_scales([1.0, 1.0, 1.0], [0.0, 0.0, 5.0]) == (1.0, 1.0, 0.0)
    assert clip_scales([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]) == (1.0, 1.0, 1.0)
    rows = [np.zeros(N, np.float32), np.zeros(N, np.float32), np.ones(N, np.float32)]
    assert not aggregate(rows, [1.0, 1.0, 1.0]).any()


def test_the_median_is_over_senders_not_weights() -> None:
    # one sender of a huge weight and a small norm cannot pull tau down onto honest senders
    norms = [10.0, 10.0, 10.0, 0.001]
    assert clip_scales([1.0, 1.0, 1.0, 1e9], norms) == (1.0,) * 4
    # even-count median: the mean of the middle two
    assert clip_scales([1.0] * 4, [1.0, 2.0, 4.0, 13.0])[3] == pytest.approx(4 * 3.0 / 13.0)


def test_l2_norm_sums_in_float64() -> None:
    values = np.full(1 << 20, 0.1, np.float32)
    square = float(np.float32(0.1) * np.float32(0.1))  # each square is float32; their sum is not
    assert l2_norm(values) == pytest.approx(math.sqrt((1 << 20) * square), rel=1e-12)


def test_unknown_aggregations_are_refused() -> None:
    assert check_aggregation("norm_clip") == "norm_clip"
    with pytest.raises(ValueError, match="known: mean, norm_clip"):
        check_aggregation("median")
