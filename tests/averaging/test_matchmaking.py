"""Matchmaking through the DHT on a MemoryNetwork: one group, the same for every member."""

from __future__ import annotations

import asyncio
import time

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.averaging.group import Member
from dedloc.daemon.averaging.matchmaking import Matchmaker, RoundRequest

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
            expected: int | None = None) -> RoundRequest:
    member = Member(peer_id, role, 0.0 if role == "aux" else 1.0, 1e7, 1e7, reachable)  # type: ignore[arg-type]
    return RoundRequest(key, member, size=10_000, chunk_elements=1000, compression="none",
                        window=window, deadline=timebase.now() + 30, expected=expected)


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
    await silent._announce(request(silent.peer_id, "run/round-3", window=2.0), timebase.now() + 2.0)
    swarm.network.blackhole(silent.peer_id)
    others = by_id[1:6]
    started = time.monotonic()
    groups = await asyncio.gather(*(m.form_group(request(m.peer_id, "run/round-3", window=2.0))
                                    for m in others))
    assert time.monotonic() - started < 30  # bounded: returned, not stuck
    assert len({g.group_id for g in groups}) == 1
    assert {m.peer_id for m in groups[0].members} == {m.peer_id for m in others}
