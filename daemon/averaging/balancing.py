"""Load balancing: how much of the vector each member of a group reduces.

The butterfly all-reduce splits the vector into one part per member; member i reduces part i. With
w_i the fraction of the vector in part i, B the vector's size in bytes, s_i = 1 when member i sends
its vector (`Member.sends`) and R_i the number of senders other than i, member i

    uploads    s_i·(1 − w_i)·B   (its vector's other parts, to their reducers)
             + w_i·B·R_i         (the averaged part i, back to every other sender)

and downloads exactly the same amounts (averaged parts back, the others' part i). The round lasts
as long as its slowest member, so `solve_shares` solves the linear program (as in DeDLOC,
Diskin et al. 2021)

    minimise T   subject to   load_i(w) ≤ T·up_i,  load_i(w) ≤ T·down_i   for every member i,
                              Σ w_i = 1,  0 ≤ w_i ≤ cap_i,  w_i = 0 where the member cannot reduce,

with caps on the shares (1 when none are given). The averager passes the caps and bounded figures
in place of the members' claimed bandwidths (claims.py: a claim alone must not win the vector).

Because upload and download amounts are equal, both constraints of a member collapse into one with
its narrower link c_i = min(up_i, down_i). Rearranged, member i's constraint reads
a_i·w_i ≤ T·c_i/B − s_i with a_i = R_i − s_i, so for a given T every w_i lives in an interval
[lo_i(T), hi_i(T)] and the feasible set is that box intersected with the simplex.

The LP is often degenerate (two equal peers: every split is optimal), so the answer is chosen in two
stages. Stage one is the LP above, solved with HiGHS, and gives the optimal time T*. Stage two fixes
T to T*·(1 + 1e-9), computes the box for that T, and picks the point of box ∩ simplex closest to a
fair reference r_i ∝ c_i (over the members that can reduce) in the weighted distance
Σ (w_i − r_i)² / r_i. That projection is unique and has a closed form, w_i = clip(λ·r_i, lo_i, hi_i)
with λ set so that Σ w_i = 1 (water-filling), so the result is deterministic and members with equal
inputs get bit-for-bit equal shares. Where the reference itself is optimal (no member is the
bottleneck for its share) the result is simply proportional to bandwidth.

Bandwidths that are zero, negative or NaN are raised to `MIN_BANDWIDTH` (1 kB/s: such a member is
very slow, not impossible) and infinite or absurd ones are capped at `MAX_BANDWIDTH` (1 TB/s), the
same way in `solve_shares` and `predicted_seconds`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog  # type: ignore[import-untyped]

from .claims import MAX_BANDWIDTH, MIN_BANDWIDTH, narrower_link
from .errors import AveragingError
from .group import Member

__all__ = [
    "MAX_BANDWIDTH",
    "MIN_BANDWIDTH",
    "BalancingError",
    "Shares",
    "member_seconds",
    "predicted_seconds",
    "solve_shares",
    "to_part_bounds",
    "uniform_shares",
]

_TIE_SLACK = 1e-9  # stage two may exceed the optimal time by this relative amount


class BalancingError(AveragingError):
    """No valid split exists for these members (nobody can reduce): the group is unusable."""


@dataclass(frozen=True)
class Shares:
    """The balancer's answer.

    fractions: the part of the vector each member reduces, in member order, summing to 1 (0 for
    members that cannot reduce). seconds: the predicted duration of the round with these fractions,
    i.e. the slowest member's transfer time (the LP optimum, up to a relative 1e-9 and the
    solver's tolerance).
    member_seconds: each member's own predicted transfer time.
    """

    fractions: tuple[float, ...]
    seconds: float
    member_seconds: tuple[float, ...]


def _model(members: Sequence[Member]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(s, a, c, reducer mask): sends flags, coefficient a_i = R_i − s_i, capacities."""
    sends = np.array([1.0 if m.sends else 0.0 for m in members])
    others = sends.sum() - sends  # R_i
    capacity = np.array([narrower_link(m) for m in members])
    reducers = np.array([m.can_reduce for m in members], dtype=bool)
    return sends, others - sends, capacity, reducers


