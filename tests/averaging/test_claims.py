"""Bandwidth claims, bounded (claims.py): the public rule every member can check, the leader's
rule from what it measured, and the stall allowances. Pure and table-driven."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc.daemon.averaging.balancing import solve_shares, to_part_bounds
from dedloc.daemon.averaging.bandwidth import PeerRates, measured_rates
from dedloc.daemon.averaging.claims import (
    ALLOWANCE_FLOOR_RATE,
    SPREAD,
    bounded_figures,
    leader_plan,
    share_caps,
    share_refusal,
    stall_allowance,
)
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.report import AllReduceReport, PartFailure, PeerTransfer

HONEST = 1e7  # bytes/s
MIN_BYTES_EACH = 1 << 20  # a transfer large enough to measure
SIZE = 1 << 20  # elements
CHUNK = 1 << 12


def member(name: str, bandwidth: float, role: str = "trainer") -> Member:
    return Member(name, role, 0.0 if role == "aux" else 1.0, bandwidth, bandwidth)  # type: ignore[arg-type]


def split(members: list[Member], me: str, rates: dict[str, float]) -> tuple[float, ...]:
    """The fractions the leader `me` gives, as averager._plan computes them."""
    plan = leader_plan(members, me, rates)
    return solve_shares(plan.members, SIZE * 4, plan.caps).fractions


def group(members: list[Member], fractions: tuple[float, ...]) -> Group:
    return Group("g", "k", tuple(members), SIZE, to_part_bounds(fractions, SIZE, CHUNK), CHUNK,
                 "none", 1e9)


# (claims of a, b, c, d; what the leader "a" measured of the others; the most of the vector d may
# reduce; the least it must reduce; counted as bounded, as cut)
CASES = {
    "honest, equal": ([HONEST] * 4, {"b": HONEST, "c": HONEST, "d": HONEST}, 0.25, 0.25, 0, 0),
    "honest, no history": ([HONEST] * 4, {}, 0.25, 0.25, 0, 0),
    "1e12 claim, no history": ([HONEST] * 3 + [1e12], {}, 0.25, 0.0, 1, 1),
    "1e12 claim, measured like the others": (
        [HONEST] * 3 + [1e12], {"b": HONEST, "c": HONEST, "d": HONEST}, 0.25, 0.25, 1, 1),
    # honest claims (their own moving averages) read lower than the leader's measurements
    "1e12 claim, measured like the honest, who claim less": (
        [HONEST] * 3 + [1e12], {"b": 2 * HONEST, "c": 2 * HONEST, "d": 2 * HONEST}, 0.25, 0.25, 1, 1),
    # evidence does not cut a figure below the typical one (the median of the others' figures)
    "1e12 claim, measured slow": ([HONEST] * 3 + [1e12], {"b": HONEST, "c": HONEST, "d": 1e5},
                                  0.25, 0.25, 1, 1),
    "1 B/s claim": ([HONEST] * 3 + [1.0], {"b": HONEST, "c": HONEST, "d": HONEST}, 0.01, 0.0, 1, 0),
    "a proven fast peer": ([HONEST] * 3 + [4 * HONEST], {"b": HONEST, "c": HONEST, "d": 4 * HONEST},
                           0.5, 0.45, 0, 0),
    "history contradicting a claim": ([HONEST] * 3 + [4 * HONEST],
                                      {"b": HONEST, "c": HONEST, "d": HONEST / 4}, 0.25, 0.25, 0, 1),
    "history backing part of a claim": ([HONEST] * 3 + [4 * HONEST],
                                        {"b": HONEST, "c": HONEST, "d": 2 * HONEST}, 0.5, 0.4, 0, 1),
    # an honest member measured slow (a busy CPU, or the smaller part it had): not cut
    "honest, one measured slow": ([HONEST] * 4, {"b": HONEST, "c": HONEST, "d": HONEST / 4},
                                  0.25, 0.25, 0, 0),
    # measurements that read below every claim do not give the leader, whose figure is its own
    # claim, more than the others
    "honest, all measured below their claims": (
        [HONEST] * 4, {"b": HONEST / 2, "c": HONEST / 2, "d": HONEST / 2}, 0.25, 0.25, 0, 0),
}


@pytest.mark.parametrize(("claims", "rates", "most", "least", "bounded", "cut"), CASES.values(),
                         ids=CASES.keys())
def test_the_leaders_split(claims: list[float], rates: dict[str, float], most: float,
                           least: float, bounded: int, cut: int) -> None:
    members = [member(name, claim) for name, claim in zip("abcd", claims, strict=True)]
    plan = leader_plan(members, "a", rates)
    assert (plan.claims_bounded, plan.claims_cut) == (bounded, cut)
    fractions = split(members, "a", rates)
    assert least - 1e-9 <= fractions[3] <= most + 1e-9, fractions
    assert share_refusal(group(members, fractions)) is None  # followers take it


@pytest.mark.parametrize(("claims", "figures"), [
    ([HONEST] * 4, [HONEST] * 4),
    ([HONEST] * 3 + [1e12], [HONEST] * 3 + [SPREAD * HONEST]),
    ([HONEST] * 3 + [1.0], [HONEST] * 3 + [HONEST / SPREAD]),
    ([1.0, 1.0, 1.0, 1e12], [1e3, 1e3, 1e3, SPREAD * 1e3]),  # absolute floor first, then the median
])
def test_public_figures(claims: list[float], figures: list[float]) -> None:
    members = [member(str(i), claim) for i, claim in enumerate(claims)]
    assert bounded_figures(members) == pytest.approx(figures)


def test_share_caps_count_only_members_that_reduce() -> None:
    members = [member("a", HONEST), member("b", HONEST), member("c", HONEST, "client"),
               member("d", HONEST, "aux")]
    assert share_caps(members) == (2 / 3, 2 / 3, 0.0, 2 / 3)
    assert share_caps(members[:2]) == (1.0, 1.0)


def test_a_group_giving_one_member_most_of_the_vector_is_refused() -> None:
    members = [member(name, claim) for name, claim in zip("abcd", [HONEST] * 3 + [1e12], strict=True)]
    refusal = share_refusal(group(members, (0.03, 0.03, 0.04, 0.9)))
    assert refusal is not None and "reduces" in refusal
    assert share_refusal(group(members, (0.2, 0.2, 0.1, 0.5))) is None  # 2 equal shares: allowed


@pytest.mark.parametrize(("claim", "most"), [
    (HONEST, 10.0),  # the stall timeout
    (1e12, 10.0),
    (1.0, 4 * (CHUNK * 4 * 4 + (4 << 20)) / (HONEST / SPREAD)),  # a member 8x slower: seconds
])
def test_stall_allowances_come_from_bounded_figures(claim: float, most: float) -> None:
    members = [member(name, c) for name, c in zip("abcd", [HONEST] * 3 + [claim], strict=True)]
    allowance = stall_allowance(group(members, (0.25,) * 4), 3, 10.0)
    assert 10.0 <= allowance <= most + 1e-9
    # unbounded, a claimed 1 B/s waited (4 chunks of 16 KiB + 4 MiB) x 4 / 1e3 B/s = 4.7 hours


def test_an_all_slow_group_still_has_a_floor() -> None:
    members = [member(name, 1.0) for name in "abcd"]
    expected = 4 * (CHUNK * 4 * 4 + (4 << 20)) / ALLOWANCE_FLOOR_RATE
    assert stall_allowance(group(members, (0.25,) * 4), 0, 10.0) == pytest.approx(expected)


claims = st.floats(1.0, 1e13)


@settings(max_examples=60, deadline=None)
@given(st.lists(claims, min_size=2, max_size=9),
       st.lists(st.one_of(st.none(), st.floats(1.0, 1e12)), min_size=9, max_size=9),
       st.lists(st.sampled_from(["trainer", "trainer", "aux", "client"]), min_size=9, max_size=9))
def test_every_honest_leaders_split_is_taken(claims: list[float], rates: list[float | None],
                                             roles: list[str]) -> None:
    """Tolerant by construction: whatever the claims and whatever the leader measured, its split
    keeps the public caps (followers never refuse an honest group for its shares)."""
    members = [member(f"p{i}", c, roles[i] if i else "trainer") for i, c in enumerate(claims)]
    measured = {m.peer_id: r for m, r in zip(members, rates, strict=False) if r is not None}
    fractions = split(members, "p0", measured)
    assert share_refusal(group(members, fractions)) is None
    for fraction, cap in zip(fractions, share_caps(members), strict=True):
        assert fraction <= cap * (1 + 1e-9)


def test_rates_measured_in_a_round() -> None:
    members = [member(name, HONEST) for name in "abcd"]
    g = group(members, (0.25,) * 4)
    quarter = SIZE // 4 * 4  # bytes of one part
    # member a: sent three parts and got them back, reduced its own for three senders
    transfers = {"b": PeerTransfer(2 * quarter, 2 * quarter, 0.5),
                 "c": PeerTransfer(2 * quarter, 2 * quarter, 1.0),
                 "d": PeerTransfer(2 * quarter, 2 * quarter, 0.5)}
    report = AllReduceReport("g", 2.0, 6 * quarter, 6 * quarter, transfers, ((0, SIZE),), (), (), {})
    rates = measured_rates(g, 0, report)
    load = (0.75 + 0.25 * 3) * SIZE * 4  # each way: its three parts out, its part to 3 senders
    assert rates == pytest.approx({"b": load / 0.5, "c": load / 1.0, "d": load / 0.5})
    failed = dataclasses.replace(report, failures=(PartFailure(SIZE // 2, SIZE, "d", "stalled"),))
    assert measured_rates(g, 0, failed)["d"] == pytest.approx(load / 2.0)  # the whole round
    tiny = dataclasses.replace(report, transfers={"b": PeerTransfer(1000, 1000, 0.5)})
    assert measured_rates(g, 0, tiny) == {}  # latency, not bandwidth


def test_peer_rates_move_towards_new_samples_and_stay_bounded() -> None:
    rates = PeerRates(half_life_samples=1.0, max_peers=2)
    assert rates.observe("a", 100.0) == 100.0
    assert rates.observe("a", 50.0) == 75.0
    rates.observe("b", 1.0)
    rates.observe("c", 1.0)
    assert rates.get("a") is None and len(rates) == 2
    assert rates.snapshot(["b", "z"]) == {"b": 1.0}
    with pytest.raises(ValueError):
        rates.observe("b", float("nan"))


def test_a_measured_peer_counts_for_its_claim_or_its_rate_but_not_below_its_peers() -> None:
    members = [member(name, claim) for name, claim in zip("abcd", [HONEST] * 3 + [4 * HONEST], strict=True)]
    plan = leader_plan(members, "a", {"b": HONEST / 2, "c": HONEST, "d": 2 * HONEST})
    assert plan.claims_cut == 1
    assert [m.upload for m in plan.members] == [HONEST, HONEST, HONEST, 2 * HONEST]
    plan = leader_plan(members, "a", {"b": HONEST / 2, "c": HONEST, "d": HONEST / 4})
    assert [m.upload for m in plan.members] == [HONEST] * 4  # d: the median of a, b and c


def test_a_group_of_two_gives_a_measured_liar_no_more_than_the_leader() -> None:
    """With two members the median is halfway to the liar's claim; its typical figure is the
    leader's alone."""
    members = [member("a", HONEST), member("d", 1e12)]
    fractions = split(members, "a", {"d": HONEST})
    assert fractions[1] <= 0.5 + 1e-9, fractions


