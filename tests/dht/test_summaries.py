"""Reads at a key's remembered nodes: one node sends the entries, the others a summary.

A run's progress board is one key that every peer writes and reads several times an epoch; a
read asks three of its nodes, and each sent the whole board (at 256 simulated peers, encoding and
decoding those replies was a third of the simulation's CPU). Now the first node asked sends the
entries and the others a summary (a digest of each sub-key and its expiration), and only what a
summary holds newer than the entries is fetched from its node. On an in-memory DHT, on virtual
time: a node's news is still read, a hostile or malformed summary costs a fetch or a lookup, not
the read, and a node of an older version that sends entries for a summary is read as before. A
read `by_route` whose route has expired looks up the key's nodes, not its entries, and then
reads them the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.dht import DHTNode, Entry, key_id_of, node_id_of
from dedloc.daemon.dht import protocol as wire
from dedloc.daemon.net import Message, RequestContext

pytestmark = pytest.mark.virtual_time

KEY = "run/progress"
WRITERS = 12


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    swarm = Swarm()
    for _ in range(16):
        await swarm.add()
    for node in swarm.nodes[:WRITERS]:
        await node.store(KEY, b"report of " + node.peer_id.encode(), timebase.now() + 30,
                         sub_key=node.peer_id)
    yield swarm
    await swarm.close()


def _holders(swarm: Swarm) -> list[DHTNode]:
    key_id = key_id_of(KEY)
    return sorted(swarm.nodes, key=lambda n: node_id_of(n.peer_id) ^ key_id)[:8]


def _reader(swarm: Swarm) -> DHTNode:
    holders = _holders(swarm)
    return next(n for n in swarm.nodes if n not in holders)


Asked = list[tuple[str, dict[str, Any], Message]]


def _record_requests(swarm: Swarm, node: DHTNode, asked: Asked) -> None:
    """Note every find_value `node` answers: (which node, the request's header, the reply)."""

    async def recorded(ctx: RequestContext, message: Message) -> Message:
        reply = await node._on_find_value(ctx, message)
        asked.append((node.peer_id, dict(message.header), reply))
        return reply

    swarm.transports[swarm.nodes.index(node)].add_unary_handler(wire.FIND_VALUE, recorded)


def _values(record: Any) -> dict[str, bytes]:
    return {entry.sub_key: entry.value for entry in record.entries}


async def test_one_node_sends_the_entries_the_others_a_summary_and_news_is_fetched(
        swarm: Swarm) -> None:
    holders, reader = _holders(swarm), _reader(swarm)
    assert await reader.get(KEY) is not None  # (learns the key's route: its 8 nodes, closest first)
    route = reader._routes.held(key_id_of(KEY))
    assert [c.peer_id for c in route] == [h.peer_id for h in holders]
    # a writer's newer report reached only the third node of the route
    writer = swarm.nodes[0]
    newer = Entry.create(writer.identity, KEY, b"newer report", timebase.now() + 40,
                         sub_key=writer.peer_id)
    assert holders[2].storage.store(newer, timebase.now())
    asked: Asked = []
    for holder in holders:
        _record_requests(swarm, holder, asked)

    record = await reader.get(KEY, replicas=3, start=0)

    assert record is not None
    values = _values(record)
    assert len(values) == WRITERS and values[writer.peer_id] == b"newer report"
    by_node: dict[str, list[tuple[dict[str, Any], Message]]] = {}
    for peer, header, reply in asked:
        by_node.setdefault(peer, []).append((header, reply))
    assert set(by_node) == {h.peer_id for h in holders[:3]}
    # the first node sent the entries, without contacts
    [(header, reply)] = by_node[holders[0].peer_id]
    assert not header.get("summary") and header["nodes"] is False
    assert reply.header["entries"] == WRITERS and reply.header["nodes"] == []
    # the second a summary, and nothing else: it held nothing newer
    [(header, reply)] = by_node[holders[1].peer_id]
    assert header["summary"] is True and reply.header == {"nodes": [], "entries": 0, "summary": WRITERS}
    # the third a summary, then the one entry it holds newer
    (first, summary), (second, fetched) = by_node[holders[2].peer_id]
    assert first["summary"] is True and summary.header["summary"] == WRITERS
    assert second["want"] == [wire.sub_key_digest(writer.peer_id).hex()]
    assert fetched.header["entries"] == 1
    assert reader.stats["summary_fetches"] == 1
    # what travelled: the board once, plus two summaries of 16 bytes an entry and the news
    assert sum(reply.header.get("entries", 0) for _, _, reply in asked) == WRITERS + 1


async def test_a_hostile_summary_costs_a_fetch_and_a_malformed_one_a_lookup(swarm: Swarm) -> None:
    holders, reader = _holders(swarm), _reader(swarm)
    assert await reader.get(KEY) is not None
    liar = holders[1]
    fakes = [bytes([i]) * wire.SUMMARY_DIGEST for i in range(50)]  # sub-keys nobody wrote

    async def boasting(ctx: RequestContext, message: Message) -> Message:
        if message.header.get("summary"):  # every entry newer than anyone's, and 50 more
            held = [wire.sub_key_digest(n.peer_id) for n in swarm.nodes[:WRITERS]] + fakes
            return Message({"nodes": [], "entries": 0, "summary": len(held)},
                           b"".join(struct.pack(f">{wire.SUMMARY_DIGEST}sd", d, 1e300) for d in held))
        return wire.encode_values([], [])  # ... and then sends none of them

    swarm.transports[swarm.nodes.index(liar)].add_unary_handler(wire.FIND_VALUE, boasting)
    record = await reader.get(KEY, replicas=3, start=0)
    assert record is not None and len(_values(record)) == WRITERS  # (the first node's)
    assert reader.stats["summary_fetches"] == 1  # one fetch, whatever the summary named
    # it cannot hide another node's news either: what it did not deliver is asked of the next
    writer = swarm.nodes[0]
    newer = Entry.create(writer.identity, KEY, b"newer report", timebase.now() + 40,
                         sub_key=writer.peer_id)
    assert holders[2].storage.store(newer, timebase.now())
    record = await reader.get(KEY, replicas=3, start=0)
    assert record is not None and _values(record)[writer.peer_id] == b"newer report"
    assert reader.stats["summary_fetches"] == 1 + 2
    now = asyncio.get_running_loop().time()  # (nothing failed: the route is kept)
    assert reader._routes.get(key_id_of(KEY), 3, now) is not None

    async def malformed(ctx: RequestContext, message: Message) -> Message:
        return Message({"nodes": [], "entries": 0, "summary": 3}, b"\x00" * 5)

    swarm.transports[swarm.nodes.index(liar)].add_unary_handler(wire.FIND_VALUE, malformed)
    record = await reader.get(KEY, replicas=3, start=0)
    # the route read failed on it: the reader looked the key up instead and read the others
    assert record is not None and len(_values(record)) == WRITERS
    assert reader.stats["malformed_replies"] >= 1


async def test_a_node_that_sends_entries_for_a_summary_is_read_as_before(swarm: Swarm) -> None:
    holders, reader = _holders(swarm), _reader(swarm)
    assert await reader.get(KEY) is not None
    older_version = holders[1]
    writer = swarm.nodes[3]
    newer = Entry.create(writer.identity, KEY, b"newer report", timebase.now() + 40,
                         sub_key=writer.peer_id)
    assert older_version.storage.store(newer, timebase.now())

    async def unaware(ctx: RequestContext, message: Message) -> Message:
        header = {k: v for k, v in message.header.items() if k not in ("summary", "want", "nodes")}
        return await older_version._on_find_value(ctx, Message(header))

    swarm.transports[swarm.nodes.index(older_version)].add_unary_handler(wire.FIND_VALUE, unaware)
    record = await reader.get(KEY, replicas=3, start=0)
    assert record is not None
    values = _values(record)
    assert len(values) == WRITERS and values[writer.peer_id] == b"newer report"
    assert reader.stats["summary_fetches"] == 0


def test_summaries_and_wants_are_bounded_and_checked() -> None:
    now = timebase.now()
    entries = [Entry(KEY, f"s{i}", b"v", now + i, "w", bytes(64)) for i in range(5)]
    entries.append(Entry("k", None, b"plain", now + 9, "w", bytes(64)))
    summary = wire.encode_summary(entries)
    assert len(summary.payload) == 6 * (wire.SUMMARY_DIGEST + 8)
    assert wire.is_summary(summary)
    assert wire.decode_summary(summary) == {wire.sub_key_digest(e.sub_key): e.expiration
                                            for e in entries}
    assert wire.sub_key_digest(None) != wire.sub_key_digest("")
    for header, payload, error in [
        ({"summary": 2}, b"\x00" * 16, "does not match"),
        ({"summary": wire.MAX_ENTRIES_IN_REPLY + 1}, b"", "at most"),
        ({"summary": -1}, b"", "at most"),
        ({"summary": True}, b"", "at most"),
        ({"summary": 1}, b"\x00" * 8 + struct.pack(">d", math.nan), "must be a number"),
    ]:
        with pytest.raises(wire.MalformedMessage, match=error):
            wire.decode_summary(Message(header, payload))
    digests = [wire.sub_key_digest(f"s{i}") for i in range(3)]
    assert wire.decode_want({"want": wire.encode_want(digests)}) == frozenset(digests)
    assert wire.decode_want({}) is None
    for bad in ["ab", ["xyz"], ["00" * 9], ["0" * 16] * (wire.MAX_ENTRIES_IN_REPLY + 1), [5]]:
        with pytest.raises(wire.MalformedMessage):
            wire.decode_want({"want": bad})
    for bad_flag in ["yes", 1, None]:
        with pytest.raises(wire.MalformedMessage):
            wire.decode_flag({"summary": bad_flag}, "summary", False)


async def test_a_forged_entry_in_a_fetch_drops_the_route_and_the_news_is_read(swarm: Swarm) -> None:
    holders, reader = _holders(swarm), _reader(swarm)
    assert await reader.get(KEY) is not None
    writer, forger = swarm.nodes[0], holders[1]
    newer = Entry.create(writer.identity, KEY, b"newer report", timebase.now() + 40,
                         sub_key=writer.peer_id)
    for holder in holders[1:]:  # (all but the first node asked)
        assert holder.storage.store(newer, timebase.now())

    async def forging(ctx: RequestContext, message: Message) -> Message:
        if message.header.get("want"):  # the news asked for, with its value rewritten
            return wire.encode_values([dataclasses.replace(newer, value=b"evil")], [])
        return await forger._on_find_value(ctx, message)

    swarm.transports[swarm.nodes.index(forger)].add_unary_handler(wire.FIND_VALUE, forging)
    record = await reader.get(KEY, replicas=3, start=0)
    # the forger is banned and the read looked the key up among the others
    assert record is not None and _values(record)[writer.peer_id] == b"newer report"
    assert reader.stats["forged_records"] == 1
    assert forger.peer_id in set(reader._bans)


async def test_a_read_by_route_without_one_looks_up_nodes_then_reads_them_as_a_route(
        swarm: Swarm) -> None:
    # a board reader whose route expired: its lookup asks for nodes, not for the key's entries
    # (each node near the key would send all of them), and then reads three nodes as a route
    holders, reader = _holders(swarm), _reader(swarm)
    reader._routes.forget(key_id_of(KEY))  # (its store remembered one)
    writer = swarm.nodes[0]
    newer = Entry.create(writer.identity, KEY, b"newer report", timebase.now() + 40,
                         sub_key=writer.peer_id)
    assert holders[4].storage.store(newer, timebase.now())  # (news that reached one node)
    asked: Asked = []
    for node in swarm.nodes:
        _record_requests(swarm, node, asked)
    found_nodes = [0]
    for node, transport in zip(swarm.nodes, swarm.transports, strict=True):
        def counting(node: DHTNode = node) -> Any:
            async def answer(ctx: RequestContext, message: Message) -> Message:
                found_nodes[0] += 1
                return await node._on_find_node(ctx, message)
            return answer
        transport.add_unary_handler(wire.FIND_NODE, counting())

    record = await reader.get(KEY, replicas=3, start=3, by_route=True)

    assert record is not None
    values = _values(record)
    assert len(values) == WRITERS and values[writer.peer_id] == b"newer report"
    assert found_nodes[0] >= 3  # the lookup asked for nodes
    # every find_value went to the key's 8 nodes: the fourth (start=3) sent the entries, the
    # others summaries, and the fifth then the news only it held
    assert {peer for peer, _, _ in asked} == {h.peer_id for h in holders}
    assert all(header.get("nodes") is False for _, header, _ in asked)
    [(_, header, _)] = [a for a in asked if a[0] == holders[3].peer_id]
    assert not header.get("summary")
    assert sum(reply.header.get("entries", 0) for _, _, reply in asked) == WRITERS + 1
    # the nodes are remembered: the next read asks no node for nodes, and three of them
    assert [c.peer_id for c in reader._routes.held(key_id_of(KEY))] == [h.peer_id for h in holders]
    found_nodes[0] = 0
    asked.clear()
    assert await reader.get(KEY, replicas=3, start=4, by_route=True) is not None
    assert found_nodes[0] == 0 and {peer for peer, _, _ in asked} == {
        h.peer_id for h in holders[4:7]}


async def test_a_read_by_route_reads_past_nodes_near_the_key_that_withhold_it(
        swarm: Swarm) -> None:
    # three of the key's nodes answer as if they held nothing (they withhold it, or have not
    # got it yet), and the read begins with them: the others' summaries bring the board
    holders, reader = _holders(swarm), _reader(swarm)
    reader._routes.forget(key_id_of(KEY))

    async def withholding(ctx: RequestContext, message: Message) -> Message:
        if message.header.get("summary"):
            return wire.encode_summary([])
        return wire.encode_values([], [])

    for holder in holders[5:]:
        swarm.transports[swarm.nodes.index(holder)].add_unary_handler(wire.FIND_VALUE, withholding)
    record = await reader.get(KEY, replicas=3, start=5, by_route=True)
    assert record is not None and len(_values(record)) == WRITERS
    assert reader.stats["summary_fetches"] >= 1  # (asked of the honest nodes' summaries)


async def test_a_read_by_route_whose_node_lookup_is_cut_short_looks_the_entries_up(
        swarm: Swarm) -> None:
    # a node near the key never answers find_node: the lookup of nodes ends at half the read's
    # deadline, and the entries are looked up in the half left
    holders, reader = _holders(swarm), _reader(swarm)
    reader._routes.forget(key_id_of(KEY))

    async def silent(ctx: RequestContext, message: Message) -> Message:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    swarm.transports[swarm.nodes.index(holders[0])].add_unary_handler(wire.FIND_NODE, silent)
    lookups: list[tuple[str | None, bool]] = []
    lookup = reader._lookup

    async def noted(target: int, deadline: float, **kwargs: Any) -> Any:
        result = await lookup(target, deadline, **kwargs)
        lookups.append((kwargs.get("key"), result.finished))
        return result

    reader._lookup = noted  # type: ignore[method-assign]
    # (0.8 s: its half is under a call's timeout, 0.5 s, so the silent node outlasts it)
    record = await reader.get(KEY, timeout=0.8, by_route=True)
    assert record is not None and len(_values(record)) == WRITERS
    assert lookups == [(None, False), (KEY, True)]  # nodes (cut short), then the entries


async def test_a_read_by_route_whose_node_fails_looks_the_entries_up(swarm: Swarm) -> None:
    holders, reader = _holders(swarm), _reader(swarm)
    reader._routes.forget(key_id_of(KEY))

    async def failing(ctx: RequestContext, message: Message) -> Message:
        raise ConnectionError("gone")  # (a transport error at the reader)

    asked: Asked = []
    for node in swarm.nodes:
        if node is not holders[0]:
            _record_requests(swarm, node, asked)
    swarm.transports[swarm.nodes.index(holders[0])].add_unary_handler(wire.FIND_VALUE, failing)
    record = await reader.get(KEY, replicas=3, by_route=True)
    assert record is not None and len(_values(record)) == WRITERS
    # the route read (summaries from the second and third node) failed at the first, and the
    # entries were looked up: requests that ask for nodes too
    assert any(header.get("summary") for _, header, _ in asked)
    assert any(header.get("nodes", True) for _, header, _ in asked)
    # and the route remembered now is the lookup's, without the node that failed
    assert holders[0].peer_id not in {c.peer_id for c in reader._routes.held(key_id_of(KEY))}
