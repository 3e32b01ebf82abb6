"""A stranger opens hundreds of `avg.part` streams for groups that do not exist (yet): each such
stream waits a while for its round, and the slots for waiting streams are shared by every round.
One peer may hold only a few of them: the rest are refused at once, and an honest round that
starts meanwhile still gets every stream it needs, with the exact weighted mean. Several
identities together can hold every slot: an honest sender whose stream comes before the round
has started at its reducer then takes over the oldest slot of the identity holding the most (once
it is old enough: net/admission.py), and the stranger's stream is dropped as RoundNotStarted;
while every slot is young, the honest sender is refused and opens the stream again until it
gets one or the round has started there. Either way the round averages every part."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from averaging.test_allreduce import close, clusters, make_group, vectors, weighted  # noqa: F401
from net.netutil import wait_until

from dedloc.daemon.averaging import allreduce
from dedloc.daemon.averaging.wire import METHOD, StreamOpen, says_not_started
from dedloc.daemon.net import StreamAborted


async def _waiting_streams(opener: Any, victim: str, prefix: str, count: int, *,
                           seconds: float) -> list[Any]:
    """`count` streams from `opener` to `victim` for rounds nobody forms, announcing a deadline
    `seconds` away."""
    return [await opener.open_stream(victim, METHOD,
                                     StreamOpen(f"{prefix}-{i}", 0, 1.0, time.time() + seconds).header(),
                                     timeout=5)
            for i in range(count)]


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


@pytest.mark.parametrize("evict_after", [0.0, 1e6], ids=["taken_over", "young_slots"])
async def test_strangers_holding_every_waiting_slot_do_not_keep_an_early_sender_out(
        clusters: Any, monkeypatch: Any, evict_after: float) -> None:  # noqa: F811
    monkeypatch.setattr(allreduce, "_MAX_WAITING_STREAMS", 8)
    monkeypatch.setattr(allreduce, "_MAX_WAITING_PER_PEER", 4)
    monkeypatch.setattr(allreduce, "_WAITING_EVICT_AFTER", evict_after)
    cluster = await clusters(5, arrival_grace=30.0)
    attackers, victim = cluster.transports[3:], cluster.ids[2]
    held = [await attacker.open_stream(victim, METHOD,
                                       StreamOpen(f"never-{a}-{i}", 0, 1.0, time.time() + 60).header(),
                                       timeout=5)
            for a, attacker in enumerate(attackers) for i in range(4)]
    service = cluster.services[2]
    await wait_until(lambda: service.waiting_streams == 8)

    # the honest three: the victim starts its round late, so the others' streams to it come first
    # and find every waiting slot taken
    weights = [1.0, 2.0, 3.0]
    group = make_group(cluster.ids[:3], weights=weights)
    vecs = vectors(3, group.size)
    expected = weighted(vecs, weights, range(3))
    counter = "streams_evicted_waiting" if evict_after == 0.0 else "streams_refused_all_waiting"

    async def late() -> Any:
        await wait_until(lambda: service.counters[counter] >= 2, timeout=30)
        return await service.run(group, 2, vecs[2], weights[2])

    reports = await asyncio.gather(cluster.services[0].run(group, 0, vecs[0], weights[0]),
                                   cluster.services[1].run(group, 1, vecs[1], weights[1]), late())
    assert all(r.ok for r in reports), [r.failures for r in reports]
    assert all(close(v, expected) for v in vecs)
    reopened = sum(cluster.services[i].counters["streams_reopened_not_started"] for i in (0, 1))
    if evict_after == 0.0:
        # the honest streams took two of the strangers' slots at once: nobody had to ask again,
        # and the strangers' dropped streams were told why
        assert reopened == 0
        assert service.counters["streams_refused_all_waiting"] == 0
        receiving = [asyncio.ensure_future(stream.receive(timeout=60)) for stream in held]
        await wait_until(lambda: sum(task.done() for task in receiving) >= 2, timeout=30)
        dropped = [task.exception() for task in receiving if task.done()]
        assert len(dropped) == 2
        assert all(isinstance(exc, StreamAborted) and says_not_started(exc)
                   and "went to another peer" in str(exc) for exc in dropped), dropped
        for task in receiving:
            task.cancel()
        await asyncio.gather(*receiving, return_exceptions=True)
        assert service.waiting_streams == 6
    else:
        assert reopened >= 2
        assert service.waiting_streams == 8  # the strangers' streams still wait, for nothing
    for stream in held:
        await stream.abort("done")


async def test_a_stream_about_to_expire_takes_no_slot_from_a_waiting_one(
        clusters: Any, monkeypatch: Any) -> None:  # noqa: F811
    """A stream whose announced deadline is a moment away would drop a waiter and leave at
    once, again and again, holding nothing: it may only take a free slot. One whose deadline
    has passed gets none."""
    monkeypatch.setattr(allreduce, "_MAX_WAITING_STREAMS", 4)
    monkeypatch.setattr(allreduce, "_MAX_WAITING_PER_PEER", 4)
    monkeypatch.setattr(allreduce, "_WAITING_EVICT_AFTER", 0.5)
    cluster = await clusters(3, arrival_grace=30.0)
    holder, newcomer, victim = cluster.transports[0], cluster.transports[1], cluster.ids[2]
    service = cluster.services[2]
    held = await _waiting_streams(holder, victim, "held", 4, seconds=60)
    await wait_until(lambda: service.waiting_streams == 4, timeout=30)
    await asyncio.sleep(0.6)  # every slot is now old enough to be taken over (a lower bound)

    async def refusal(deadline: float) -> str:
        stream = await newcomer.open_stream(victim, METHOD,
                                            StreamOpen("brief", 0, 1.0, deadline).header(), timeout=5)
        try:
            await stream.receive(timeout=30)
        except StreamAborted as exc:
            return str(exc)
        return "answered"

    # (on a loaded machine its deadline may have passed by the time it is read: refused too)
    brief = await refusal(time.time() + 0.4)
    assert "streams already wait" in brief or "deadline has passed" in brief, brief
    assert "deadline has passed" in await refusal(time.time() - 1.0)
    assert service.waiting_streams == 4 and service.counters["streams_evicted_waiting"] == 0
    # a stream that will wait as long as the slot it takes has been held does take it over
    stream = await newcomer.open_stream(victim, METHOD,
                                        StreamOpen("lasting", 0, 1.0, time.time() + 60).header(),
                                        timeout=5)
    await wait_until(lambda: service.counters["streams_evicted_waiting"] == 1, timeout=30)
    assert service.waiting_streams == 4
    await stream.abort("done")
    for s in held:
        await s.abort("done")


async def test_a_stream_its_sender_aborts_frees_its_waiting_slot_at_once(clusters: Any) -> None:  # noqa: F811
    """A waiting stream is not read until its round starts; when its sender aborts it (or the
    link ends), its slot is freed then, not when its wait (here 60 s) runs out."""
    cluster = await clusters(2, arrival_grace=60.0)
    sender, victim = cluster.transports[0], cluster.ids[1]
    service = cluster.services[1]
    streams = await _waiting_streams(sender, victim, "later", 4, seconds=120)
    await wait_until(lambda: service.waiting_streams == 4, timeout=30)
    for stream in streams[:3]:
        await stream.abort("changed my mind")
    await wait_until(lambda: service.waiting_streams == 1, timeout=30)  # (its wait: 60 s)
    assert service.counters["streams_refused"] == 3
    await streams[3].abort("done")
    await wait_until(lambda: service.waiting_streams == 0, timeout=30)


async def test_a_waiter_whose_wait_just_ended_is_no_victim_of_a_take_over(monkeypatch: Any) -> None:
    """A waiter whose task was cancelled (its wait timed out) still holds its slot until that
    task runs; a stream admitted in between may pick it to take over. Its future is cancelled
    by then: the take-over frees the slot and counts nothing (it used to raise)."""
    monkeypatch.setattr(allreduce, "_MAX_WAITING_STREAMS", 1)
    monkeypatch.setattr(allreduce, "_WAITING_EVICT_AFTER", 0.0)
    loop = asyncio.get_running_loop()

    class Transport:
        peer_id = "reducer"

        def add_stream_handler(self, method: str, handler: Any) -> None:
            self.handler = handler  # (the test calls _wait_for_round itself)

        def add_unary_handler(self, method: str, handler: Any) -> None:
            self.unary = handler  # (avg.accuse: no accusation comes here)

    class QuietStream:  # (never fails)
        def failure(self) -> asyncio.Future[Any]:
            return loop.create_future()

    service = allreduce.AllReduceService(Transport(), arrival_grace=60.0)  # type: ignore[arg-type]
    try:
        def opened(group: str) -> StreamOpen:
            return StreamOpen(group, 0, 1.0, time.time() + 120)

        first = asyncio.create_task(service._wait_for_round(opened("g1"), "a", QuietStream()))  # type: ignore[arg-type]
        await wait_until(lambda: service.waiting_streams == 1, timeout=30)
        second = asyncio.create_task(service._wait_for_round(opened("g2"), "b", QuietStream()))  # type: ignore[arg-type]
        first.cancel()  # its future is cancelled now; its task runs after `second`'s first step
        with pytest.raises(asyncio.CancelledError):
            await first
        await wait_until(lambda: service.waiting_streams == 1, timeout=30)  # `second` waits
        assert service.counters["streams_evicted_waiting"] == 0
        assert not second.done()
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert service.waiting_streams == 0
    finally:
        service.close()


async def test_closing_the_service_ends_every_wait(clusters: Any) -> None:  # noqa: F811
    cluster = await clusters(2, arrival_grace=60.0)
    service = cluster.services[1]
    streams = await _waiting_streams(cluster.transports[0], cluster.ids[1], "never", 3, seconds=120)
    await wait_until(lambda: service.waiting_streams == 3, timeout=30)
    service.close()
    assert service.waiting_streams == 0
    for stream in streams:  # each is told, not left to its 60 s wait
        with pytest.raises(StreamAborted, match="closing"):
            await stream.receive(timeout=30)
