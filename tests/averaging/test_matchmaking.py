"""Matchmaking through the DHT on a MemoryNetwork: one group, the same for every member."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.averaging.aggregation import Aggregation
from dedloc.daemon.averaging.gatherings import OVER_ROUNDS, Gatherings
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.matchmaking import COMING, Matchmaker, RoundRequest
from dedloc.daemon.averaging.round_request import ranked
from dedloc.daemon.net import Message, RemoteError

pytestmark = pytest.mark.virtual_time  # windows and timeouts on virtual time, whatever the load


def equal_split(members: tuple[Member, ...], size: int, chunk: int) -> tuple[tuple[int, int], ...]:
    reducers = [i for i, m in enumerate(members) if m.can_reduce]
    chunks = -(-size // chunk)
    bounds, position = [], 0
    for i, _ in enumerate(members):
        if i in reducers:
            count = chunks // len(reducers) + (reducers.index(i) < chunks % len(reducers))
            end = min(size, position + count * chunk)
        else:
            end = position
        bounds.append((position, end))
        position = end
    return tuple(bounds)


@pytest.fixture
async def swarm():  # type: ignore[no-untyped-def]
    swarm = Swarm()
    for _ in range(8):
        await swarm.add()
    yield swarm
    await swarm.close()


def request(peer_id: str, key: str, *, role: str = "trainer", reachable: bool = True, window: float = 2.0,
            expected: int | None = None, aggregation: Aggregation = "mean") -> RoundRequest:
    member = Member(peer_id, role, 0.0 if role == "aux" else 1.0, 1e7, 1e7, reachable)  # type: ignore[arg-type]
    return RoundRequest(key, member, size=10_000, chunk_elements=1000, compression="none",
                        window=window, deadline=timebase.now() + 30, expected=expected,
                        aggregation=aggregation)


async def test_peers_form_one_group(swarm: Swarm) -> None:
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    groups = await asyncio.gather(*(m.form_group(request(m.peer_id, "run/round-1", expected=8))
                                    for m in makers))
    assert len({g.group_id for g in groups}) == 1
    group = groups[0]
    assert {m.peer_id for m in group.members} == {m.peer_id for m in makers}
    assert [m.peer_id for m in group.members] == sorted(m.peer_id for m in makers)
    assert all(g == group for g in groups)
    group.check()


async def test_the_group_carries_the_aggregation_and_only_peers_that_ask_for_it_join(
        swarm: Swarm) -> None:
    """Every member of a group checks its reducers against one rule: peers asking for another
    aggregation under the same key are not grouped with them."""
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    rules: list[Aggregation] = ["norm_clip"] * 5 + ["mean"] * 3
    groups = await asyncio.gather(*(
        m.form_group(request(m.peer_id, "run/round-a", expected=5 if rule == "norm_clip" else 3,
                             aggregation=rule))
        for m, rule in zip(makers, rules, strict=True)))
    for group, rule in zip(groups, rules, strict=True):
        assert group.aggregation == rule
        assert all(rules[[m.peer_id for m in makers].index(member.peer_id)] == rule
                   for member in group.members)
    assert len({g.group_id for g in groups[:5]}) == 1 and len(groups[0].members) == 5


async def test_roles_and_a_late_start(swarm: Swarm) -> None:
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    requests = [request(m.peer_id, "run/round-2", window=1.5) for m in makers[:5]]
    requests[1] = request(makers[1].peer_id, "run/round-2", role="client", reachable=False, window=1.5)
    requests[2] = request(makers[2].peer_id, "run/round-2", role="aux", window=1.5)
    groups = await asyncio.gather(*(m.form_group(r) for m, r in zip(makers, requests, strict=False)))
    assert len({g.group_id for g in groups}) == 1
    group = groups[0]
    client = group.index_of(makers[1].peer_id)
    assert group.part_bounds[client][0] == group.part_bounds[client][1]  # a client reduces nothing
    # A peer that comes after the group closed averages alone instead of waiting forever.
    late = await makers[6].form_group(request(makers[6].peer_id, "run/round-2", window=0.5))
    assert len(late.members) == 1 and late.part_bounds == ((0, 10_000),)


async def test_a_silent_leader_does_not_deadlock(swarm: Swarm) -> None:
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    by_id = sorted(makers, key=lambda m: m.peer_id)
    silent = by_id[0]  # the would-be leader announces itself, then goes silent
    await silent._announcements.announce(request(silent.peer_id, "run/round-3", window=2.0),
                                         timebase.now() + 2.0)
    swarm.network.blackhole(silent.peer_id)
    others = by_id[1:6]
    started = time.monotonic()
    groups = await asyncio.gather(*(m.form_group(request(m.peer_id, "run/round-3", window=2.0))
                                    for m in others))
    assert time.monotonic() - started < 30  # bounded: returned, not stuck
    assert len({g.group_id for g in groups}) == 1
    assert {m.peer_id for m in groups[0].members} == {m.peer_id for m in others}


async def test_a_peer_still_asking_a_silent_leader_takes_the_joins_sent_to_it(swarm: Swarm) -> None:
    # The first-ranked peer announces itself and goes silent; the second-ranked one reads the
    # key a moment after the others, so it still waits on the silent one when they have given
    # up on it and ask it. It used to send them back to the silent one (a second second lost
    # each), and the round split: it led one group, the third-ranked another.
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:6]
    key = "run/round-4"
    order = ranked(key, [m.peer_id for m in makers])
    by_id = {m.peer_id: m for m in makers}
    silent, second = by_id[order[0]], by_id[order[1]]
    await silent._announcements.announce(request(silent.peer_id, key, window=2.0), timebase.now() + 2.0)
    swarm.network.blackhole(silent.peer_id)
    others = [by_id[p] for p in order[2:]]

    async def later(maker: Matchmaker) -> Group:
        await asyncio.sleep(0.3)
        return await maker.form_group(request(maker.peer_id, key, window=2.0))

    groups = await asyncio.gather(later(second), *(m.form_group(request(m.peer_id, key, window=2.0))
                                                   for m in others))
    assert len({g.group_id for g in groups}) == 1
    assert {m.peer_id for m in groups[0].members} == set(order[1:])


async def test_joins_taken_while_the_last_leader_is_silent_are_led_not_stranded(swarm: Swarm) -> None:
    for _ in range(4):
        await swarm.add()
    # B sees eight peers ranked before it: seven that are in no round (they refuse at once) and
    # a silent one, its last try. C and D, which see only the silent one and B, ask B while it
    # waits on the silent one; B takes their joins. Its tries used up, it went on alone holding
    # them, and they waited out their window for a group that never came (all three alone)
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    key = "run/round-5"
    order = ranked(key, [m.peer_id for m in makers])
    by_id = {m.peer_id: m for m in makers}
    silent, (b, c, d) = order[7], (by_id[p] for p in order[8:11])
    await by_id[silent]._announcements.announce(request(silent, key, window=2.0), timebase.now() + 2.0)
    swarm.network.blackhole(silent)

    async def sees_all_before_it(req: RoundRequest, window_end: float) -> tuple[dict[str, Member], float]:
        await asyncio.sleep(max(0.0, window_end - timebase.now()))
        seen = {p: Member(p, "trainer", 1.0, 1e7, 1e7, True) for p in order[:8]}
        return {**seen, b.peer_id: req.member}, timebase.now()

    b._announcements.gather = sees_all_before_it  # type: ignore[method-assign]

    async def later(maker: Matchmaker) -> Group:
        await asyncio.sleep(0.4)
        return await maker.form_group(request(maker.peer_id, key, window=2.0))

    groups = await asyncio.gather(later(b), *(m.form_group(request(m.peer_id, key, window=2.0))
                                              for m in (c, d)))
    assert len({g.group_id for g in groups}) == 1
    assert {m.peer_id for m in groups[0].members} == {b.peer_id, c.peer_id, d.peer_id}


def direct(peer_id: str, key: str, peers: list[str], window: float = 2.0,
           staged: bool = True) -> RoundRequest:
    """A direct round (by default a grid stage's): the caller names the peers it expects."""
    member = Member(peer_id, "trainer", 1.0, 1e7, 1e7, True)
    return RoundRequest(key, member, size=10_000, chunk_elements=1000, compression="none",
                        window=window, deadline=timebase.now() + 60, expected=len(peers),
                        peers=tuple(p for p in peers if p != peer_id), staged=staged)


async def _late(maker: Matchmaker, seconds: float, req: RoundRequest, on_its_way: bool,
                never: bool = False) -> Group | None:
    """`maker` reaches the round `seconds` late: still in an earlier stage (`on_its_way`), or
    not in the round at all until then; or (`never`) it does not come after all."""
    with maker.coming([req.key] if on_its_way else []):
        await asyncio.sleep(seconds)
        return None if never else await maker.form_group(req)


@pytest.mark.parametrize("on_its_way", [True, False])
async def test_a_direct_round_waits_for_its_leader_only_while_it_is_on_its_way(
        swarm: Swarm, on_its_way: bool) -> None:
    # the leader comes 6 s late, past the others' window (2 s) and grace: while it says it is in
    # an earlier stage of the round they wait for it; a leader that says nothing is skipped
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grid/m1/0.x", [m.peer_id for m in makers[:4]]
    leader = next(m for m in makers if m.peer_id == ranked(key, ids)[0])
    others = [m for m in makers if m is not leader]
    groups = await asyncio.gather(_late(leader, 6.0, direct(leader.peer_id, key, ids), on_its_way),
                                  *(m.form_group(direct(m.peer_id, key, ids)) for m in others))
    if on_its_way:
        assert len({g.group_id for g in groups}) == 1
        assert {m.peer_id for m in groups[0].members} == set(ids)
    else:  # the others averaged without it, and it came to a closed round: alone
        assert {m.peer_id for m in groups[1].members} == {m.peer_id for m in others}
        assert len(groups[0].members) == 1


@pytest.mark.parametrize("agreeing", [True, False])
async def test_a_slice_waits_for_a_leader_still_agreeing_on_its_grid_rounds_roster(
        swarm: Swarm, agreeing: bool) -> None:
    # the slice's leader spends 6 s agreeing on the grid round's roster (collab/rounds.py):
    # it does not know its stages yet, only the round (`coming_under` its prefix). The others
    # wait for it; before, they gave up after one window and averaged apart from it (seen in
    # the simulator: one peer of a slice alone, the round's slices stepped 1.7e-4 apart)
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grid/m0/x.0", [m.peer_id for m in makers]
    leader = next(m for m in makers if m.peer_id == ranked(key, ids)[0])
    others = [m for m in makers if m is not leader]

    async def late() -> Group:
        with leader.coming_under("run/grid/") if agreeing else contextlib.nullcontext():
            await asyncio.sleep(6.0)
        return await leader.form_group(direct(leader.peer_id, key, ids))

    groups = await asyncio.gather(late(), *(m.form_group(direct(m.peer_id, key, ids)) for m in others))
    if agreeing:
        assert len({g.group_id for g in groups}) == 1
        assert {m.peer_id for m in groups[0].members} == set(ids)
    else:
        assert len(groups[0].members) == 1


def test_a_peer_agreeing_on_a_roster_is_coming_under_that_rounds_keys_only(swarm: Swarm) -> None:
    maker = Matchmaker(swarm.transports[0], swarm.nodes[0], equal_split)
    with maker.coming_under("run/grid/"), maker.coming_under("run/grid/"):
        assert maker._gatherings.will_gather("run/grid/m1/3.x")
        assert not maker._gatherings.will_gather("run/other/m0/x.0")
    assert not maker._gatherings.will_gather("run/grid/m1/3.x")


async def test_a_follower_whose_patience_ran_out_joins_a_late_leader_the_others_follow(
        swarm: Swarm) -> None:
    # the first-ranked leader begins 2.2 s late (it says nothing meanwhile); the last-ranked peer
    # asked it from the start and gave up after one window (2 s), the two others came 1 s later
    # and are still asking when it begins: they join it and send the first one there. It had
    # asked that leader already; it asks again instead of averaging alone (seen in the simulator:
    # one peer of a grid cell alone, the cell's average off by 1.5e-4)
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grid/m0/x.2", [m.peer_id for m in makers]
    order = [next(m for m in makers if m.peer_id == p) for p in ranked(key, ids)]
    leader, middle, first = order[0], order[1:3], order[3]
    groups = await asyncio.gather(
        _late(leader, 2.2, direct(leader.peer_id, key, ids, staged=False), False),
        *(_late(m, 1.0, direct(m.peer_id, key, ids, staged=False), False) for m in middle),
        first.form_group(direct(first.peer_id, key, ids, staged=False)))
    assert all(g is not None for g in groups)
    assert len({g.group_id for g in groups if g is not None}) == 1, [
        len(g.members) for g in groups if g is not None]
    assert {m.peer_id for m in groups[0].members} == set(ids)  # type: ignore[union-attr]


@pytest.mark.parametrize("on_its_way", [True, False])
async def test_a_leader_waits_past_its_window_only_for_a_member_on_its_way(
        swarm: Swarm, on_its_way: bool) -> None:
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grid/m1/3.x", [m.peer_id for m in makers[:4]]
    order = ranked(key, ids)
    late = next(m for m in makers if m.peer_id == order[-1])  # a member, not the leader
    others = [m for m in makers if m is not late]
    # 9 s: past what the members that joined at once would wait for a group without it (window,
    # grace and grace again: 7 s), within the round's latest gathering (10.5 s)
    groups = await asyncio.gather(_late(late, 9.0, direct(late.peer_id, key, ids), on_its_way),
                                  *(m.form_group(direct(m.peer_id, key, ids)) for m in others))
    members = {m.peer_id for m in groups[1].members}
    assert all(g.group_id == groups[1].group_id for g in groups[1:])
    if on_its_way:
        assert groups[0].group_id == groups[1].group_id and members == set(ids)
    else:
        assert members == {m.peer_id for m in others} and len(groups[0].members) == 1


@pytest.mark.parametrize("leaves_after", [3.0, None])
async def test_a_leader_that_said_it_was_coming_and_never_comes_costs_one_regrouping(
        swarm: Swarm, leaves_after: float | None) -> None:
    # it says "on my way" and then leaves its round (3 s), or says it until the round's latest
    # gathering (a hostile peer): the others go on without it as one group, with time to regroup
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grid/m1/5.x", [m.peer_id for m in makers]
    leader = next(m for m in makers if m.peer_id == ranked(key, ids)[0])
    others = [m for m in makers if m is not leader]
    started = timebase.now()
    _, *groups = await asyncio.gather(
        _late(leader, leaves_after or 30.0, direct(leader.peer_id, key, ids), True, never=True),
        *(m.form_group(direct(m.peer_id, key, ids)) for m in others))
    assert all(g is not None and g.group_id == groups[0].group_id for g in groups)
    assert {m.peer_id for m in groups[0].members} == {m.peer_id for m in others}
    if leaves_after is not None:  # once it left, nobody waited for it to the latest gathering
        assert timebase.now() - started < 10.0


async def test_a_direct_round_that_is_no_grid_stage_waits_for_nobody_past_its_window(
        swarm: Swarm) -> None:
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grad/3", [m.peer_id for m in makers]
    late = next(m for m in makers if m.peer_id == ranked(key, ids)[-1])
    others = [m for m in makers if m is not late]
    groups = await asyncio.gather(
        _late(late, 9.0, direct(late.peer_id, key, ids, staged=False), True),
        *(m.form_group(direct(m.peer_id, key, ids, staged=False)) for m in others))
    assert {m.peer_id for m in groups[1].members} == {m.peer_id for m in others}
    assert groups[0] is not None and len(groups[0].members) == 1


async def test_asking_whether_a_peer_comes_needs_a_key_and_tells_the_truth(swarm: Swarm) -> None:
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:2]
    asker, asked = swarm.transports[0], makers[1]

    async def coming(key: object) -> bool:
        reply = await asker.call(asked.peer_id, COMING, Message({"key": key}), timeout=5)
        return reply.header["coming"] is True

    assert not await coming("run/grid/m1/1.x")
    with asked.coming(["run/grid/m1/1.x"]):
        assert await coming("run/grid/m1/1.x")
        assert not await coming("run/grid/m1/2.x")
    assert not await coming("run/grid/m1/1.x")
    with pytest.raises(RemoteError, match="needs a key"):
        await coming(["not", "a", "key"])


