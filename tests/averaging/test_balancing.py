"""The load balancer: LP optimality, tie-breaking, roles, and cutting the vector into part ranges."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dedloc.daemon.averaging.balancing import (
    MIN_BANDWIDTH,
    BalancingError,
    member_seconds,
    predicted_seconds,
    solve_shares,
    to_part_bounds,
    uniform_shares,
)
from dedloc.daemon.averaging.group import ROLES, Group, Member, Role

MBIT = 125_000.0  # bytes/s


def member(index: int, upload: float, download: float | None = None, role: Role = "trainer",
           reachable: bool = True) -> Member:
    weight = 0.0 if role == "aux" else 1.0
    return Member(f"peer{index}", role, weight, upload, upload if download is None else download, reachable)


bandwidths = st.floats(1e4, 1e10)  # 10 kB/s to 10 GB/s
vector_sizes = st.floats(1e3, 1e10)


@st.composite
def groups(draw: st.DrawFn, min_size: int = 1, max_size: int = 12) -> list[Member]:
    """Members with random roles, reachability and (possibly asymmetric) bandwidths; one can reduce."""
    n = draw(st.integers(min_size, max_size))
    members = [member(i, draw(bandwidths), draw(bandwidths), draw(st.sampled_from(ROLES)),
                      draw(st.booleans()) or draw(st.booleans())) for i in range(n)]
    assume(any(m.can_reduce for m in members))
    return members


def check_fractions(members: list[Member], fractions: tuple[float, ...]) -> None:
    assert len(fractions) == len(members)
    assert math.fsum(fractions) == pytest.approx(1.0, abs=1e-12)
    for m, f in zip(members, fractions, strict=True):
        assert f >= 0.0
        if not m.can_reduce:
            assert f == 0.0


# ---- symmetry and determinism ----------------------------------------------------------------------

@given(st.integers(2, 12), bandwidths, vector_sizes)
def test_equal_peers_get_equal_shares(n: int, bandwidth: float, vector_bytes: float) -> None:
    shares = solve_shares([member(i, bandwidth) for i in range(n)], vector_bytes)
    for f in shares.fractions:
        assert f == pytest.approx(1.0 / n, abs=1e-6)


@given(st.integers(2, 8), bandwidths, groups(max_size=5), vector_sizes)
def test_equal_peers_among_others_get_equal_shares(n: int, bandwidth: float, others: list[Member],
                                                   vector_bytes: float) -> None:
    twins = [member(100 + i, bandwidth) for i in range(n)]
    shares = solve_shares(others + twins, vector_bytes)
    twin_shares = shares.fractions[len(others):]
    assert max(twin_shares) - min(twin_shares) <= 1e-6


@given(groups(), vector_sizes, st.randoms(use_true_random=False))
def test_deterministic_and_order_independent(members: list[Member], vector_bytes: float, rng) -> None:
    first = solve_shares(members, vector_bytes)
    assert solve_shares(members, vector_bytes) == first
    order = list(range(len(members)))
    rng.shuffle(order)
    shuffled = solve_shares([members[i] for i in order], vector_bytes)
    assert shuffled.seconds == pytest.approx(first.seconds, rel=1e-6)
    for position, i in enumerate(order):
        assert shuffled.fractions[position] == pytest.approx(first.fractions[i], abs=1e-6)


# ---- roles -----------------------------------------------------------------------------------------

@given(groups(max_size=16), vector_sizes)
def test_fractions_are_valid_and_clients_reduce_nothing(members: list[Member], vector_bytes: float) -> None:
    shares = solve_shares(members, vector_bytes)
    check_fractions(members, shares.fractions)
    assert shares.member_seconds == member_seconds(members, shares.fractions, vector_bytes)
    assert shares.seconds == max(shares.member_seconds)


def test_clients_and_unreachable_members_get_nothing() -> None:
    members = [member(0, 100 * MBIT), member(1, 1000 * MBIT, role="client"),
               member(2, 1000 * MBIT, reachable=False), member(3, 10 * MBIT)]
    fractions = solve_shares(members, 1e8).fractions
    assert fractions[1] == 0.0
    assert fractions[2] == 0.0
    assert fractions[0] > fractions[3] > 0.0


def test_aux_members_reduce_and_take_load_off_slow_trainers() -> None:
    trainers = [member(i, 10 * MBIT) for i in range(4)]
    aux = member(9, 1000 * MBIT, role="aux")
    assert not aux.sends
    shares = solve_shares([*trainers, aux], 1e8)
    assert shares.fractions[4] > 0.99
    # Each trainer only has to ship its own vector once: the all-reduce's lower bound.
    assert shares.seconds == pytest.approx(1e8 / (10 * MBIT), rel=1e-6)


def test_only_aux_and_clients() -> None:
    members = [member(0, MBIT, role="client"), member(1, MBIT, role="client"),
               member(2, 5 * MBIT, role="aux")]
    shares = solve_shares(members, 1e6)
    assert shares.fractions == (0.0, 0.0, 1.0)
    # Each client uploads its vector and downloads the average: one vector each way.
    assert shares.seconds == pytest.approx(1e6 / MBIT)


def test_nobody_can_reduce() -> None:
    members = [member(0, MBIT, role="client"), member(1, MBIT, reachable=False)]
    with pytest.raises(BalancingError, match="no member"):
        solve_shares(members, 1e6)
    with pytest.raises(BalancingError):
        uniform_shares(members)
    with pytest.raises(BalancingError):
        solve_shares([], 1e6)


# ---- edge cases ------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["trainer", "aux"])
def test_single_member_sends_nothing(role: Role) -> None:
    shares = solve_shares([member(0, MBIT, role=role)], 1e9)
    assert shares.fractions == (1.0,)
    assert shares.seconds == 0.0


def test_nobody_sends() -> None:
    members = [member(0, MBIT, role="aux"), member(1, 3 * MBIT, role="aux")]
    shares = solve_shares(members, 1e9)
    assert shares.seconds == 0.0
    assert shares.fractions == pytest.approx((0.25, 0.75))  # the bandwidth-proportional reference


def test_single_sender_keeps_what_it_cannot_ship() -> None:
    # The only sender ships (1 − w_0)·B to the aux member and gets it back; the aux member ships
    # and receives the same. Both have equal links, so the whole part stays home: w_0 = 1, T = 0.
    shares = solve_shares([member(0, MBIT), member(1, MBIT, role="aux")], 1e6)
    assert shares.fractions == pytest.approx((1.0, 0.0), abs=1e-9)
    assert shares.seconds == pytest.approx(0.0, abs=1e-6)


def test_zero_vector() -> None:
    shares = solve_shares([member(0, MBIT), member(1, MBIT)], 0.0)
    assert shares.seconds == 0.0
    assert shares.fractions == (0.5, 0.5)
    with pytest.raises(ValueError):
        solve_shares([member(0, MBIT)], -1.0)
    with pytest.raises(ValueError):
        solve_shares([member(0, MBIT)], math.inf)


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan])
def test_non_positive_bandwidth_is_a_tiny_floor(bad: float) -> None:
    members = [member(0, bad), member(1, 100 * MBIT), member(2, 100 * MBIT)]
    shares = solve_shares(members, 1e6)
    check_fractions(members, shares.fractions)
    assert shares.fractions[0] == pytest.approx(0.0, abs=1e-6)
    assert shares.seconds == pytest.approx(1e6 / MIN_BANDWIDTH, rel=1e-6)  # it still ships its vector


extreme = st.one_of(st.just(0.0), st.floats(0.0, 1e14), st.just(math.inf))


@given(st.lists(st.tuples(st.sampled_from(ROLES), extreme, st.floats(1e-3, 1e14)), min_size=1, max_size=24),
       st.floats(0.0, 1e12))
def test_extreme_bandwidth_ranges(spec: list[tuple[Role, float, float]], vector_bytes: float) -> None:
    members = [member(i, up, down, role) for i, (role, up, down) in enumerate(spec)]
    assume(any(m.can_reduce for m in members))
    shares = solve_shares(members, vector_bytes)
    check_fractions(members, shares.fractions)
    uniform = predicted_seconds(members, uniform_shares(members), vector_bytes)
    assert shares.seconds <= uniform * (1 + 1e-6)


def test_absurd_bandwidths() -> None:
    members = [member(0, math.inf), member(1, 1e300, 1e-300), member(2, 1e30), member(3, 1.0)]
    shares = solve_shares(members, 1e9)
    check_fractions(members, shares.fractions)
    assert math.isfinite(shares.seconds)


# ---- optimality -------------------------------------------------------------------------------------

def brute_times(members: list[Member], fractions: np.ndarray, vector_bytes: float) -> np.ndarray:
    """The slowest member's time for each row of fractions, written out from the model: member i
    uploads (and downloads) s_i·(1 − w_i)·B + w_i·B·R_i over its upload (download) link."""
    sends = np.array([float(m.sends) for m in members])
    others = sends.sum() - sends
    up = np.array([m.upload for m in members])
    down = np.array([m.download for m in members])
    load = sends * (1 - fractions) * vector_bytes + fractions * vector_bytes * others
    return np.maximum(load / up, load / down).max(axis=1)


def grid_best(members: list[Member], vector_bytes: float, ticks: int = 100) -> float:
    """The best time over every split of the vector among the reducers in steps of 1/ticks."""
    reducers = [i for i, m in enumerate(members) if m.can_reduce]
    rows = [c for c in itertools.product(range(ticks + 1), repeat=len(reducers) - 1) if sum(c) <= ticks]
    counts = np.array(rows, dtype=float).reshape(len(rows), len(reducers) - 1)
    fractions = np.zeros((len(counts), len(members)))
    fractions[:, reducers[:-1]] = counts / ticks
    fractions[:, reducers[-1]] = 1 - counts.sum(axis=1) / ticks
    return float(brute_times(members, fractions, vector_bytes).min())


@settings(max_examples=100, deadline=None)
@given(groups(min_size=2, max_size=3), vector_sizes)
def test_lp_matches_grid_search(members: list[Member], vector_bytes: float) -> None:
    shares = solve_shares(members, vector_bytes)
    assert predicted_seconds(members, shares.fractions, vector_bytes) == shares.seconds
    solution = np.array([shares.fractions])
    assert brute_times(members, solution, vector_bytes)[0] == pytest.approx(shares.seconds, rel=1e-12)
    best = grid_best(members, vector_bytes)
    assert shares.seconds <= best * (1 + 1e-6)
    # The grid's best is no further from the optimum than a 0.01 step of any fraction can move a time.
    steepest = max(abs(sum(m.sends for m in members) - 2 * m.sends) * vector_bytes / min(m.upload, m.download)
                   for m in members if m.can_reduce)
    assert best - shares.seconds <= 0.02 * steepest + 1e-9 * best


@given(groups(max_size=16), vector_sizes, st.lists(st.floats(0.0, 1.0), min_size=16, max_size=16))
def test_never_worse_than_uniform_or_a_random_split(members: list[Member], vector_bytes: float,
                                                    raw: list[float]) -> None:
    shares = solve_shares(members, vector_bytes)
    uniform = predicted_seconds(members, uniform_shares(members), vector_bytes)
    assert shares.seconds <= uniform * (1 + 1e-6)
    weights = [r if m.can_reduce else 0.0 for r, m in zip(raw, members, strict=False)]
    assume(sum(weights) > 0)
    split = [w / sum(weights) for w in weights]
    assert shares.seconds <= predicted_seconds(members, split, vector_bytes) * (1 + 1e-6)


@given(st.integers(1, 8), bandwidths)
def test_dominant_peer_becomes_a_parameter_server(others: int, bandwidth: float) -> None:
    members = [member(0, 1000 * bandwidth)] + [member(i + 1, bandwidth) for i in range(others)]
    shares = solve_shares(members, 1e8)
    assert shares.fractions[0] >= 0.99


def test_asymmetric_links_are_limited_by_upload() -> None:
    symmetric = [member(i, b * MBIT) for i, b in enumerate([100, 50, 20])]
    asymmetric = [member(i, b * MBIT / 10, b * MBIT) for i, b in enumerate([100, 50, 20])]
    tenth = [member(i, b * MBIT / 10) for i, b in enumerate([100, 50, 20])]
    fast = solve_shares(symmetric, 1e8)
    slow = solve_shares(asymmetric, 1e8)
    assert slow.fractions == pytest.approx(solve_shares(tenth, 1e8).fractions, abs=1e-9)
    assert slow.fractions == pytest.approx(fast.fractions, abs=1e-6)  # scaling all links changes no share
    assert slow.seconds == pytest.approx(10 * fast.seconds, rel=1e-6)
    # Every member's upload fits in the round's time on its upload link.
    for m, f, seconds in zip(asymmetric, slow.fractions, slow.member_seconds, strict=True):
        upload = (1 - f) * 1e8 + f * 1e8 * 2
        assert upload <= seconds * m.upload * (1 + 1e-9)


def test_asymmetric_member_among_symmetric() -> None:
    members = [member(0, 10 * MBIT, 1000 * MBIT), member(1, 100 * MBIT), member(2, 100 * MBIT)]
    shares = solve_shares(members, 1e8)
    assert shares.fractions[0] < shares.fractions[1]
    assert shares.fractions[1] == pytest.approx(shares.fractions[2], abs=1e-9)


def test_heterogeneous_links_beat_uniform() -> None:
    members = [member(i, b * MBIT) for i, b in enumerate([100, 50, 20, 10])]
    shares = solve_shares(members, 1e8)
    uniform = predicted_seconds(members, uniform_shares(members), 1e8)
    assert uniform / shares.seconds >= 1.4
    # The 10 Mbit/s member only ships its own vector (80 s) and reduces nothing; uniform takes 120 s.
    assert shares.seconds == pytest.approx(80.0, rel=1e-6)
    assert uniform == pytest.approx(120.0)
    assert shares.fractions[3] == pytest.approx(0.0, abs=1e-6)


def test_uniform_shares() -> None:
    members = [member(0, MBIT), member(1, MBIT, role="client"), member(2, MBIT, role="aux"),
               member(3, MBIT, reachable=False)]
    assert uniform_shares(members) == (0.5, 0.0, 0.5, 0.0)


def test_predicted_seconds_checks_lengths() -> None:
    with pytest.raises(ValueError, match="fractions"):
        predicted_seconds([member(0, MBIT)], (0.5, 0.5), 1e6)
    assert predicted_seconds([], (), 1e6) == 0.0


# ---- part bounds ----------------------------------------------------------------------------------

@given(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1.0), st.floats(1e-12, 1e-6)), min_size=1,
                max_size=20),
       st.integers(0, 1_000_000), st.integers(1, 10_000))
def test_part_bounds_tile_in_whole_chunks(fractions: list[float], size: int, chunk: int) -> None:
    assume(sum(fractions) > 0)
    bounds = to_part_bounds(fractions, size, chunk)
    assert len(bounds) == len(fractions)
    position = 0
    chunks = []
    for (start, end), f in zip(bounds, fractions, strict=True):
        assert start == position <= end
        assert start % chunk == 0 or start == size
        assert end % chunk == 0 or end == size
        if f == 0:
            assert start == end
        chunks.append(-(-(end - start) // chunk))
        position = end
    assert position == size
    total = -(-size // chunk)
    assert sum(chunks) == total
    quotas = np.array(fractions) * total / sum(fractions)
    assert np.all(np.abs(np.array(chunks) - quotas) < 1 + 1e-9)  # largest remainder never misses by 1


def test_part_bounds_examples() -> None:
    assert to_part_bounds((0.5, 0.0, 0.5), 10, 3) == ((0, 6), (6, 6), (6, 10))
    assert to_part_bounds((0.3, 0.7), 1, 1024) == ((0, 0), (0, 1))
    assert to_part_bounds((1 / 3, 1 / 3, 1 / 3), 100, 10) == ((0, 40), (40, 70), (70, 100))
    assert to_part_bounds((0.0, 1.0), 0, 8) == ((0, 0), (0, 0))
    assert to_part_bounds((0.0, 0.0, 1.0), 7, 2) == ((0, 0), (0, 0), (0, 7))


def test_part_bounds_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        to_part_bounds((1.0,), 10, 0)
    with pytest.raises(ValueError):
        to_part_bounds((1.0,), -1, 4)
    with pytest.raises(ValueError):
        to_part_bounds((0.0, 0.0), 10, 4)
    with pytest.raises(ValueError):
        to_part_bounds((-0.5, 1.5), 10, 4)


@given(groups(max_size=10), st.integers(0, 100_000), st.integers(1, 4096))
def test_solution_makes_a_valid_group(members: list[Member], size: int, chunk: int) -> None:
    shares = solve_shares(members, size * 4.0)
    group = Group("g", "key", tuple(members), size, to_part_bounds(shares.fractions, size, chunk), chunk,
                  "none", 0.0)
    group.check()
    assert Group.from_json(group.to_json()) == group
