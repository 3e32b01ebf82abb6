"""A stranger opens hundreds of `avg.part` streams for groups that do not exist (yet): each such
stream waits a while for its round, and the slots for waiting streams are shared by every round.
One peer may hold only a few of them: the rest are refused at once, and an honest round that
starts meanwhile still gets every stream it needs, with the exact weighted mean."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from averaging.test_allreduce import close, clusters, make_group, vectors, weighted  # noqa: F401

from dedloc.daemon.averaging import allreduce
from dedloc.daemon.averaging.wire import METHOD, StreamOpen
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
            return "refused" if "already has" in str(exc) else f"aborted: {exc}"
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