@pytest.mark.parametrize("stepped_past", [True, False])
async def test_a_peer_late_to_a_round_the_others_stepped_past_is_told_at_once(
        swarm: Swarm, stepped_past: bool) -> None:
    # a newcomer loads the state just as the others average (seen in the simulator's 64-peer
    # churn: it asked a grid stage's leaders one after another, each "not gathering", patient
    # with each for a window, 26 s in one stage, and fell two epochs behind). Leaders that have
    # stepped past the round say so, and it averages alone at once (its round fails; it looks
    # at the run again and catches up)
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)][:4]
    key, ids = "run/grad/7/ab/m1/2.x", [m.peer_id for m in makers]
    late = next(m for m in makers if m.peer_id == ranked(key, ids)[-1])
    others = [m for m in makers if m is not late]
    groups = await asyncio.gather(*(m.form_group(direct(m.peer_id, key, ids)) for m in others))
    assert {m.peer_id for m in groups[0].members} == {m.peer_id for m in others}
    if stepped_past:
        for maker in others:
            maker.round_over("run/grad/7/ab")
    started = timebase.now()
    group = await late.form_group(direct(late.peer_id, key, ids))
    assert len(group.members) == 1
    if stepped_past:
        assert timebase.now() - started < 0.5  # a few calls on virtual time, no window
        with pytest.raises(RemoteError) as refused:
            await swarm.transports[ids.index(late.peer_id)].call(
                others[0].peer_id, "avg.join", Message({"key": key}), timeout=5)
        assert refused.value.kind == "RoundOver"
    else:  # each leader was given its patience, as one not begun yet
        assert timebase.now() - started >= 2.0


def test_rounds_over_are_remembered_by_prefix_boundedly_and_a_new_gathering_reopens_one() -> None:
    gatherings = Gatherings()
    gatherings.over("run/grad/3/ab")
    assert gatherings.is_over("run/grad/3/ab") and gatherings.is_over("run/grad/3/ab/m0/x.1")
    assert not gatherings.is_over("run/grad/3/abc") and not gatherings.is_over("run/grad/4/ab")
    for epoch in range(OVER_ROUNDS):
        gatherings.over(f"run/grad/{100 + epoch}/ab")
    assert not gatherings.is_over("run/grad/3/ab")  # the oldest forgotten
    assert gatherings.is_over(f"run/grad/{100 + OVER_ROUNDS - 1}/ab/m1/0.x")

    async def begin() -> None:  # (a gathering holds futures of the running loop)
        gatherings.begin(direct("peer", "run/grad/100/ab/m0/x.0", ["peer", "other"]))

    asyncio.run(begin())
    assert not gatherings.is_over("run/grad/100/ab")
