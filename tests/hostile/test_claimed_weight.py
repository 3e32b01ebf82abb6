"""A member claims an averaging weight of 1e15 (samples it never computed) to make the round's
weighted mean its own vector. A round's weight is bounded by what an honest peer can have (in a
run: WEIGHT_SLACK target batches, room for one batch past the target; 1 in a state round): the
leader refuses such a joiner, a follower a group that lists one, and the honest peers average
without it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.matchmaking import Matchmaker, RoundRequest
from dedloc.daemon.averaging.round_request import group_refusal, ranked

from .test_hostile_leader import NOW, REQUEST, _group, _halves

pytestmark = pytest.mark.virtual_time
TARGET = 4096.0


def test_a_group_listing_a_heavier_member_than_the_round_allows_is_refused() -> None:
    request = dataclasses.replace(REQUEST, max_weight=TARGET)
    honest = _group()
    assert group_refusal(honest, request, NOW) is None
    heavy = dataclasses.replace(honest.members[0], weight=1e15)
    refusal = group_refusal(_group(members=(heavy, honest.members[1])), request, NOW)
    assert refusal is not None and "weight of 1e+15" in refusal


@pytest.mark.parametrize("attacker_leads", [False, True])
async def test_a_member_claiming_1e15_samples_averages_with_nobody(attacker_leads: bool) -> None:
    """Joining an honest leader, the attacker is refused and the honest three average together;
    leading, its group is refused by every honest follower (that round is lost to them: each
    then averages alone, never with the attacker's weight)."""
    swarm = Swarm()
    for _ in range(4):
        await swarm.add()
    try:
        makers = [Matchmaker(t, n, _halves) for t, n in zip(swarm.transports, swarm.nodes,
                                                           strict=True)]
        *honest, attacker = makers
        ids = [m.peer_id for m in makers]
        key = next(k for k in (f"run/grad/{n}" for n in range(1000))
                   if (ranked(k, ids)[0] == attacker.peer_id) == attacker_leads)

        def request(maker: Matchmaker, weight: float, limit: float | None) -> RoundRequest:
            member = Member(maker.peer_id, "trainer", weight, 1e7, 1e7, True)
            return RoundRequest(key, member, size=10_000, chunk_elements=1000,
                                compression="none", window=2.0, deadline=timebase.now() + 30,
                                expected=4, max_weight=limit)

        began, formed_at = timebase.now(), []

        async def form(maker: Matchmaker) -> Group:
            group = await maker.form_group(request(maker, 1000.0, TARGET))
            formed_at.append(timebase.now() - began)
            return group

        groups = await asyncio.gather(*(form(m) for m in honest),
                                      attacker.form_group(request(attacker, 1e15, None)))
        *honest_groups, _ = groups
        for group in honest_groups:
            assert attacker.peer_id not in {m.peer_id for m in group.members}
            assert all(m.weight <= TARGET for m in group.members)
        if attacker_leads:
            assert sum(m.refused_groups for m in honest) == 3
            # the round fails and runs again under the same key, the attacker first again: each
            # refusal is an offence; after the second, the honest three avoid it (it sent them no
            # group they could take, twice: avoided_leaders.py) and meet without it
            await asyncio.gather(*(form(m) for m in honest),
                                 attacker.form_group(request(attacker, 1e15, None)))
            assert all(m.avoided.avoided(timebase.now()) == {attacker.peer_id} for m in honest)
            assert all(m._bans.counters["offences_group"] == 2 for m in honest)
            again = await asyncio.gather(*(form(m) for m in honest),
                                         attacker.form_group(request(attacker, 1e15, None)))
            assert len({g.group_id for g in again[:3]}) == 1 and len(again[0].members) == 3
            assert attacker.peer_id not in {m.peer_id for m in again[0].members}
            # once the avoidance runs out it leads them again: a third offence, and the ban
            await asyncio.sleep(honest[0].avoided.avoid_seconds)
            await asyncio.gather(*(form(m) for m in honest),
                                 attacker.form_group(request(attacker, 1e15, None)))
            assert all(m._bans.banned(attacker.peer_id) for m in honest)
        else:  # the honest three found each other (one group, not three averaging alone)
            assert len({g.group_id for g in honest_groups}) == 1
            assert len(honest_groups[0].members) == 3
            # and the leader did not wait the window out for the peer it refused (virtual time)
            assert max(formed_at) < 2.0, formed_at
    finally:
        await swarm.close()
