"""How a reducer combines one chunk's contributions: the run's linear rules. No I/O.

Two rules, named by a run's manifest (`aggregation`) and carried by every round's group, so that
every reducer of a round (aux peers included) applies the same one and every member checks the
answers against it (accounts.py):

- `mean`: the weighted mean, sum_i w_i x_i / sum_i w_i.
- `norm_clip` (the default of runs): the norm-clipped weighted mean. With at least
  `MIN_CLIP_SENDERS` contributions of weight > 0 (and not negligible: `NEGLIGIBLE_SHARE`), tau =
  `NORM_CLIP_FACTOR` times the median of their L2 norms (unweighted: a claimed weight cannot
  move it), each contribution is scaled by s_i = min(1, tau / ||x_i||) (1 for a zero vector; 0
  for a nonzero one when tau is 0), and the answer is sum_i w_i s_i x_i / sum_i w_i. The
  denominator is not renormalised: a clipped contribution shrinks toward zero, it does not pass
  its weight on to the others. With fewer senders it is the weighted mean (no median can outvote
  anyone).

Both are linear in the contributions once the scales are known, and the scales follow from the
norms the reducer states in its account: a member recomputes them, so norm-clipped answers stay
checkable (centered clipping, clipping.py, is not linear and is not checked). Honest
contributions of one round have norms well within 4 times their median (gradients of one model
over batches of similar size; the norms of means differ like the square roots of the batch
sizes), so an honest round is exactly its weighted mean; one far larger contribution moves the
answer by at most its weight's share of 4 times the median norm, whatever its norm.

The norms are float64 sums of the float32 squares (`l2_norm`), the same numbers the account
states: reducer and member compute the same scales from them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal

import numpy as np

Aggregation = Literal["mean", "norm_clip"]
AGGREGATIONS: tuple[Aggregation, ...] = ("mean", "norm_clip")
DEFAULT_RUN_AGGREGATION: Aggregation = "norm_clip"  # a gradients run's default (manifest.py)
NORM_CLIP_FACTOR = 4.0  # tau: this many times the median norm of a chunk's contributions
MIN_CLIP_SENDERS = 3  # below this many contributions of weight > 0: the plain weighted mean
# a contribution that weighs less than this share of its chunk's heaviest is not counted for the
# clip (neither in MIN_CLIP_SENDERS nor in the median): a grid round's helper sends its block's
# mean, which a cell of the block sends too, with 2**-40 of that block's weight only to get the
# answer back (collab/grid.py). Honest weights of one chunk differ far less; a claim (bounded by
# the round's max_weight, a few target batches) would need 2**30 times an honest weight to leave
# it uncounted, and an uncounted one still weighs in the mean
NEGLIGIBLE_SHARE = 2.0 ** -30


def check_aggregation(name: str) -> Aggregation:
    """`name` as an Aggregation; ValueError with the known ones otherwise."""
    for known in AGGREGATIONS:
        if name == known:
            return known
    raise ValueError(f"unknown aggregation {str(name)[:40]!r} (known: {', '.join(AGGREGATIONS)})")


def l2_norm(values: np.ndarray) -> float:
    """||values||_2, summed in float64 (the squares are float32: off by at most 2^-24 each,
    relative). No BLAS: this runs in many threads at once (accounts.measure says why)."""
    squares = np.multiply(values, values)
    return math.sqrt(float(squares.sum(dtype=np.float64)))


def clip_scales(weights: Sequence[float], norms: Sequence[float]) -> tuple[float, ...]:
    """s_i for each contribution (its weight, its norm) under `norm_clip` (module docstring):
    all 1 below MIN_CLIP_SENDERS contributions of weight > 0 (those that weigh less than
    NEGLIGIBLE_SHARE of the heaviest are not counted, nor is their norm in the median)."""
    floor = max(weights, default=0.0) * NEGLIGIBLE_SHARE
    counted = [norm for weight, norm in zip(weights, norms, strict=True)
               if weight > 0 and weight >= floor]
    if len(counted) < MIN_CLIP_SENDERS:
        return (1.0,) * len(norms)
    tau = NORM_CLIP_FACTOR * statistics.median(counted)
    return tuple(1.0 if norm <= tau else tau / norm for norm in norms)


def weighted_mean(rows: Sequence[np.ndarray], weights: Sequence[float], out: np.ndarray,
                  scales: Sequence[float] | None = None) -> np.ndarray:
    """sum_i w_i s_i x_i / sum_i w_i into `out` (float32; s_i = 1 without `scales`), each row
    multiplied by its float32 coefficient and added in order: with every s_i 1 the result is the
    weighted mean, bit for bit."""
    total = float(sum(weights))
    product = np.empty_like(out)
    for position, (row, weight) in enumerate(zip(rows, weights, strict=True)):
        scale = 1.0 if scales is None else scales[position]
        target = out if position == 0 else product
        np.multiply(row, np.float32(weight * scale / total), out=target)
        if position:
            np.add(out, product, out=out)
    return out
