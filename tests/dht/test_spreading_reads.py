"""Reads of a key that every peer of a run reads (DHTNode.get with `start`: the progress board).

At 256 simulated peers every board read brought back the whole board from three of the key's
eight nodes; those nodes' uploads queued past the read's deadline, a node that did not answer in
time made the read look the key up again from all eight, and the trainers learnt late that the
run had reached its target. Now a read asks one node (the board's choice), replaces one that
fails by the next, learns the key's nodes without fetching the key from each of them, and the
replies to readers that accept it are deflated. On an in-memory DHT, on virtual time.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.dht import DHTNode, key_id_of, node_id_of
from dedloc.daemon.dht import protocol as wire
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext

pytestmark = pytest.mark.virtual_time

KEY = "run/progress"


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    swarm = Swarm()
    for _ in range(12):
        await swarm.add()
    yield swarm
    await swarm.close()


def _holders(swarm: Swarm) -> list[DHTNode]:
    key_id = key_id_of(KEY)
    return sorted(swarm.nodes, key=lambda n: node_id_of(n.peer_id) ^ key_id)[:8]


async def _publish(swarm: Swarm, writers: int) -> None:
    for node in swarm.nodes[:writers]:
        await node.store(KEY, b"report of " + node.peer_id.encode() * 8, timebase.now() + 30,
                         sub_key=node.peer_id)


def _count_replies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of entries of every find_value reply any node makes from now on."""
    replies: list[int] = []
    encode = wire.encode_values

    def counting(entries: list[Any], contacts: list[Any], **kwargs: Any) -> Message:
        replies.append(len(entries))
        return encode(entries, contacts, **kwargs)

    monkeypatch.setattr(wire, "encode_values", counting)
    return replies


async def test_a_reply_to_a_reader_that_accepts_zlib_is_deflated_and_reads_the_same(
        swarm: Swarm) -> None:
    await _publish(swarm, 12)
    holder = _holders(swarm)[0]
    caller = Identity.generate().peer_id
    request = {"client": True, "addresses": [], "key": KEY}
    plain = await holder._on_find_value(RequestContext(caller), Message(request))
    deflated = await holder._on_find_value(RequestContext(caller),
                                           Message({**request, "accept": ["zlib"]}))
    assert "encoding" not in plain.header and deflated.header["encoding"] == "zlib"
    assert len(deflated.payload) < len(plain.payload) / 2
    read_plain, _ = wire.decode_values(KEY, plain)
    read_deflated, _ = wire.decode_values(KEY, deflated)
    assert read_deflated == read_plain and len(read_plain) == 12


async def test_a_spreading_read_asks_one_node_even_when_it_looks_the_key_up(
        swarm: Swarm, monkeypatch: pytest.MonkeyPatch) -> None:
    await _publish(swarm, 12)
    reader = next(n for n in swarm.nodes if n not in _holders(swarm))
    reader._routes.clear()  # (its store remembered the key's nodes)
    replies = _count_replies(monkeypatch)
    record = await reader.get(KEY, replicas=1, start=5)  # no route: a node lookup first
    assert record is not None and len(record.entries) == 12
    assert [n for n in replies if n] == [12], "the lookup fetched the key from more than one node"
    replies.clear()
    record = await reader.get(KEY, replicas=1, start=6)  # the route is remembered
    assert record is not None and len(record.entries) == 12 and replies == [12]


async def test_a_node_that_does_not_answer_a_spreading_read_is_replaced_and_left_out(
        swarm: Swarm, monkeypatch: pytest.MonkeyPatch) -> None:
    await _publish(swarm, 12)
    holders = _holders(swarm)
    reader = next(n for n in swarm.nodes if n not in holders)
    await reader.get(KEY, replicas=1, start=8)  # learns the route: the 8 holders, closest first
    route = [c.peer_id for c in reader._routes[key_id_of(KEY)][1]]
    assert route == [n.peer_id for n in holders]
    silent = holders[3]  # it answers lookups and stores, never a read (overloaded, or hostile)

    asked_silent: list[str] = []

    async def never(ctx: RequestContext, message: Message) -> Message:
        asked_silent.append(ctx.peer_id)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    swarm.transports[swarm.nodes.index(silent)].add_unary_handler(wire.FIND_VALUE, never)
    replies = _count_replies(monkeypatch)
    record = await reader.get(KEY, replicas=1, start=8 * 100 + 3)  # its turn: the silent one
    assert record is not None and len(record.entries) == 12, "the next node was not asked"
    assert not record.complete  # (a node failed: the board's next reads are full)
    assert replies == [12]  # one node answered: no lookup of the key from all its nodes
    assert silent.peer_id not in [c.peer_id for c in reader._routes[key_id_of(KEY)][1]]
    record = await reader.get(KEY, replicas=1, start=8 * 100 + 3)
    assert record is not None and record.complete  # the silent node is not asked again
    # a store looks the key's nodes up again (it wants all eight): the silent one is back in the
    # route, but a read whose turn it is asks another first (a review found it asked again at
    # each turn, every eighth read 2 s late and every read after it a full one)
    await reader.store(KEY, b"mine", timebase.now() + 30, sub_key=reader.peer_id, timeout=5)
    assert silent.peer_id in [c.peer_id for c in reader._routes[key_id_of(KEY)][1]]
    replies.clear()
    asked_before = len(asked_silent)
    record = await reader.get(KEY, replicas=1, start=8 * 100 + 3)
    assert record is not None and record.complete and replies == [12]
    assert len(asked_silent) == asked_before, "the silent node was asked at its turn again"


async def test_a_spreading_read_whose_nodes_all_fail_says_it_is_incomplete(swarm: Swarm) -> None:
    await _publish(swarm, 1)
    holders = _holders(swarm)
    reader = next(n for n in swarm.nodes[1:] if n not in holders)
    await reader.get(KEY, replicas=1, start=8)
    for node in holders:
        swarm.network.blackhole(node.peer_id)
    record = await reader.get(KEY, replicas=1, start=8, timeout=5)
    assert record is not None and not record.complete and not record.entries  # not None: "empty"


async def test_a_node_that_answers_a_reply_bomb_is_counted_and_replaced(swarm: Swarm) -> None:
    await _publish(swarm, 12)
    holders = _holders(swarm)
    reader = next(n for n in swarm.nodes if n not in holders)
    await reader.get(KEY, replicas=1, start=8)
    hostile = holders[2]

    async def bomb(ctx: RequestContext, message: Message) -> Message:  # 8 MiB and one byte of zeros
        return Message({"entries": 0, "encoding": "zlib"},
                       zlib.compress(bytes(wire.MAX_VALUES_BYTES + 1), 9))

    swarm.transports[swarm.nodes.index(hostile)].add_unary_handler(wire.FIND_VALUE, bomb)
    record = await reader.get(KEY, replicas=1, start=8 * 100 + 2)  # its turn: the hostile one
    assert record is not None and len(record.entries) == 12 and not record.complete
    assert reader.stats["malformed_replies"] == 1
    assert hostile.peer_id not in [c.peer_id for c in reader._routes[key_id_of(KEY)][1]]
