"""A stranger opens hundreds of `avg.part` streams for groups that do not exist (yet): each such
stream waits a while for its round, and the slots for waiting streams are shared by every round.
One peer may hold only a few of them: the rest are refused at once, and an honest round that
starts meanwhile still gets every stream it needs, with the exact weighted mean. Several
identities together can hold every slot: an honest sender whose stream comes before the round has
started at its reducer is then refused as RoundNotStarted and opens the stream again until the
round has started there, so the round still averages every part."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from averaging.test_allreduce import close, clusters, make_group, vectors, weighted  # noqa: F401
from net.netutil import wait_until

from dedloc.daemon.averaging import allreduce
from dedloc.daemon.averaging.wire import METHOD, StreamOpen, says_not_started
from dedloc.daemon.net import StreamAborted


async def test_a_stranger_holds_a_few_waiting_slots_and_the_round_goes_on(clusters: Any) -> None:  # noqa: F811
    cluster = await clusters(4, arrival_grace=30.0)
    attacker, victim = cluster.transports[3], cluster.ids[1]
    streams = [await attacker.open_stream(victim, METHOD,
                                          StreamOpen(f"not-yet-{i}", 0, 1.0, time.time() + 60).header(),
                                          timeout=5)
               for i in range(300)]

    async def outcome(stream: Any) -> str:
        try:
            await stream.receive(timeout=2.0)
        except StreamAborted as exc:
            return "refused" if "already has" in str(exc) and says_not_started(exc) else f"aborted: {exc}"
        except TimeoutError:
            return "waiting"
        return "answered"

    outcomes = await asyncio.gather(*(outcome(s) for s in streams))
    assert outcomes.count("waiting") == allreduce._MAX_WAITING_PER_PEER, set(outcomes)
    assert outcomes.count("refused") == 300 - allreduce._MAX_WAITING_PER_PEER
    service = cluster.services[1]
    assert service.counters["streams_refused_peer_waiting"] == 300 - allreduce._MAX_WAITING_PER_PEER

    # the honest three average as if nothing happened (while the attacker's streams still wait)
    group = make_group(cluster.ids[:3], weights=[1.0, 2.0, 3.0])
    vecs = vectors(3, group.size)
    expected = weighted(vecs, [1.0, 2.0, 3.0], range(3))
    reports = await asyncio.gather(*(cluster.services[i].run(group, i, vecs[i], w)
                                     for i, w in enumerate([1.0, 2.0, 3.0])))
    assert all(r.ok for r in reports)
    assert all(close(v, expected) for v in vecs)
    assert np.isfinite(vecs[0]).all()


async def test_strangers_holding_every_waiting_slot_only_delay_an_early_sender(
        clusters: Any, monkeypatch: Any) -> None:  # noqa: F811
    monkeypatch.setattr(allreduce, "_MAX_WAITING_STREAMS", 8)
    monkeypatch.setattr(allreduce, "_MAX_WAITING_PER_PEER", 4)
    cluster = await clusters(5, arrival_grace=30.0)
    attackers, victim = cluster.transports[3:], cluster.ids[2]
    held = [await attacker.open_stream(victim, METHOD,
                                       StreamOpen(f"never-{a}-{i}", 0, 1.0, time.time() + 60).header(),
                                       timeout=5)
            for a, attacker in enumerate(attackers) for i in range(4)]
    service = cluster.services[2]
    await wait_until(lambda: service._arrival_waiters.total() == 8)

    # the honest three: the victim starts its round late, so the others' streams to it come first
    # and find every waiting slot taken
    weights = [1.0, 2.0, 3.0]
    group = make_group(cluster.ids[:3], weights=weights)
    vecs = vectors(3, group.size)
    expected = weighted(vecs, weights, range(3))

    async def late() -> Any:
        await wait_until(lambda: service.counters["streams_refused_all_waiting"] >= 2)
        return await service.run(group, 2, vecs[2], weights[2])

    reports = await asyncio.gather(cluster.services[0].run(group, 0, vecs[0], weights[0]),
                                   cluster.services[1].run(group, 1, vecs[1], weights[1]), late())
    assert all(r.ok for r in reports), [r.failures for r in reports]
    assert all(close(v, expected) for v in vecs)
    assert sum(cluster.services[i].counters["streams_reopened_not_started"] for i in (0, 1)) >= 2
    assert service._arrival_waiters.total() == 8  # the strangers' streams still wait, for nothing
    for stream in held:
        await stream.abort("done")
