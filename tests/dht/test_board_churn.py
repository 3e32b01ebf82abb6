"""Reads of a key that every node writes, as a run's progress board reads it, while the swarm
changes: a flash crowd joins, then a fifth of the nodes is replaced by newcomers.

Each node publishes its report (a counter) under its own sub-key every few seconds and reads the
key from three of its eight nodes, each read from the next three in turn (the board's reads,
collab/board.py), through the route its DHT node remembers (looked up, when it expires, as
the board does: its nodes, then all of them read); the first node asked sends the entries and
the others summaries. A reader whose route predates a membership change asks nodes
that are no longer the key's closest, and a publisher whose route does stores to them: what
users need is that every reader still sees every live node's recent report. On an in-memory
DHT, on virtual time, with the default DHT settings of a simulated daemon: the test's sleeps
and the nodes' call timeouts are simulated seconds, which take no wall time and which a loaded
machine cannot stretch (the loop's clock moves only when every task waits).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.dht import DHTConfig, DHTNode

pytestmark = pytest.mark.virtual_time

KEY = "run/progress"
PUBLISH_EVERY = 4.0
READ_EVERY = 2.0
CONFIG = DHTConfig(rpc_timeout=2.0, lookup_timeout=5.0, join_timeout=10.0,
                   refresh_interval=600.0, republish_interval=300.0, maintenance_period=30.0)


class Board:
    """Every node's newest published counter, and what each reader has seen of the others'."""

    def __init__(self) -> None:
        self.published: dict[str, int] = {}
        self.seen: dict[str, dict[str, int]] = {}
        self.alive: set[str] = set()

    async def take_part(self, node: DHTNode) -> None:
        seen = self.seen.setdefault(node.peer_id, {})
        turn = int.from_bytes(hashlib.sha256(node.peer_id.encode()).digest()[:4], "big")
        counter, next_publish = 0, 0.0
        loop = asyncio.get_running_loop()
        await asyncio.sleep(random.Random(node.peer_id).random() * READ_EVERY)
        while node.peer_id in self.alive:
            if loop.time() >= next_publish:
                counter += 1
                await node.store(KEY, str(counter).encode(), timebase.now() + 30,
                                 sub_key=node.peer_id, timeout=5)
                self.published[node.peer_id] = counter
                next_publish = loop.time() + PUBLISH_EVERY
            turn += 3
            record = await node.get(KEY, timeout=5, replicas=3, start=turn, by_route=True)
            if record is not None:
                for sub_key, entry in record.own_sub_keys.items():
                    seen[sub_key] = max(seen.get(sub_key, 0), int(entry.value))
            await asyncio.sleep(READ_EVERY)

    def behind(self) -> list[tuple[str, str, int, int]]:
        """(reader, writer, seen, published) where a live reader has not seen a live writer's
        report of two publishes ago (eight seconds at least)."""
        late = []
        for reader in self.alive:
            for writer in self.alive - {reader}:
                published = self.published.get(writer, 0)
                seen = self.seen[reader].get(writer, 0)
                if published > 2 and seen < published - 2:
                    late.append((reader[:8], writer[:8], seen, published))
        return late


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    swarm = Swarm()
    yield swarm
    await swarm.close()


async def test_every_reader_sees_every_live_report_through_a_flash_crowd_and_replacements(
        swarm: Swarm) -> None:
    rng = random.Random(7)
    board = Board()
    tasks: list[asyncio.Task[None]] = []

    async def join() -> None:
        live = [n for n in swarm.nodes if n.peer_id in board.alive]
        bootstrap = [str(a) for n in rng.sample(live, min(3, len(live)))
                     for a in swarm.transports[swarm.nodes.index(n)].listen_addresses()]
        node = await swarm.add(CONFIG, bootstrap=bootstrap)
        board.alive.add(node.peer_id)
        tasks.append(asyncio.create_task(board.take_part(node)))

    for _ in range(24):
        await join()
    await asyncio.sleep(40)
    assert board.behind() == []
    await asyncio.gather(*(join() for _ in range(12)))  # a flash crowd
    for _ in range(3):
        await asyncio.sleep(10)
        assert board.behind() == []
    leaving = rng.sample(sorted(board.alive), 7)  # a fifth replaced, the leavers silent
    for peer_id in leaving:
        board.alive.discard(peer_id)
        node = next(n for n in swarm.nodes if n.peer_id == peer_id)
        await node.close()
        swarm.network.set_down(peer_id)
    await asyncio.gather(*(join() for _ in range(7)))
    for _ in range(4):
        await asyncio.sleep(10)
        assert board.behind() == []
    board.alive.clear()
    await asyncio.gather(*tasks)
