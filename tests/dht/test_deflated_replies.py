"""Replies to reads of a key that every peer of a run reads (the progress board), deflated.

At 256 simulated peers every board read brought back the whole board (about 680 bytes a report)
from three of the key's eight nodes, and those nodes' uploads queued past the read's deadline.
The replies to readers that accept zlib are deflated (to about a third); a reply that inflates
past its bound or names too many entries is refused, one with a forged entry dropped whole. On
an in-memory DHT, on virtual time.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import AsyncIterator

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


def test_a_reply_bomb_is_refused_once_it_inflates_past_the_bound() -> None:
    # 100 MiB of zeros deflate to about 100 KB: the reader stops at MAX_VALUES_BYTES
    bomb = Message({"entries": 1, "encoding": "zlib"}, zlib.compress(bytes(100 * 2**20), 1))
    with pytest.raises(wire.MalformedMessage, match="inflates past"):
        wire.decode_values(KEY, bomb)
    # thousands of junk entries cost little to send deflated; each would cost a signature check
    junk = Message({"entries": wire.MAX_ENTRIES_IN_REPLY + 1, "encoding": "zlib"},
                   zlib.compress(b"[]"))
    with pytest.raises(wire.MalformedMessage, match="entries in a reply"):
        wire.decode_values(KEY, junk)
    # an honest reply of the most entries a node may hold of one key still reads
    entries = [wire.Entry(KEY, f"s{i}", b"v" * 100, timebase.now() + 30, "w", bytes(64))
               for i in range(wire.MAX_ENTRIES_IN_REPLY)]
    reply = wire.encode_values(entries, [], compress=True)
    assert reply.header["encoding"] == "zlib"
    assert len(wire.decode_values(KEY, reply)[0]) == wire.MAX_ENTRIES_IN_REPLY


async def test_a_node_that_answers_a_reply_bomb_is_counted_and_read_past(swarm: Swarm) -> None:
    await _publish(swarm, 12)
    holders = _holders(swarm)
    reader = next(n for n in swarm.nodes if n not in holders)
    await reader.get(KEY)  # learns the key's nodes
    hostile = holders[2]

    async def bomb(ctx: RequestContext, message: Message) -> Message:  # 100 MiB of zeros
        return Message({"entries": 1, "encoding": "zlib"}, zlib.compress(bytes(100 * 2**20), 1))

    swarm.transports[swarm.nodes.index(hostile)].add_unary_handler(wire.FIND_VALUE, bomb)
    record = await reader.get(KEY)  # asks all 8 of the key's nodes, the hostile one too
    assert record is not None and len(record.entries) == 12  # (read from the others)
    assert reader.stats["malformed_replies"] >= 1


async def test_a_reply_with_a_forged_entry_is_dropped_whole(swarm: Swarm) -> None:
    await _publish(swarm, 2)
    holder, reader = _holders(swarm)[0], swarm.nodes[5]
    honest = holder.storage.get(KEY, timebase.now())
    assert len(honest) == 2
    forged = dataclasses.replace(honest[0], value=b"evil")  # (its signature no longer holds)
    liar = swarm.nodes[6].peer_id
    assert reader._checked(liar, [honest[1], forged, honest[0]]) == []
    assert reader.stats["forged_records"] == 1  # (one check, one log line: the rest unread)
    assert reader._checked(holder.peer_id, honest) == honest
