"""Checking a downloaded state against witnesses: peers at the same head that the donor did not
choose and that do not know what the receiver will ask.

A donor is a stranger, and the state it sends becomes the receiver's model. Before loading it,
the receiver picks a secret random `seed` and asks up to `WITNESSES` other peers at the state's
head (epoch and lineage) for a *sketch* of their parameters under that seed: a count sketch,
`SKETCH_BUCKETS` sums in which every parameter is added, with a random sign, to one bucket that
the seed picks. It computes the same sketch of the downloaded parameters and compares: the
sketch of a difference is the difference of the sketches, and its norm is about the norm of the
difference (whatever the seed, in expectation), so a state that differs from the witness's by
more than `TOLERANCE` of its norm is caught with high probability, wherever the difference lies,
and the donor cannot aim a change at what the sketch misses (it does not know the seed).
Honest peers at one head hold the same parameters up to float rounding (a run of grid rounds:
up to a few 1e-3, until its state is averaged), far below the tolerance.

Only the parameters are compared (the first `parameters` values of a state): optimizer slots and
buffers may differ between honest peers (a local-update run's inner optimizer, batch-norm
statistics).

Pure: numpy only; the exchange is state_sync.py's, the decision the engine's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["SKETCH_BUCKETS", "TOLERANCE", "WITNESSES", "Verdict", "judge", "sketch", "sketch_distance"]

SKETCH_BUCKETS = 256
TOLERANCE = 0.02  # relative L2 distance of the sketches above which a state is refuted
WITNESSES = 2  # asked for each downloaded state (where there are that many others at the head)
_BLOCK = 1 << 20  # values sketched at a time (bounded scratch memory)
MAX_SEED = (1 << 63) - 1


def sketch(values: np.ndarray, seed: int, buckets: int = SKETCH_BUCKETS) -> np.ndarray:
    """The count sketch of `values` (1-D) under `seed`: float64, `buckets` long."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"a sketch's seed is in [0, 2**63), not {seed}")
    out = np.zeros(buckets, np.float64)
    for index, start in enumerate(range(0, values.size, _BLOCK)):
        block = values[start:start + _BLOCK].astype(np.float64)
        rng = np.random.default_rng([seed, index])
        where = rng.integers(0, buckets, size=block.size)
        signs = rng.integers(0, 2, size=block.size).astype(np.float64) * 2.0 - 1.0
        out += np.bincount(where, weights=signs * block, minlength=buckets)
    return out


def sketch_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The relative L2 distance of two sketches (0 for equal ones, inf for unusable ones)."""
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    scale = max(float(np.linalg.norm(a)), float(np.linalg.norm(b)))
    if scale == 0.0:
        return 0.0
    return float(np.linalg.norm(a - b)) / scale


Verdict = str  # "verified", "refuted", "unanswered" or "unverified" (nobody to ask)


def judge(agreements: Sequence[bool | None]) -> Verdict:
    """What the witnesses' answers say of a state: True, one agreed; False, one disagreed; None,
    one could not answer (it has moved on from the head, is busy or gone); no answers: nobody
    else is at the head. The donor counts as one voice for its state. Verified when more voices
    are for it than against and a witness is among them; refuted when more are against it;
    otherwise (a tie, or no witness could say) it is not loaded and the download is tried again
    ("unanswered": keeping the witnesses busy must not let a doctored state through). An honest
    donor outvotes one hostile witness with one honest one; a hostile donor is refuted by two
    honest witnesses and never gets past one; a state is never taken against a majority of the
    voices at the head."""
    if not agreements:
        return "unverified"  # nobody else at the head to ask: the donor's word alone
    agreed = sum(1 for a in agreements if a is True)
    disagreed = sum(1 for a in agreements if a is False)
    if disagreed > 1 + agreed:
        return "refuted"
    if agreed and 1 + agreed > disagreed:
        return "verified"
    return "unanswered"
