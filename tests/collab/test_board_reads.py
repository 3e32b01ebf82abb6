"""The progress board's reads spread over all the nodes that hold the run's key (board.py).

Every peer of a run reads one key several times an epoch. When every read asked the three nodes
closest to the key, at 128 simulated peers those three served every read of the swarm and the
stores to them timed out; and a report that had not reached them (a store that timed out) was
never read. Here on an in-memory DHT of 12 nodes (each key held by 8), on virtual time.
"""

from __future__ import annotations

import collections

import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.collab.board import READ_TURNS, DhtProgressBoard
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
    seen = []
    for _ in range(READ_TURNS + 1):  # (the reader's turn begins anywhere in the ring)
        reports, _ = await reader.read()
        seen.append(late.peer_id in {p.peer_id for p in reports})
    assert any(seen), "asking the closest three every time never reads it"
    assert seen[-1]  # and once read, it is held


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
