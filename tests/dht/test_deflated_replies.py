"""Replies to reads of a key that every peer of a run reads (the progress board), deflated.

At 256 simulated peers every board read brought back the whole board (about 680 bytes a report)
from three of the key's eight nodes, and those nodes' uploads queued past the read's deadline.
The replies to readers that accept zlib are deflated (to about a third), and a node that answers
with a reply bomb is counted and read past. On an in-memory DHT, on virtual time.
"""

from __future__ import annotations

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
    record = await reader.get(KEY, replicas=3, start=8 * 100 + 2)  # its turn: the hostile one
    assert record is not None and len(record.entries) == 12  # (read from the others)
    assert reader.stats["malformed_replies"] >= 1
