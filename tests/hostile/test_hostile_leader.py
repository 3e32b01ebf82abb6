"""A leader is just another peer: the group it sends is checked against what the follower asked
for before the follower averages in it (avg.group). Pure checks of `group_refusal`, then a
hostile leader over the in-memory DHT whose followers go on without it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.matchmaking import RoundRequest, group_refusal

NOW = 1_000_000.0
ME = Member("peer-b", "trainer", 32.0, 1e7, 1e7, True)
LEADER = Member("peer-a", "trainer", 32.0, 1e7, 1e7, True)
REQUEST = RoundRequest("run/grad/3", ME, size=10_000, chunk_elements=1000, compression="none",
                       window=2.0, deadline=NOW + 30, max_group_size=8)


def _group(**changes: Any) -> Group:
    members = changes.pop("members", (LEADER, ME))
    bounds = changes.pop("part_bounds", tuple(
        (i * 10_000 // len(members), (i + 1) * 10_000 // len(members)) for i in range(len(members))))
    group = Group("g", REQUEST.key, members, 10_000, bounds, 1000, "none", NOW + 30)
    return dataclasses.replace(group, **changes)


def test_a_group_id_a_follower_would_remember_is_bounded() -> None:
    """Followers remember 8192 group ids: one of 64 KiB (a whole frame header) each would be
    512 MiB held for one leader's groups."""
    wire = _group().to_json()
    for bad in ("", "x" * 129, 5, None):
        with pytest.raises(ValueError, match="group id"):
            Group.from_json({**wire, "group_id": bad})
    assert Group.from_json({**wire, "group_id": "x" * 128}).group_id == "x" * 128


def test_the_group_asked_for_is_taken() -> None:
    assert group_refusal(_group(), REQUEST, NOW) is None
    clipping = dataclasses.replace(REQUEST, aggregation="norm_clip")
    assert group_refusal(_group(aggregation="norm_clip"), clipping, NOW) is None
    # a leader of an earlier version names no aggregation: its group averages by the mean
    old = {k: v for k, v in _group().to_json().items() if k != "aggregation"}
    assert Group.from_json(old).aggregation == "mean"
    assert "not what was asked" in (group_refusal(Group.from_json(old), clipping, NOW) or "")
    with pytest.raises(ValueError, match="unknown aggregation"):
        Group.from_json({**old, "aggregation": "median"})
    assert group_refusal(_group(deadline=NOW + 50), REQUEST, NOW) is None  # a later start: fine


@pytest.mark.parametrize(("changes", "reason"), [
    ({"deadline": 1e308}, "deadline"),  # freezes the round
    ({"deadline": NOW - 1}, "deadline"),
    ({"chunk_elements": 1}, "chunks of 1"),  # a million chunks: memory and CPU
    ({"compression": "fp16"}, "not what was asked"),
    # a leader whose reducers would answer by another rule than the one this member checks
    ({"aggregation": "norm_clip"}, "not what was asked"),
    ({"size": 20_000, "part_bounds": ((0, 10_000), (10_000, 20_000))}, "not what was asked"),
    ({"members": (LEADER, dataclasses.replace(ME, weight=1e15))}, "own entry"),
    ({"members": (LEADER, dataclasses.replace(ME, role="aux", weight=0.0))}, "own entry"),
    ({"members": (LEADER, ME, LEADER)}, "twice"),
    ({"members": (*(dataclasses.replace(LEADER, peer_id=f"p{i}") for i in range(1024)), ME)},
     "more than any group holds"),
])
def test_a_group_other_than_asked_is_refused(changes: dict[str, Any], reason: str) -> None:
    refusal = group_refusal(_group(**changes), REQUEST, NOW)
    assert refusal is not None and reason in refusal, refusal


@pytest.mark.virtual_time
async def test_followers_refuse_a_frozen_group_and_go_on_without_its_leader() -> None:
    import asyncio

    from dht.swarm import Swarm

    from dedloc.daemon import timebase
    from dedloc.daemon.averaging.matchmaking import GROUP, JOIN, Matchmaker
    from dedloc.daemon.net import Message, RemoteError

    swarm = Swarm()
    for _ in range(3):
        await swarm.add()
    try:
        attacker = swarm.transports[2]
        makers = [Matchmaker(t, n, _halves) for t, n in zip(swarm.transports[:2], swarm.nodes[:2],
                                                           strict=True)]
        refused: list[str] = []

        async def send_frozen_group(joiner: Member, key: str) -> None:
            await asyncio.sleep(0.2)
            me = Member(attacker.peer_id, "trainer", 32.0, 1e7, 1e7, True)
            members = tuple(sorted((me, joiner), key=lambda m: m.peer_id))
            group = Group("frozen", key, members, 10_000, ((0, 5_000), (5_000, 10_000)), 1000,
                          "none", 1e308)
            try:
                await attacker.call(joiner.peer_id, GROUP, Message({"group": group.to_json()}),
                                    timeout=5)
            except RemoteError as exc:
                refused.append(exc.message)

        async def on_join(ctx: Any, message: Message) -> Message:
            joiner = Member.from_json(message.header["member"])
            asyncio.get_running_loop().create_task(send_frozen_group(joiner, message.header["key"]))
            return Message({"accepted": True})

        attacker.add_unary_handler(JOIN, on_join)
        peers = (attacker.peer_id, *(m.peer_id for m in makers))

        def request(maker: Matchmaker) -> RoundRequest:
            member = Member(maker.peer_id, "trainer", 32.0, 1e7, 1e7, True)
            return RoundRequest("run/grad/7", member, size=10_000, chunk_elements=1000,
                                compression="none", window=2.0, deadline=timebase.now() + 30,
                                peers=peers, leaders=(attacker.peer_id,))

        groups = await asyncio.gather(*(m.form_group(request(m)) for m in makers))
        for group in groups:
            assert attacker.peer_id not in {m.peer_id for m in group.members}
            assert group.deadline < 1e308
            group.check()
        assert [m.refused_groups for m in makers] == [1, 1]
        assert len(refused) == 2 and all("deadline" in r for r in refused)
    finally:
        await swarm.close()