def _check_vector_bytes(vector_bytes: float) -> None:
    if not math.isfinite(vector_bytes) or vector_bytes < 0:
        raise ValueError(f"vector_bytes must be finite and non-negative, not {vector_bytes!r}")


def member_seconds(members: Sequence[Member], fractions: Sequence[float],
                   vector_bytes: float) -> tuple[float, ...]:
    """Each member's predicted transfer time (seconds) when member i reduces fractions[i]."""
    if len(fractions) != len(members):
        raise ValueError(f"{len(fractions)} fractions for {len(members)} members")
    _check_vector_bytes(vector_bytes)
    if not members:
        return ()
    sends, coefficient, capacity, _ = _model(members)
    w = np.asarray(fractions, dtype=float)
    load = (sends + coefficient * w) * vector_bytes  # s_i·(1 − w_i)·B + w_i·B·R_i
    return tuple(float(x) for x in np.maximum(load, 0.0) / capacity)


def predicted_seconds(members: Sequence[Member], fractions: Sequence[float], vector_bytes: float) -> float:
    """The round's predicted duration for the given fractions: the slowest member's time."""
    return max(member_seconds(members, fractions, vector_bytes), default=0.0)


def uniform_shares(members: Sequence[Member]) -> tuple[float, ...]:
    """Equal fractions for every member that can reduce, 0 for the rest (the naive baseline)."""
    reducers = sum(1 for m in members if m.can_reduce)
    if reducers == 0:
        raise BalancingError("no member of the group can reduce (all are clients or unreachable)")
    return tuple(1.0 / reducers if m.can_reduce else 0.0 for m in members)


