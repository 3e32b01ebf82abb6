"""The sketch that witnesses compare a downloaded state with (collab/state_check.py): equal
parameters agree, float rounding agrees, a change of a few percent of the norm does not, wherever
it lies; and the verdict of several witnesses."""

from __future__ import annotations

import numpy as np
import pytest

from dedloc.daemon.collab.state_check import TOLERANCE, judge, sketch, sketch_distance


def params(size: int = 300_000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def test_equal_and_rounded_parameters_agree() -> None:
    x = params()
    assert sketch_distance(sketch(x, 7), sketch(x.copy(), 7)) == 0.0
    rounded = (x.astype(np.float64) * (1 + 1e-6)).astype(np.float32)
    assert sketch_distance(sketch(x, 7), sketch(rounded, 7)) < 1e-5


@pytest.mark.parametrize("where", ["spread", "one_block", "few_large"])
def test_a_change_of_a_few_percent_of_the_norm_is_caught_wherever_it_lies(where: str) -> None:
    x = params(size=3_000_000)  # several sketch blocks
    y = x.copy()
    rng = np.random.default_rng(1)
    if where == "spread":  # every value nudged
        y += 0.05 * rng.standard_normal(y.size).astype(np.float32)
    elif where == "one_block":  # one layer replaced
        y[2_500_000:2_530_000] = rng.standard_normal(30_000).astype(np.float32) * 3
    else:  # a handful of values set huge
        y[rng.integers(0, y.size, 5)] = 200.0
    relative = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    assert relative > 2 * TOLERANCE
    for seed in range(5):  # whatever the seed
        assert sketch_distance(sketch(x, seed), sketch(y, seed)) > TOLERANCE, (where, seed)


def test_sketches_depend_on_the_seed_and_refuse_bad_ones() -> None:
    x = params(size=10_000)
    assert not np.allclose(sketch(x, 1), sketch(x, 2))
    with pytest.raises(ValueError):
        sketch(x, -1)
    assert sketch_distance(sketch(x, 1), np.full(256, np.nan)) == float("inf")


@pytest.mark.parametrize(("answers", "verdict"), [
    ([True, True], "verified"),
    ([True, None], "verified"),
    ([], "unverified"),  # nobody else at the head
    ([None, None], "unanswered"),
    ([False, None], "unanswered"),  # the donor against one witness: ask again
    ([False, True], "verified"),  # the donor and one witness against one witness
    ([False, False], "refuted"),
    ([False, False, True], "unanswered"),
    ([False, False, False, True], "refuted"),
    ([False, True, True], "verified"),
])
def test_the_witnesses_verdict(answers: list[bool | None], verdict: str) -> None:
    assert judge(answers) == verdict
