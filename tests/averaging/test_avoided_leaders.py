"""A leader that failed us twice in a row is ranked last for a while (the hostage attack), without
splitting honest peers that follow it.

The hostage: a hostile identity ranks first to lead a round's key, the honest peers that banned
it form their own group, and one that has not banned it follows it, and loses its answers round
after round (docs/security.md). The matchmaking scenarios run on a MemoryNetwork on virtual time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.averaging.avoided_leaders import (
    FAILURES_TO_AVOID,
    INTRODUCED_GROUPS,
    MAX_CHAIN,
    MAX_REMEMBERED,
    AvoidedLeaders,
    leader_failed_us,
)
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.matchmaking import JOIN, Matchmaker, RoundRequest
from dedloc.daemon.averaging.report import AllReduceReport, PartFailure
from dedloc.daemon.averaging.round_request import ranked
from dedloc.daemon.net import Message

from .test_matchmaking import equal_split

pytestmark = pytest.mark.virtual_time  # windows and timeouts on virtual time, whatever the load

# The rule ------------------------------------------------------------------------------------

def test_a_leader_is_avoided_after_two_failures_in_a_row_and_for_longer_each_time() -> None:
    avoided = AvoidedLeaders(avoid_seconds=100.0, max_avoid_seconds=350.0)
    assert avoided.failed("L", 0.0) is False and avoided.avoided(0.0) == frozenset()
    assert avoided.failed("L", 1.0) is True
    assert avoided.avoided(1.0) == {"L"} and avoided.avoided(100.9) == {"L"}
    assert avoided.avoided(101.0) == frozenset() and avoided.times_avoided == 1
    # failing while avoided (a redirect took us there) does not stretch it
    assert avoided.failed("L", 50.0) is False and avoided.until("L") == 101.0
    # once over, one more failure avoids it again, twice as long; then at most the cap
    assert avoided.failed("L", 200.0) is True and avoided.until("L") == 400.0
    assert avoided.failed("L", 500.0) is True and avoided.until("L") == 850.0
    assert avoided.times_avoided == 3


def test_a_good_round_forgets_the_failures_and_another_leaders_failures_are_its_own() -> None:
    avoided = AvoidedLeaders()
    for _ in range(5):  # failed, served, failed, ...: never two in a row
        assert avoided.failed("L", 0.0) is False
        avoided.served("L")
    assert avoided.failed("L", 0.0) is False and avoided.failed("M", 0.0) is False
    assert avoided.avoided(0.0) == frozenset()
    assert avoided.failed("L", 0.0) is True and avoided.avoided(0.0) == {"L"}
    avoided.served("L")  # a good round it led ends the avoidance and its doubling
    assert avoided.avoided(0.0) == frozenset()
    avoided.failed("L", 0.0)
    assert avoided.failed("L", 0.0) is True and avoided.until("L") == avoided.avoid_seconds


def test_a_forgiven_leader_is_avoided_again_at_its_next_failure_for_twice_as_long() -> None:
    avoided = AvoidedLeaders(avoid_seconds=10.0)
    avoided.failed("L", 0.0)
    avoided.failed("L", 0.0)
    avoided.forgive("L")
    assert avoided.avoided(0.0) == frozenset()
    assert avoided.failed("L", 1.0) is True and avoided.until("L") == 21.0


def test_the_avoided_rank_last_in_their_order() -> None:
    avoided = AvoidedLeaders()
    for peer in ("a", "c", "c", "a"):
        avoided.failed(peer, 0.0)
    assert avoided.ranked(["a", "b", "c", "d"], 0.0) == ["b", "d", "a", "c"]
    assert avoided.ranked(["a", "b"], 10_000.0) == ["a", "b"]


def test_free_identities_do_not_grow_what_is_remembered() -> None:
    avoided = AvoidedLeaders()
    for i in range(3 * MAX_REMEMBERED):
        for _ in range(FAILURES_TO_AVOID):
            avoided.failed(f"id-{i}", 0.0)
    assert len(avoided._failures) == MAX_REMEMBERED
    assert len(avoided._until) <= MAX_REMEMBERED and len(avoided._avoidances) <= MAX_REMEMBERED
    assert f"id-{3 * MAX_REMEMBERED - 1}" in avoided.avoided(0.0)


def _group(leader: str, peers: str = "abc") -> Group:
    members = tuple(Member(p, "trainer", 1.0, 1e7, 1e7) for p in peers)
    bounds = tuple((100 * i, 100 * i + 100) for i in range(len(peers)))
    return Group("g" * 64, "k", members, 100 * len(peers), bounds, 50, "none", 1e12,
                 leader=leader)


def test_those_that_sent_us_to_a_failing_leader_share_its_blame_along_a_bounded_chain() -> None:
    avoided = AvoidedLeaders()
    group = _group("a", "abcdefghijklmnopqrs")
    # a sent by b, b by c, c back by b (a cycle), and a chain longer than is followed
    avoided.note_introducers(group, {"a": "b", "b": "c", "c": "b"}, own_id="z")
    for _ in range(FAILURES_TO_AVOID):
        now_avoided = avoided.group_failed(group, 0.0)
        avoided.note_introducers(group, {"a": "b", "b": "c", "c": "b"}, own_id="z")
    assert sorted(now_avoided) == ["a", "b", "c"]
    long_chain = {chr(ord("a") + i): chr(ord("a") + i + 1) for i in range(17)}
    other = dataclasses.replace(group, group_id="h" * 64)
    fresh = AvoidedLeaders()
    fresh.note_introducers(other, long_chain, own_id="z")
    assert len(fresh._introducers[other.group_id]) == MAX_CHAIN
    # our own id ends the chain (we do not blame ourselves), and a served round forgives all
    fresh.note_introducers(other, {"a": "b", "b": "z", "z": "c"}, own_id="z")
    assert fresh._introducers[other.group_id] == ("b",)
    avoided.group_served(group)
    assert avoided.avoided(0.0) == frozenset()
    # the groups remembered are bounded whatever ids the redirects name
    for i in range(3 * INTRODUCED_GROUPS):
        fresh.note_introducers(dataclasses.replace(group, group_id=f"{i:064x}"), {"a": f"x{i}"},
                               own_id="z")
    assert len(fresh._introducers) == INTRODUCED_GROUPS


def _report(failures: tuple[PartFailure, ...] = (), excluded: dict[str, str] | None = None
            ) -> AllReduceReport:
    return AllReduceReport("g" * 64, 1.0, 0, 0, {}, ((0, 300),), tuple((f.start, f.end) for f in failures),
                           failures, excluded or {})


def test_what_counts_as_the_leader_failing_us() -> None:
    assert leader_failed_us(_group("a"), _report((PartFailure(0, 100, "a", "skip"),)))
    assert leader_failed_us(_group("a"), _report(excluded={"a": "no chunks"}))
    # another member's failure is not the leader's, nor is a clean round
    assert not leader_failed_us(_group("a"), _report((PartFailure(100, 200, "b", "timeout"),),
                                                     {"c": "no chunks"}))
    assert not leader_failed_us(_group("a"), _report())
    # a group of just the leader and us, too small to be stepped on (a well-behaved hostage
    # taker), fails us too; a larger group too small is nobody's fault (late peers)
    assert leader_failed_us(_group("a", "ab"), _report(), min_trainers=3)
    assert not leader_failed_us(_group("a", "ab"), _report(), min_trainers=2)
    assert not leader_failed_us(_group("a"), _report(), min_trainers=4)
    assert not leader_failed_us(_group(""), _report((PartFailure(0, 100, "a", "skip"),)))
    assert not leader_failed_us(_group("z"), _report((PartFailure(0, 100, "z", "skip"),)))


# Matchmaking ---------------------------------------------------------------------------------


@pytest.fixture
async def swarm():  # type: ignore[no-untyped-def]
    swarm = Swarm()
    for _ in range(4):
        await swarm.add()
    yield swarm
    await swarm.close()


def _direct(peer_id: str, key: str, peers: list[str]) -> RoundRequest:
    member = Member(peer_id, "trainer", 1.0, 1e7, 1e7, True)
    return RoundRequest(key, member, size=10_000, chunk_elements=1000, compression="none",
                        window=2.0, deadline=timebase.now() + 60, expected=len(peers),
                        peers=tuple(p for p in peers if p != peer_id))


def _key_ranking(ids: list[str], first: str, second: str | None = None, *,
                 not_second: str | None = None) -> str:
    """A round key under which `first` ranks first (and `second` second, or `not_second` not)."""
    for i in itertools.count():
        key = f"run/grad/{i}/x"
        order = ranked(key, ids)
        if order[0] == first and (second is None or order[1] == second) \
                and (not_second is None or order[1] != not_second):
            return key
    raise AssertionError("unreachable")


async def _round(makers: list[Matchmaker], key: str) -> dict[str, set[str]]:
    ids = [m.peer_id for m in makers]
    groups = await asyncio.gather(*(m.form_group(_direct(m.peer_id, key, ids)) for m in makers))
    return {m.peer_id: {x.peer_id for x in g.members} for m, g in zip(makers, groups, strict=True)}


@pytest.mark.parametrize("victim_ranks_second", [True, False])
async def test_a_follower_avoiding_the_leader_that_failed_it_joins_the_honest_peers_group(
        swarm: Swarm, victim_ranks_second: bool) -> None:
    """The hostage: the others banned the first-ranked identity; its follower, which has not,
    went to it every round. Having avoided it, it averages with the others. (Ranked second, it
    had sent the others on to the identity they banned, and they went: a redirect to a peer
    banned here is now refused.)"""
    bans = [BanList() for _ in swarm.transports]
    makers = [Matchmaker(t, n, equal_split, bans=b)
              for t, n, b in zip(swarm.transports, swarm.nodes, bans, strict=True)]
    ids = [m.peer_id for m in makers]
    hostile, victim = makers[0], makers[1]
    for ban in bans[2:]:
        ban.offence(hostile.peer_id, "answer", "proved", conclusive=True)
    for n in range(2):
        key = _key_ranking(ids, hostile.peer_id, victim.peer_id if victim_ranks_second else None,
                           not_second=None if victim_ranks_second else victim.peer_id)
        before = await _round(makers, key)
        if n == 0:  # held hostage: in the hostile leader's group, apart from the others
            assert before[victim.peer_id] == {hostile.peer_id, victim.peer_id}
            assert before[ids[2]] == before[ids[3]] == set(ids[2:])
            for _ in range(FAILURES_TO_AVOID):
                victim.avoided.failed(hostile.peer_id, timebase.now())
        else:
            assert before[victim.peer_id] == before[ids[2]] == set(ids[1:])
            assert before[hostile.peer_id] == {hostile.peer_id}


@pytest.mark.parametrize("victim_ranks_second", [True, False])
async def test_avoiding_an_honest_leader_the_others_follow_costs_at_most_one_round(
        swarm: Swarm, victim_ranks_second: bool) -> None:
    """Only this peer's link to the leader failed twice; the others follow that leader. Ranked
    right after it, this peer leads, alone, once: then the avoidance ends. Ranked after one of
    the others, it is sent to the leader by that one, and all average together."""
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    ids = [m.peer_id for m in makers]
    leader, me = makers[0], makers[1]
    for _ in range(FAILURES_TO_AVOID):
        me.avoided.failed(leader.peer_id, timebase.now())
    key = _key_ranking(ids, leader.peer_id, me.peer_id if victim_ranks_second else None,
                       not_second=None if victim_ranks_second else me.peer_id)
    groups = await _round(makers, key)
    if victim_ranks_second:
        assert groups[me.peer_id] == {me.peer_id}
        assert groups[leader.peer_id] == {p for p in ids if p != me.peer_id}
        assert me.avoided.avoided(timebase.now()) == frozenset()
        groups = await _round(makers, key + "/again")  # (a key it need not rank second under)
    else:
        assert me.avoided.avoided(timebase.now()) == {leader.peer_id}
    assert all(members == set(ids) for members in groups.values())


async def test_the_peer_that_sent_us_to_a_leader_that_failed_us_shares_the_blame(
        swarm: Swarm) -> None:
    """An accomplice that redirects us back to the avoided leader counts as failing us too: the
    next time it is avoided as well."""
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports, swarm.nodes, strict=True)]
    ids = [m.peer_id for m in makers]
    leader, me = makers[0], makers[1]
    for _ in range(FAILURES_TO_AVOID):
        me.avoided.failed(leader.peer_id, timebase.now())
    key = _key_ranking(ids, leader.peer_id, not_second=me.peer_id)
    second = ranked(key, ids)[1]
    me.avoided.failed(second, timebase.now())  # (it failed us once before)
    groups = await asyncio.gather(*(m.form_group(_direct(m.peer_id, key, ids)) for m in makers))
    mine = groups[1]
    assert mine.leader == leader.peer_id and {m.peer_id for m in mine.members} == set(ids)
    # the round it led failed us: the leader (avoided already) and the one that sent us there,
    # now avoided too
    assert me.leader_failed(mine) == [second]
    assert me.avoided.avoided(timebase.now()) == {leader.peer_id, second}


async def test_a_candidate_that_stalls_us_does_not_end_the_avoidance_of_its_accomplice(
        swarm: Swarm) -> None:
    """An identity ranked right after the avoided one takes our join and never sends a group:
    we end the round alone, but not because the others follow the avoided leader, so it stays
    avoided (and the staller has failed us once)."""
    makers = [Matchmaker(t, n, equal_split) for t, n in zip(swarm.transports[:3], swarm.nodes[:3],
                                                            strict=True)]
    staller = swarm.transports[3]

    async def take_and_stall(ctx: object, message: Message) -> Message:
        return Message({"accepted": True})

    staller.add_unary_handler(JOIN, take_and_stall)
    ids = [*(m.peer_id for m in makers), staller.peer_id]
    hostile, me = makers[0], makers[1]
    for _ in range(FAILURES_TO_AVOID):
        me.avoided.failed(hostile.peer_id, timebase.now())
    key = _key_ranking(ids, hostile.peer_id, staller.peer_id)
    group = await me.form_group(_direct(me.peer_id, key, ids))
    assert len(group.members) == 1
    assert me.avoided.avoided(timebase.now()) == {hostile.peer_id}
    assert me.avoided._failures[staller.peer_id] == 1


def test_the_averager_tells_matchmaking_how_each_round_its_leader_led_went() -> None:
    """averager.py's glue: a round led by another peer is judged (failed or served, with the
    round's min_trainers); a round we led, or one without a leader, is not."""
    from types import SimpleNamespace

    from dedloc.daemon.averaging.averager import Averager

    calls: list[tuple[str, str]] = []
    maker = SimpleNamespace(leader_failed=lambda g: calls.append(("failed", g.leader)),
                            leader_served=lambda g: calls.append(("served", g.leader)))
    me = SimpleNamespace(peer_id="b", matchmaker=maker)
    failing = _report((PartFailure(0, 100, "a", "skip"),))
    Averager._judge_leader(me, _group("a"), failing, 1)  # type: ignore[arg-type]
    Averager._judge_leader(me, _group("a"), _report(), 1)  # type: ignore[arg-type]
    Averager._judge_leader(me, _group("a", "ab"), _report(), 3)  # type: ignore[arg-type]
    Averager._judge_leader(me, _group("b"), failing, 1)  # type: ignore[arg-type]  (ours)
    Averager._judge_leader(me, _group(""), failing, 1)  # type: ignore[arg-type]
    assert calls == [("failed", "a"), ("served", "a"), ("failed", "a")]