def solve_shares(members: Sequence[Member], vector_bytes: float,
                 caps: Sequence[float] | None = None) -> Shares:
    """The fractions that minimise the round's duration, tie-broken towards bandwidth-proportional
    shares (see the module docstring). `caps`: the most each member may reduce (w_i ≤ caps[i],
    claims.py), an extra bound of the LP and of stage two; they must leave room for the whole
    vector (Σ caps over the members that can reduce ≥ 1). Raises BalancingError when nobody can
    reduce or the caps leave no room."""
    _check_vector_bytes(vector_bytes)
    if not any(m.can_reduce for m in members):
        raise BalancingError("no member of the group can reduce (all are clients or unreachable)")
    sends, coefficient, capacity, reducers = _model(members)
    n = len(members)
    cap = np.ones(n) if caps is None else np.clip(np.asarray(caps, dtype=float), 0.0, 1.0)
    if cap.shape != (n,) or not np.all(np.isfinite(cap)):
        raise ValueError(f"one finite cap per member is required, not {caps!r}")
    cap = np.where(reducers, cap, 0.0)
    if cap.sum() < 1.0 - 1e-12:
        raise BalancingError(f"the members' caps on their shares add up to {cap.sum():.6g}, less "
                             "than the whole vector")

    # Stage one: the LP in x = (w_0 … w_{n−1}, t), with time in units of B / min(c):
    # a_i·w_i − (c_i / min c)·t ≤ −s_i. Dividing by the slowest link keeps every coefficient ≥ 1 in
    # size (HiGHS drops coefficients below 1e-9, which dividing by the fastest would produce).
    scale = float(capacity.min())
    a_ub = np.zeros((n, n + 1))
    a_ub[np.arange(n), np.arange(n)] = coefficient
    a_ub[:, n] = -capacity / scale
    a_eq = np.ones((1, n + 1))
    a_eq[0, n] = 0.0
    bounds = [(0.0, float(c)) for c in cap] + [(0.0, None)]
    objective = np.zeros(n + 1)
    objective[n] = 1.0
    result = linprog(objective, A_ub=a_ub, b_ub=-sends, A_eq=a_eq, b_eq=[1.0], bounds=bounds,
                     method="highs")
    if result.status != 0:  # the LP is always feasible and bounded; this is a solver failure
        raise BalancingError(f"load-balancing LP failed: {result.message}")
    lp_w = np.clip(result.x[:n], 0.0, cap)
    lp_w = lp_w / lp_w.sum()
    # Stage two works per byte of vector (the shares do not depend on B). The optimum is an exact
    # evaluation of the LP's point rather than the solver's toleranced t, so the box below is
    # guaranteed to contain that point.
    limit = predicted_seconds(members, tuple(lp_w), 1.0) * (1.0 + _TIE_SLACK)
    rhs = limit * capacity - sends  # a_i·w_i ≤ rhs_i
    lo = np.zeros(n)
    hi = np.where(reducers, 1.0, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = rhs / coefficient
    upper = reducers & (coefficient > 0)
    hi[upper] = np.clip(bound[upper], 0.0, 1.0)
    lower = reducers & (coefficient < 0)
    lo[lower] = np.clip(bound[lower], 0.0, 1.0)
    hi = np.minimum(hi, cap)
    lo = np.minimum(lo, hi)
    reference = np.where(reducers, capacity / scale, 0.0)
    fractions = tuple(float(x) for x in _water_fill(reference / reference.sum(), lo, hi))
    times = member_seconds(members, fractions, vector_bytes)
    return Shares(fractions, max(times), times)


def _water_fill(reference: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """w_i = clip(λ·r_i, lo_i, hi_i) with λ ≥ 0 such that Σ w = 1; the unique minimiser of
    Σ (w_i − r_i)² / r_i over the box and the simplex. Members with r_i = 0 stay at lo_i.

    Σ w(λ) is continuous, non-decreasing and piecewise linear in λ with breaks at lo_i/r_i and
    hi_i/r_i, so λ is found exactly by interpolating between the two breaks around 1. When rounding
    leaves the box a hair too small or too large for the simplex, the nearest end is rescaled.
    """
    active = reference > 0

    def total(lam: float) -> float:
        return float(np.clip(lam * reference, lo, hi).sum())

    breaks = np.unique(np.concatenate([lo[active] / reference[active], hi[active] / reference[active],
                                       [0.0]]))
    sums = np.array([total(b) for b in breaks])
    if sums[0] >= 1.0:
        w = np.clip(0.0 * reference, lo, hi)
    elif sums[-1] <= 1.0:
        w = np.clip(breaks[-1] * reference, lo, hi)
    else:
        k = int(np.searchsorted(sums, 1.0, side="right")) - 1  # sums[k] ≤ 1 < sums[k + 1]
        left, right = breaks[k], breaks[k + 1]
        lam = left + (1.0 - sums[k]) * (right - left) / (sums[k + 1] - sums[k])
        w = np.clip(lam * reference, lo, hi)
    return w / w.sum()


def to_part_bounds(fractions: Sequence[float], size: int, chunk_elements: int) -> tuple[tuple[int, int], ...]:
    """Half-open element ranges, one per member, tiling [0, size) in member order.

    The vector is cut into ceil(size / chunk_elements) chunks (the last one short when size is not a
    multiple); member i gets a whole number of chunks, its fraction of the total rounded by largest
    remainder (ties to the earlier member). A member whose fraction is 0 never gets a chunk; one with
    a small positive fraction may get none when the vector has few chunks.
    """
    if size < 0:
        raise ValueError(f"size must be non-negative, not {size}")
    if chunk_elements <= 0:
        raise ValueError(f"chunk_elements must be positive, not {chunk_elements}")
    if any(not math.isfinite(f) or f < 0 for f in fractions):
        raise ValueError("fractions must be finite and non-negative")
    chunks = -(-size // chunk_elements)
    total = math.fsum(fractions)
    if chunks and total <= 0:
        raise ValueError("at least one fraction must be positive")
    counts = [0] * len(fractions)
    if chunks:
        quotas = [f * chunks / total for f in fractions]
        counts = [math.floor(q) for q in quotas]
        left = chunks - sum(counts)
        positive = [i for i, f in enumerate(fractions) if f > 0]
        order = sorted(positive, key=lambda i: (counts[i] - quotas[i], i))  # largest remainder first
        for step in range(max(left, 0)):  # left < len(order) up to rounding; cycle in case of the latter
            counts[order[step % len(order)]] += 1
        while sum(counts) > chunks:  # floats rounded a quota up to a whole: take back the excess
            over = max((i for i in order if counts[i] > 0), key=lambda i: (counts[i] - quotas[i], -i))
            counts[over] -= 1
    bounds = []
    position = 0
    for count in counts:
        end = min(position + count * chunk_elements, size)
        bounds.append((position, end))
        position = end
    return tuple(bounds)
