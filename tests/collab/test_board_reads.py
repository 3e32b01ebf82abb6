"""The progress board's reads spread over all the nodes that hold the run's key (board.py).

Every peer of a run reads one key several times an epoch. When every read asked the three nodes
closest to the key, at 128 simulated peers those three served every read of the swarm and the
stores to them timed out; and a report that had not reached them (a store that timed out) was
never read. Here on an in-memory DHT of 12 nodes (each key held by 8), on virtual time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.collab.board import (
    FULL_READ_EVERY,
    KEEP_SECONDS,
    READ_REPLICAS,
    READ_TURNS,
    DhtProgressBoard,
)
from dedloc.daemon.collab.manifest import RunManifest, run_key
from dedloc.daemon.collab.membership import MembershipRegistry
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.dht import DHTNode
from dedloc.daemon.dht.ids import key_id_of, node_id_of

pytestmark = pytest.mark.virtual_time

MANIFEST = RunManifest(workload="tiny", target_batch_size=4096)
KEY = run_key("spread", MANIFEST) + "/progress"


@pytest.fixture
async def swarm():  # type: ignore[no-untyped-def]
    swarm = Swarm()
    for _ in range(12):
        await swarm.add()
    yield swarm
    await swarm.close()


def _board(node: DHTNode) -> DhtProgressBoard:
    return DhtProgressBoard(node, node.identity, MembershipRegistry(node.identity), "spread",
                            MANIFEST, "trainer", 1000)


def _holders(swarm: Swarm) -> list[DHTNode]:
    """The 8 nodes closest to the key, closest first."""
    key_id = key_id_of(KEY)
    return sorted(swarm.nodes, key=lambda n: node_id_of(n.peer_id) ^ key_id)[:8]


async def _publish(board: DhtProgressBoard, epoch: int = 3) -> None:
    now = timebase.now()
    await board.publish(PeerProgress(board.peer_id, epoch, 100, 50.0, now, now + 30))


async def test_a_report_missing_from_the_closest_nodes_is_still_read(swarm: Swarm) -> None:
    holders = _holders(swarm)
    others = [n for n in swarm.nodes if n not in holders]
    reader, writer, late = (_board(n) for n in others[:3])
    await _publish(writer)
    assert {p.peer_id for p in (await reader.read())[0]} == {writer.peer_id}
    # a report whose stores to the three closest nodes timed out: only the other five hold it
    await _publish(late)
    for node in holders[:3]:
        node.storage.remove(KEY, late.peer_id)
    _ask_the_closest_next(reader)
    seen = []
    for _ in range(READ_TURNS):
        reports, _ = await reader.read()
        seen.append(late.peer_id in {p.peer_id for p in reports})
    assert seen[0] is False  # the closest three were asked first
    assert any(seen), "asking the closest three every time never reads it"
    assert seen[-1]  # and once read, it is held


def _ask_the_closest_next(board: DhtProgressBoard) -> None:
    """The board's next read asks the key's closest `READ_REPLICAS` nodes (its turn in their
    ring begins where its peer id says otherwise)."""
    board._turn = 8 * 1000 - READ_REPLICAS


async def test_a_full_read_goes_round_all_the_nodes(swarm: Swarm) -> None:
    # A review found: every minute the full read asked three of the eight nodes and forgot what the
    # board held, and the reads after it asked the other nodes only for what was published since;
    # a report published earlier that the full read's three nodes lacked was lost until republished.
    holders = _holders(swarm)
    others = [n for n in swarm.nodes if n not in holders]
    reader, writer = (_board(n) for n in others[:2])
    await reader.read()  # t=0: a full read, by a lookup
    await asyncio.sleep(35)
    await reader.read()  # t=35: the key's route is looked up again (kept 30 s), known till t=65
    await asyncio.sleep(10)
    await _publish(writer)  # t=45: expires at t=75; only the nodes but the closest three hold it
    for node in holders[:3]:
        node.storage.remove(KEY, writer.peer_id)
    await asyncio.sleep(FULL_READ_EVERY + 1 - 45)
    _ask_the_closest_next(reader)
    seen = []
    for _ in range(READ_TURNS):  # t=61: the full read asks the closest three, then the others
        reports, _ = await reader.read()
        seen.append(writer.peer_id in {p.peer_id for p in reports})
    assert seen[0] is False
    assert seen[-1], "the reads after the full one asked only for what was published since it"


@pytest.mark.parametrize("failure", ["raised", "cut-short"])
async def test_a_failed_read_makes_the_next_reads_full(swarm: Swarm, failure: str) -> None:
    reader = _board(swarm.nodes[0])
    await _publish(_board(swarm.nodes[1]))
    asked: list[Any] = []
    get = reader.dht.get

    async def recording_get(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["min_expiration"])
        record = await get(*args, **kwargs)
        if len(asked) == 2 * READ_TURNS + 1:
            if failure == "raised":
                raise TimeoutError("the nodes asked did not answer")
            assert record is not None
            return dataclasses.replace(record, complete=False)  # a lookup the deadline cut short
        return record

    reader.dht.get = recording_get  # type: ignore[method-assign]
    for _ in range(4 * READ_TURNS):
        await reader.read()
        await asyncio.sleep(1)
    full = [since is None for since in asked]
    # READ_TURNS full reads round the nodes, incremental ones, the failure; then full ones again
    assert full == [True] * READ_TURNS + [False] * READ_TURNS + [False] + [True] * READ_TURNS \
        + [False] * (READ_TURNS - 1), full


async def test_the_readers_of_a_key_spread_over_all_its_nodes(swarm: Swarm) -> None:
    holders = _holders(swarm)
    boards = [_board(n) for n in swarm.nodes]
    for board in boards:
        await _publish(board)
    for board in boards:  # everyone learns the key's nodes
        await board.read()
    before = {n.peer_id: n.stats["rpc_in"] for n in holders}
    for _ in range(4):
        for board in boards:
            await board.read()
    served = collections.Counter({n.peer_id: n.stats["rpc_in"] - before[n.peer_id] for n in holders})
    reads = 4 * len(boards) * 3  # (each read asks three nodes; a holder's own reads ask itself
    assert sum(served.values()) <= reads  # locally, not by a call)
    assert min(served.values()) > 0, served  # every holder served some
    assert max(served.values()) <= 2 * reads / len(holders), served  # none served most


async def test_a_report_dated_in_the_future_is_not_held_for_ever(swarm: Swarm) -> None:
    # A review found: what the board held was pruned by the reports' own dates, so identities that
    # published reports dated hours ahead stayed in every reader's memory long after the DHT
    # dropped them (a stream of new identities grew it without bound).
    reader, liar = (_board(n) for n in swarm.nodes[:2])
    now = timebase.now()
    await liar.publish(PeerProgress(liar.peer_id, 3, 100, 50.0, now + 3600, now + 3630))
    await reader.read()
    assert liar.peer_id in reader._held
    for node in swarm.nodes:  # the DHT forgets it (evicted, or its nodes left)
        node.storage.remove(KEY, liar.peer_id)
    for _ in range(int(KEEP_SECONDS / 10) + 2):
        await asyncio.sleep(10)
        await reader.read()
    assert liar.peer_id not in reader._held and liar.peer_id not in reader._first_read


@pytest.mark.parametrize(("took", "stored"), [(8, True), (6, True), (5, False), (1, False),
                                              (0, False)])
async def test_a_report_is_stored_once_every_read_of_its_nodes_holds_it(
        swarm: Swarm, monkeypatch: pytest.MonkeyPatch, took: int, stored: bool) -> None:
    # a read asks READ_REPLICAS of the key's 8 nodes: a report that reached fewer than 6 is not
    # stored (the engine publishes it again at the next look, not after REPUBLISH_UNCHANGED)
    node = swarm.nodes[0]
    board = _board(node)

    async def store(*args: Any, **kwargs: Any) -> int:  # (the others' stores timed out)
        return took

    monkeypatch.setattr(node, "store", store)
    now = timebase.now()
    assert 8 - READ_REPLICAS + 1 == 6
    assert await board.publish(PeerProgress(board.peer_id, 3, 100, 50.0, now, now + 30)) is stored


async def test_a_report_stored_in_full_is_stored(swarm: Swarm) -> None:
    board = _board(swarm.nodes[0])
    now = timebase.now()
    assert await board.publish(PeerProgress(board.peer_id, 3, 100, 50.0, now, now + 30)) is True