def _halves(members: tuple[Member, ...], size: int, chunk: int) -> tuple[tuple[int, int], ...]:
    share = -(-size // len(members))
    return tuple((min(size, i * share), min(size, (i + 1) * share)) for i in range(len(members)))


async def test_an_id_seen_before_is_an_offence_only_of_the_leader_that_sent_it_first() -> None:
    """Group ids are refused when seen again (so that no two rounds here share one). A leader
    that sends an id it sent before replays a round: an offence. A leader that sends an id
    another leader sent first may be honest (a member of its round can copy the id to us
    first): refused all the same, but no offence, so a copier cannot get honest leaders banned."""
    import time

    from averaging.fake_transport import HandlerTransport

    from dedloc.daemon.averaging.bans import BanList
    from dedloc.daemon.averaging.matchmaking import Matchmaker, MatchmakingError
    from dedloc.daemon.net import Message, RequestContext

    bans = BanList()
    maker = Matchmaker(HandlerTransport(ME.peer_id), None, _halves, bans=bans)  # type: ignore[arg-type]
    copier = dataclasses.replace(LEADER, peer_id="peer-c")

    async def deliver(leader: Member, key: str, group_id: str) -> None:
        deadline = time.time() + 30
        request = dataclasses.replace(REQUEST, key=key, deadline=deadline)
        maker._gatherings.begin(request).leader = leader.peer_id
        group = dataclasses.replace(_group(members=(leader, ME)), key=key, group_id=group_id,
                                    deadline=deadline)
        await maker._methods.on_group(RequestContext(leader.peer_id), Message({"group": group.to_json()}))

    await deliver(copier, "run/grad/4", "honest-id")  # the copy comes first
    with pytest.raises(MatchmakingError, match=r"seen before .*who copied whose is unknown"):
        await deliver(LEADER, "run/grad/3", "honest-id")
    assert bans.counters["offences"] == 0 and maker.refused_groups == 1
    await deliver(LEADER, "run/grad/5", "another-id")
    with pytest.raises(MatchmakingError, match="seen before"):  # its own id again: a replay
        await deliver(LEADER, "run/grad/6", "another-id")
    assert bans.counters["offences_group"] == 1


async def test_a_follower_takes_only_a_group_its_leader_signed() -> None:
    """Leaders sign the group they send (signatures.sign_group) and followers with an identity
    check it: a group with another peer's signature, or the leader's signature of another
    group, is refused as an offence; an unsigned one (a leader of an earlier dedloc) is refused
    without one. The group taken carries its leader and signature on, into the all-reduce's
    chunks (the proof, should the leader sign another group under this id)."""
    import time

    from averaging.fake_transport import HandlerTransport

    from dedloc.daemon.averaging.bans import BanList
    from dedloc.daemon.averaging.matchmaking import Matchmaker, MatchmakingError
    from dedloc.daemon.averaging.signatures import round_name, sign_group
    from dedloc.daemon.identity import Identity
    from dedloc.daemon.net import Message, RequestContext

    mine, leader_key, other_key = Identity.generate(), Identity.generate(), Identity.generate()
    me = dataclasses.replace(ME, peer_id=mine.peer_id)
    leader = dataclasses.replace(LEADER, peer_id=leader_key.peer_id)
    bans = BanList()
    maker = Matchmaker(HandlerTransport(me.peer_id, mine), None, _halves, bans=bans)  # type: ignore[arg-type]
    ids = iter(range(100))

    async def deliver(sign: Any) -> Group:
        deadline, key = time.time() + 30, f"run/grad/{next(ids)}"
        request = dataclasses.replace(REQUEST, member=me, key=key, deadline=deadline)
        gathering = maker._gatherings.begin(request)
        gathering.leader = leader.peer_id
        group = dataclasses.replace(_group(members=(leader, me)), key=key, deadline=deadline,
                                    group_id=f"id-{key}")
        header: dict[str, Any] = {"group": group.to_json()}
        if sign is not None:
            header["signature"] = sign(group)
        await maker._methods.on_group(RequestContext(leader.peer_id), Message(header))
        return gathering.group.result()

    with pytest.raises(MatchmakingError, match=r"not signed .*earlier dedloc"):
        await deliver(None)
    assert bans.counters["offences"] == 0
    with pytest.raises(MatchmakingError, match="not signed by its leader"):
        await deliver(lambda g: sign_group(other_key, g.group_id, round_name(g)))
    with pytest.raises(MatchmakingError, match="not signed by its leader"):  # another group's
        await deliver(lambda g: sign_group(leader_key, g.group_id, round_name(
            dataclasses.replace(g, deadline=g.deadline + 1))))
    assert bans.counters["offences_group"] == 2 and maker.refused_groups == 3
    taken = await deliver(lambda g: sign_group(leader_key, g.group_id, round_name(g)))
    assert taken.leader == leader.peer_id
    assert taken.leader_signature == sign_group(leader_key, taken.group_id, round_name(taken))
