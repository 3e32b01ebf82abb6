"""Pure tests of the XOR metric and the routing table (no network, no clock)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc.daemon.dht import KBucket, NodeInfo, RoutingTable, distance, key_id_of, node_id_of
from dedloc.daemon.dht.ids import ID_SPACE
from dedloc.daemon.identity import Identity

ids = st.integers(min_value=0, max_value=ID_SPACE - 1)


@settings(database=None)
@given(ids, ids, ids)
def test_xor_is_a_metric(a: int, b: int, c: int) -> None:
    assert distance(a, a) == 0
    assert (distance(a, b) == 0) == (a == b)
    assert distance(a, b) == distance(b, a)
    assert distance(a, c) <= distance(a, b) + distance(b, c)


@settings(database=None)
@given(ids, ids, ids)
def test_xor_is_unidirectional(a: int, b: int, c: int) -> None:
    # For a given point and distance there is exactly one point at that distance.
    assert (distance(a, b) == distance(a, c)) == (b == c)


def test_ids_are_sha256() -> None:
    import hashlib

    from dedloc.daemon.identity import base58_decode

    peer = Identity.generate().peer_id
    assert node_id_of(peer) == int.from_bytes(hashlib.sha256(base58_decode(peer)).digest(), "big")
    assert key_id_of("run/peers") == int.from_bytes(hashlib.sha256(b"run/peers").digest(), "big")
    assert 0 <= node_id_of(peer) < ID_SPACE


def node(i: int, rng: random.Random) -> NodeInfo:
    return NodeInfo(f"peer{i}", rng.randrange(ID_SPACE))


def test_insert_find_and_nearest_matches_brute_force() -> None:
    rng = random.Random(1)
    table = RoutingTable(rng.randrange(ID_SPACE), k=8)
    nodes = [node(i, rng) for i in range(500)]
    for n in nodes:
        table.add_or_update(n)
    held = list(table)
    assert 8 < len(held) < 500  # far buckets filled up, near ones split
    for _ in range(50):
        key = rng.randrange(ID_SPACE)
        expected = sorted(held, key=lambda n: n.node_id ^ key)[:10]
        assert table.nearest(key, 10) == expected
    excluded = {held[0].peer_id, held[1].peer_id}
    assert not excluded & {n.peer_id for n in table.nearest(key, 500, exclude=excluded)}


def test_buckets_partition_the_space_and_only_our_bucket_splits() -> None:
    rng = random.Random(2)
    own = rng.randrange(ID_SPACE)
    table = RoutingTable(own, k=4)
    for i in range(300):
        table.add_or_update(node(i, rng))
    buckets = table.buckets
    assert buckets[0].low == 0 and buckets[-1].high == ID_SPACE
    assert all(a.high == b.low for a, b in itertools.pairwise(buckets))
    assert all(len(b.nodes) <= 4 for b in buckets)
    for b in buckets:
        assert all(b.covers(n.node_id) for n in b.nodes.values())
    # Every split happened around our own id: a bucket not covering it is a sibling of the path.
    for b in buckets:
        if not b.covers(own):
            size = b.high - b.low
            assert b.low % size == 0  # aligned: produced by halving


def test_full_bucket_returns_least_recently_seen_and_caches_newcomer() -> None:
    table = RoutingTable(0, k=2)
    far = ID_SPACE // 2  # every id above this shares no prefix with our id 0
    a, b, c = (NodeInfo(p, far + i) for i, p in enumerate("abc"))
    assert table.add_or_update(a) is None
    assert table.add_or_update(b) is None
    assert table.add_or_update(c) is a  # full: ping the least recently seen
    assert "c" not in table
    table.mark_seen("a")  # a answered: it stays, now most recent; b becomes the LRU
    assert list(table.bucket_of(far).nodes) == ["b", "a"]
    assert table.add_or_update(NodeInfo("d", far + 3)) is table.get("b")
    # b fails: evicted at once because replacements wait; the freshest replacement (d) is promoted
    assert table.mark_failed("b")
    assert set(table.bucket_of(far).nodes) == {"a", "d"}
    assert "c" in table.bucket_of(far).replacements


def test_failed_node_without_replacement_evicted_after_max_failures() -> None:
    table = RoutingTable(0, k=2, max_failures=3)
    table.add_or_update(NodeInfo("a", ID_SPACE - 1))
    assert not table.mark_failed("a")
    assert not table.mark_failed("a")
    assert table.mark_failed("a")
    assert "a" not in table and len(table) == 0


def test_update_moves_to_tail_and_resets_failures() -> None:
    table = RoutingTable(0, k=3, max_failures=2)
    for i, p in enumerate("abc"):
        table.add_or_update(NodeInfo(p, ID_SPACE - 1 - i))
    table.mark_failed("a")
    table.add_or_update(NodeInfo("a", ID_SPACE - 1))
    assert list(table.bucket_of(ID_SPACE - 1).nodes) == ["b", "c", "a"]
    assert not table.mark_failed("a")  # counter was reset


def test_own_id_never_inserted() -> None:
    table = RoutingTable(42)
    assert table.add_or_update(NodeInfo("me", 42)) is None
    assert len(table) == 0


def test_refresh_bookkeeping() -> None:
    rng = random.Random(3)
    table = RoutingTable(rng.randrange(ID_SPACE), k=2)
    for i in range(50):
        table.add_or_update(node(i, rng))
    assert len(table.stale_buckets(now=100.0, interval=10.0)) == len(table.buckets)
    target = table.buckets[0]
    table.touch(RoutingTable.random_id_in(target, rng), now=95.0)
    stale = table.stale_buckets(now=100.0, interval=10.0)
    assert target not in stale and len(stale) == len(table.buckets) - 1
    assert target in table.stale_buckets(now=106.0, interval=10.0)
    assert all(b.covers(RoutingTable.random_id_in(b, rng)) for b in table.buckets)


@settings(max_examples=60, deadline=None, database=None)
@given(st.integers(0, 2**32), st.lists(ids, min_size=1, max_size=120, unique=True), st.integers(1, 6),
       ids)
def test_property_table_invariants(seed: int, node_ids: list[int], k: int, key: int) -> None:
    rng = random.Random(seed)
    own = node_ids[0]
    table = RoutingTable(own, k=k)
    for i, nid in enumerate(node_ids[1:]):
        table.add_or_update(NodeInfo(f"p{i}", nid))
        if rng.random() < 0.2 and len(table):
            table.mark_failed(rng.choice(list(table)).peer_id)
    held = list(table)
    assert len({n.peer_id for n in held}) == len(held)
    assert all(isinstance(b, KBucket) and len(b.nodes) <= k for b in table.buckets)
    assert sum(len(b.nodes) for b in table.buckets) == len(table)
    assert table.nearest(key, 7) == sorted(held, key=lambda n: n.node_id ^ key)[:7]
    # With no failures, a bucket with room never leaves a node out
    fresh = RoutingTable(own, k=k)
    for i, nid in enumerate(node_ids[1:]):
        fresh.add_or_update(NodeInfo(f"p{i}", nid))
    for i, nid in enumerate(node_ids[1:]):
        bucket = fresh.bucket_of(nid)
        assert f"p{i}" in fresh or len(bucket.nodes) == k


def test_full_bucket_does_not_ping_a_node_seen_lately() -> None:
    # a swarm larger than a bucket: every message from a peer outside the table must not cost
    # a ping of the bucket's oldest node when that node has just answered
    table = RoutingTable(0, k=2, recheck_after=30.0)
    far = ID_SPACE // 2
    a, b = NodeInfo("a", far), NodeInfo("b", far + 1)
    assert table.add_or_update(a, now=100.0) is None
    assert table.add_or_update(b, now=101.0) is None
    assert table.add_or_update(NodeInfo("c", far + 2), now=110.0) is None  # a seen 10 s ago
    assert "c" in table.bucket_of(far).replacements
    assert table.add_or_update(NodeInfo("d", far + 3), now=131.0) is table.get("a")  # 31 s
    table.mark_seen("a", now=132.0)
    assert table.add_or_update(NodeInfo("e", far + 4), now=140.0) is table.get("b")  # 39 s ago


@pytest.mark.parametrize("raw", [[["/ip4/1.2.3.4/tcp/1"]], [1], [{"a": 1}], ["not an address"],
                                 ["/ip4/1.2.3.4/tcp/1"] * 9, "text"])
def test_bad_address_lists_are_malformed_cached_or_not(raw: object) -> None:
    from dedloc.daemon.dht.errors import MalformedMessage
    from dedloc.daemon.dht.protocol import decode_contacts
    for _ in range(2):  # the second time through the cache of parsed lists
        with pytest.raises(MalformedMessage):
            decode_contacts([{"peer_id": "p", "addresses": raw}])


def test_address_lists_parse_alike_cached_or_not() -> None:
    from dedloc.daemon.dht.protocol import decode_contacts
    raw = [{"peer_id": "p", "addresses": ["/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.5/tcp/2/p2p/q"]}]
    first, second = decode_contacts(raw), decode_contacts(raw)
    assert first == second and [str(a) for a in first[0].addresses] == raw[0]["addresses"]
