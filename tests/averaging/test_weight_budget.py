"""A sender's weight in a round is bounded by the round's budget (Group.bounded_weights): at most
its share of the budget by the trainers it stands for. A run's gradient rounds give WEIGHT_BUDGET
(16) epochs' samples, the same on every peer (the manifest's), so every member computes the same
weights from the group whatever it believes of the run. An identity claiming samples it never
computed (identities cost nothing) made the weighted mean its own vector up to 8 target batches,
8/9 of a round. Two first tries were dropped: a bound by fair shares of the target as each peer
counts the trainers refused honest peers whose views differed (a review), and a bound by the
group's median weight changed honest rounds where one trainer did 12 times what the others did
(the equivalence test)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from averaging import test_allreduce
from averaging.test_allreduce import make_group, vectors, weighted

from dedloc.daemon.averaging.group import Group, Member

clusters = test_allreduce.clusters  # the fixture: real transports on 127.0.0.1


def _group(weights: list[float], represents: list[int] | None = None,
           roles: list[str] | None = None) -> Group:
    represents = represents or [1] * len(weights)
    roles = roles or ["trainer"] * len(weights)
    members = tuple(Member(f"peer-{i}", role, w, 1e6, 1e6, represents=r)  # type: ignore[arg-type]
                    for i, (w, r, role) in enumerate(zip(weights, represents, roles, strict=True)))
    return Group("g", "k", members, 10, tuple((0, 10) if i == 0 else (10, 10)
                                              for i in range(len(members))), 10, "none", 0.0)


@pytest.mark.parametrize(("claims", "budget", "weights"), [
    ([1.0, 1.0, 1e15], 24.0, [1.0, 1.0, 8.0]),  # 1e15: a third of the budget
    ([32.0, 384.0, 32.0], 8 * 192.0, [32.0, 384.0, 32.0]),  # honest skew under the budget
    ([1.0, 100.0], 8.0, [1.0, 4.0]),
    ([5.0], 1.0, [1.0]),
    ([5.0, 7.0], None, [5.0, 7.0]),  # no budget (a local caller): as claimed
])
def test_a_sender_weighs_at_most_its_share_of_the_budget(
        claims: list[float], budget: float | None, weights: list[float]) -> None:
    assert _group(claims).bounded_weights(budget) == tuple(weights)


def test_a_grid_stage_shares_the_budget_by_the_trainers_a_member_stands_for() -> None:
    # a stage of a grid round: one member's vector averages a slice of 4 trainers, two of 1
    group = _group([4.0, 1.0, 1.0], represents=[4, 1, 1])
    assert group.bounded_weights(12.0, max_represents=4) == (4.0, 1.0, 1.0)
    group = _group([400.0, 1.0, 1.0], represents=[4, 1, 1])
    assert group.bounded_weights(12.0, max_represents=4) == (8.0, 1.0, 1.0)


def test_a_member_that_says_it_stands_for_many_trainers_counts_as_many_as_the_round_allows() -> None:
    # A review found: the count was the member's word, so one that said 65536 took 99.95 % of a
    # flat round's budget (16 honest members were left 0.00024 targets each)
    claims, represents = [256.0] * 16 + [32768.0], [1] * 16 + [65536]
    weights = _group(claims, represents=represents).bounded_weights(16 * 4096.0)
    assert weights[:16] == (256.0,) * 16 and weights[16] == 16 * 4096.0 / 17
    staged = _group([400.0, 1.0, 1.0], represents=[65536, 1, 1]).bounded_weights(12.0, 4)
    assert staged == (8.0, 1.0, 1.0)


def test_aux_peers_and_the_averaged_total_follow_the_bound() -> None:
    group = _group([0.0, 1.0, 1.0, 1e9], roles=["aux", "trainer", "trainer", "trainer"])
    weights = group.bounded_weights(30.0)
    assert weights == (0.0, 1.0, 1.0, 10.0)
    assert group.averaged(weights=weights) == (12.0, 3)
    assert group.averaged(excluded=["peer-3"], weights=weights) == (2.0, 2)


async def test_a_claimed_weight_of_1e9_counts_as_its_share_of_the_budget(clusters: Any) -> None:
    cluster = await clusters(4)
    claims = [1.0, 1.0, 1.0, 1e9]
    group = make_group(cluster.ids, weights=claims)
    vecs = vectors(4, group.size)
    expected = weighted(vecs, [1.0, 1.0, 1.0, 2.0], range(4))  # (1e9 made it member 3's vector)
    reports = await asyncio.gather(*(
        cluster.services[i].run(group, i, vecs[i], claims[i], weight_budget=8.0) for i in range(4)))
    for i, report in enumerate(reports):
        assert not report.failed_parts and not report.senders_excluded, report
        np.testing.assert_allclose(vecs[i], expected, rtol=1e-5, atol=1e-5)