def test_rounds_paced_by_latency_keep_every_honest_member_a_part() -> None:
    """Rounds that latency or a busy CPU paces: every transfer lasts the round, so a leader
    measures each member at the load it gave it (a smaller part reads slower), and one member's
    transfers were slow once. Led in turn by the three trainers, with a client sending, every
    trainer keeps reducing its third, round after round (cut by such rates, each leader, counted
    for its own claim, took the two thirds its cap allows and the others split the rest by the
    parts they had been given: one chunk or less for one of them)."""
    size, chunk = 9 * CHUNK + 1234, CHUNK
    members = [member("a", HONEST), member("b", HONEST), member("c", HONEST),
               member("d", HONEST, "client")]
    rates = {name: PeerRates() for name in "abc"}
    for round_index in range(12):
        leader = "abc"[round_index % 3]
        plan = leader_plan(members, leader, rates[leader].snapshot(m.peer_id for m in members))
        bounds = to_part_bounds(solve_shares(plan.members, size * 4, plan.caps).fractions, size, chunk)
        g = Group("g", "k", tuple(members), size, bounds, chunk, "none", 1e9)
        assert all(end - start > 2 * chunk for start, end in bounds[:3]), bounds  # 3 of 10 chunks
        for index, name in enumerate("abc"):
            fractions = [(end - start) / size for start, end in bounds]
            own = ((1 - fractions[index]) + 3 * fractions[index]) * size * 4  # bytes each way
            slow = 1.5 if round_index == 0 and name != "b" else 1.0  # b's transfers, once
            transfers = {m.peer_id: PeerTransfer(MIN_BYTES_EACH, MIN_BYTES_EACH,
                                                 slow if m.peer_id == "b" else 1.0)
                         for m in members if m.peer_id != name}
            report = AllReduceReport("g", 1.5, int(own), int(own), transfers, ((0, size),), (), (), {})
            for peer_id, rate in measured_rates(g, index, report).items():
                rates[name].observe(peer_id, rate)


def test_an_honest_split_with_a_short_last_chunk_is_taken() -> None:
    """A member at its cap may get one chunk more than its fraction of the chunks, all of them
    full though the vector's last one is short: followers allow that (they refused it)."""
    members = [member("a", 5e7), *(member(name, 1e7) for name in "bcde")]
    size, chunk = 710, 100
    plan = leader_plan(members, "a", {})
    bounds = to_part_bounds(solve_shares(plan.members, size * 4, plan.caps).fractions, size, chunk)
    assert bounds[0][1] - bounds[0][0] == 400  # 4 of 8 chunks: more than 0.4 x 710 + 100
    assert share_refusal(Group("g", "k", tuple(members), size, bounds, chunk, "none", 1e9)) is None
