"""The attacker writes sub-keys that are not peer ids ("1", "11", ...) under a run's per-peer keys.

Anyone may write such a sub-key (the DHT only reserves sub-keys that ARE peer ids for that peer),
so one identity could fill a key with a thousand entries. Readers that count peers (the progress
board, matchmaking, the manifest vote) take one entry per identity: only sub-keys written by the
peer they name. Here on an in-memory DHT of 8 honest nodes and the attacker's own node.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from dht.swarm import Swarm

from dedloc.daemon import timebase
from dedloc.daemon.averaging.group import Member
from dedloc.daemon.averaging.matchmaking import DHT_PREFIX, Matchmaker, RoundRequest
from dedloc.daemon.collab.board import DhtProgressBoard
from dedloc.daemon.collab.manifest import RunManifest, find_manifests, manifests_key, run_key
from dedloc.daemon.collab.membership import MembershipRegistry
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.identity import Identity

pytestmark = pytest.mark.virtual_time

JUNK = ["1", "11", "111", "a", "0" * 40]


@pytest.fixture
async def swarm():  # type: ignore[no-untyped-def]
    swarm = Swarm()
    for _ in range(9):  # the last one is the attacker's
        await swarm.add()
    yield swarm
    await swarm.close()


def _board(swarm: Swarm, index: int, manifest: RunManifest) -> DhtProgressBoard:
    node = swarm.nodes[index]
    identity = node.identity
    return DhtProgressBoard(node, identity, MembershipRegistry(identity), "sybil", manifest,
                            "trainer", 1000)


async def test_progress_under_junk_sub_keys_is_not_read(swarm: Swarm) -> None:
    manifest = RunManifest(workload="tiny", target_batch_size=4096)
    honest = [_board(swarm, i, manifest) for i in range(3)]
    now = timebase.now()
    for board in honest:
        await board.publish(PeerProgress(board.peer_id, 3, 100, 50.0, now, now + 30))
    attacker = swarm.nodes[8]
    key = run_key("sybil", manifest) + "/progress"
    for sub_key in JUNK:  # epoch 10^12 and a full batch each, under names that are no peer's
        lie = PeerProgress(sub_key, 10**12, 4096, 1e6, now, now + 30)
        assert await attacker.store(key, lie.to_bytes(), now + 30, sub_key=sub_key)

    reports, _ = await honest[0].read()
    assert sorted(r.peer_id for r in reports) == sorted(b.peer_id for b in honest)
    assert max(r.epoch for r in reports) == 3
    assert honest[0].rejected_reports == len(JUNK)  # counted, not used


async def test_matchmaking_ignores_candidates_that_are_not_peer_ids(swarm: Swarm) -> None:
    makers = [Matchmaker(t, n, _equal_split) for t, n in zip(swarm.transports[:4], swarm.nodes[:4],
                                                            strict=True)]
    key = "run/round-junk"
    attacker = swarm.nodes[8]
    expiration = timebase.now() + 60
    for sub_key in JUNK:  # announcements that would sort before every real peer and lead
        member = Member(sub_key, "trainer", 1.0, 1e7, 1e7, True)
        value = orjson.dumps({**member.to_json(), "size": 10_000, "chunk_elements": 1000,
                              "compression": "none", "addresses": []})
        assert await attacker.store(DHT_PREFIX + key, value, expiration, sub_key=sub_key)

    groups = await asyncio.gather(*(m.form_group(_request(m.peer_id, key)) for m in makers))
    assert len({g.group_id for g in groups}) == 1
    assert {m.peer_id for m in groups[0].members} == {m.peer_id for m in makers}


async def test_the_manifest_vote_counts_identities_not_sub_keys(swarm: Swarm) -> None:
    honest = RunManifest(workload="tiny", target_batch_size=4096)
    forged = RunManifest(workload="tiny", target_batch_size=1)  # the attacker's run
    expiration = timebase.now() + 600
    for manifest, node, sub_keys in ((honest, swarm.nodes[0], [swarm.nodes[0].identity.peer_id]),
                                     (honest, swarm.nodes[1], [swarm.nodes[1].identity.peer_id]),
                                     (forged, swarm.nodes[8], JUNK)):
        value = orjson.dumps({"manifest": manifest.to_json(), "fingerprint": manifest.fingerprint(),
                              "parameters": 1000, "published_at": timebase.now()})
        for sub_key in sub_keys:
            assert await node.store(manifests_key("sybil"), value, expiration, sub_key=sub_key)

    found = await find_manifests(swarm.nodes[3], "sybil")
    assert [p.fingerprint for p in found] == [honest.fingerprint()]


def _request(peer_id: str, key: str) -> RoundRequest:
    member = Member(peer_id, "trainer", 1.0, 1e7, 1e7, True)
    return RoundRequest(key, member, size=10_000, chunk_elements=1000, compression="none",
                        window=2.0, deadline=timebase.now() + 30, expected=4)


def _equal_split(members: tuple[Member, ...], size: int, chunk: int) -> tuple[tuple[int, int], ...]:
    share = -(-size // len(members))
    return tuple((min(size, i * share), min(size, (i + 1) * share)) for i in range(len(members)))


def test_an_identity_is_what_signs() -> None:  # the rule the readers rely on, at the record level
    from dedloc.daemon.dht.records import Entry, Record
    identity = Identity.generate()
    mine = Entry.create(identity, "k", b"v", time.time() + 60, sub_key=identity.peer_id)
    junk = Entry.create(identity, "k", b"v", time.time() + 60, sub_key="1")
    record = Record("k", (mine, junk))
    assert set(record.sub_keys) == {identity.peer_id, "1"}
    assert set(record.own_sub_keys) == {identity.peer_id}
