"""The Kademlia routing table: k-buckets over the 256-bit id space. Pure: no I/O, no clock.

Buckets cover disjoint id intervals [low, high). Only the bucket that contains our own id splits
when full; any other full bucket keeps its nodes in least-recently-seen order and parks newcomers
in a bounded replacement cache. The caller pings the least-recently-seen node (`add_or_update`
returns it) and reports the outcome: `mark_seen` keeps it, `mark_failed` evicts it once it has
failed too often (or at once when a replacement is waiting) and promotes the freshest replacement.
Given the time (`now`), a node seen within `recheck_after` seconds is not pinged again: in a
swarm larger than a bucket, every message from a peer outside the table would otherwise cost a
ping of a node that has just answered.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from ..net.addresses import PeerAddress
from .ids import ID_SPACE, random_id_between


@dataclass
class NodeInfo:
    """A peer as the DHT knows it."""

    peer_id: str
    node_id: int
    addresses: tuple[PeerAddress, ...] = ()
    failures: int = 0
    seen_at: float = float("-inf")  # the caller's clock, when it last answered or called us


@dataclass
class KBucket:
    low: int
    high: int
    size: int
    nodes: OrderedDict[str, NodeInfo] = field(default_factory=OrderedDict)  # least recently seen first
    replacements: OrderedDict[str, NodeInfo] = field(default_factory=OrderedDict)
    last_lookup: float = float("-inf")

    def covers(self, node_id: int) -> bool:
        return self.low <= node_id < self.high

    @property
    def full(self) -> bool:
        return len(self.nodes) >= self.size

    def add_replacement(self, node: NodeInfo) -> None:
        self.replacements.pop(node.peer_id, None)
        self.replacements[node.peer_id] = node
        while len(self.replacements) > self.size:
            self.replacements.popitem(last=False)

    def split(self) -> tuple[KBucket, KBucket]:
        middle = (self.low + self.high) // 2
        left = KBucket(self.low, middle, self.size, last_lookup=self.last_lookup)
        right = KBucket(middle, self.high, self.size, last_lookup=self.last_lookup)
        for peer_id, node in self.nodes.items():
            (left if node.node_id < middle else right).nodes[peer_id] = node
        for peer_id, node in self.replacements.items():
            (left if node.node_id < middle else right).replacements[peer_id] = node
        return left, right


class RoutingTable:
    """k-buckets around `own_id`. `k` nodes per bucket; `max_failures` failed contacts evict a
    node even when no replacement is waiting."""

    def __init__(self, own_id: int, *, k: int = 20, max_failures: int = 3,
                 recheck_after: float = 30.0) -> None:
        if k < 1:
            raise ValueError("k must be at least 1")
        self.recheck_after = recheck_after
        self.own_id = own_id
        self.k = k
        self.max_failures = max_failures
        self.buckets: list[KBucket] = [KBucket(0, ID_SPACE, k)]
        self._by_peer: dict[str, NodeInfo] = {}

    def __len__(self) -> int:
        return len(self._by_peer)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._by_peer

    def __iter__(self) -> Iterator[NodeInfo]:
        return iter(list(self._by_peer.values()))

    def get(self, peer_id: str) -> NodeInfo | None:
        return self._by_peer.get(peer_id)

    def bucket_index(self, node_id: int) -> int:
        low, high = 0, len(self.buckets)
        while high - low > 1:  # buckets are sorted by interval
            middle = (low + high) // 2
            if node_id < self.buckets[middle].low:
                high = middle
            else:
                low = middle
        return low

    def bucket_of(self, node_id: int) -> KBucket:
        return self.buckets[self.bucket_index(node_id)]

    def add_or_update(self, node: NodeInfo, now: float | None = None) -> NodeInfo | None:
        """Record that `node` answered or called us (at `now`). Returns None when it is in the
        table (new or refreshed); otherwise it went to the replacement cache and the returned
        least-recently-seen node of its bucket should be pinged (then `mark_seen` or `mark_failed`
        it), unless that node was seen within `recheck_after` of `now` (then None too)."""
        if node.node_id == self.own_id:
            return None
        if now is not None:
            node.seen_at = now
        known = self._by_peer.get(node.peer_id)
        bucket = self.bucket_of(node.node_id)
        if known is not None:
            known.failures = 0
            if now is not None:
                known.seen_at = now
            if node.addresses:
                known.addresses = node.addresses
            bucket.nodes.move_to_end(node.peer_id)
            return None
        while True:
            if not bucket.full:
                bucket.replacements.pop(node.peer_id, None)
                bucket.nodes[node.peer_id] = node
                self._by_peer[node.peer_id] = node
                return None
            if not bucket.covers(self.own_id) or bucket.high - bucket.low < 2:
                bucket.add_replacement(node)
                oldest = next(iter(bucket.nodes.values()))
                if now is not None and now - oldest.seen_at < self.recheck_after:
                    return None
                return oldest
            index = self.bucket_index(node.node_id)
            self.buckets[index : index + 1] = bucket.split()
            bucket = self.bucket_of(node.node_id)

    def mark_seen(self, peer_id: str, now: float | None = None) -> None:
        node = self._by_peer.get(peer_id)
        if node is not None:
            node.failures = 0
            if now is not None:
                node.seen_at = now
            self.bucket_of(node.node_id).nodes.move_to_end(peer_id)

    def mark_failed(self, peer_id: str) -> bool:
        """A contact with `peer_id` failed. Returns True if it was evicted."""
        node = self._by_peer.get(peer_id)
        if node is None:
            for bucket in self.buckets:
                bucket.replacements.pop(peer_id, None)
            return False
        node.failures += 1
        bucket = self.bucket_of(node.node_id)
        if bucket.replacements or node.failures >= self.max_failures:
            self.remove(peer_id)
            return True
        return False

    def remove(self, peer_id: str) -> None:
        """Drop `peer_id` and promote the most recently seen replacement of its bucket."""
        node = self._by_peer.pop(peer_id, None)
        if node is None:
            return
        bucket = self.bucket_of(node.node_id)
        bucket.nodes.pop(peer_id, None)
        if bucket.replacements:
            _, promoted = bucket.replacements.popitem(last=True)
            bucket.nodes[promoted.peer_id] = promoted
            self._by_peer[promoted.peer_id] = promoted

    def nearest(self, key_id: int, count: int, exclude: Collection[str] = ()) -> list[NodeInfo]:
        """Up to `count` known nodes closest to `key_id` by XOR, nearest first."""
        candidates = (node for node in self._by_peer.values() if node.peer_id not in exclude)
        return heapq.nsmallest(count, candidates, key=lambda node: node.node_id ^ key_id)

    # Refresh bookkeeping: a bucket is stale when no lookup touched its interval lately.

    def touch(self, key_id: int, now: float) -> None:
        """A lookup for `key_id` finished at `now`: its bucket counts as refreshed."""
        self.bucket_of(key_id).last_lookup = now

    def stale_buckets(self, now: float, interval: float) -> list[KBucket]:
        return [bucket for bucket in self.buckets if bucket.last_lookup < now - interval]

    @staticmethod
    def random_id_in(bucket: KBucket, rng: random.Random | None = None) -> int:
        return random_id_between(bucket.low, bucket.high, rng)
