"""`DHTNode`: Kademlia over a `PeerTransport`, and its `DHTConfig`.

The pure parts live apart: ids.py (metric), routing.py (k-buckets), records.py and storage.py
(signed expiring entries), protocol.py (wire codecs), lookup.py (the iterative lookup),
routes.py, lost.py and bans.py (what the node remembers of keys' closest nodes, evicted contacts
and banned peers). The node's own work is split by what it does, as functions of the node bound
as its methods:
- serving.py: the RPCs it answers for other nodes (PING, FIND_NODE, FIND_VALUE, STORE);
- peers.py: its calls to other nodes, and keeping those it meets in the routing table;
- queries.py: lookups of nodes and values, and the checks on the records replies bring;
- replication.py: storing records at the nodes closest to their keys, and handing held ones to
  a newly seen node;
- maintenance.py: joining through the bootstrap peers, and the background maintenance loop.
Closed runs' keys are checked with a `KeyAccess` (access.py). This module holds the node's state,
its life cycle and its public operations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from .. import timebase
from ..identity import Identity
from ..net.addresses import PeerAddress
from ..net.errors import TransportError
from ..net.interface import Message, PeerTransport
from . import maintenance, peers, protocol, queries, replication, serving
from .access import KeyAccess, readable
from .bans import Bans
from .ids import key_id_of, node_id_of
from .lost import LostContacts
from .protocol import Contact
from .records import Entry, Record, RecordLimits, merge_entries, validate
from .routes import RouteCache
from .routing import RoutingTable
from .storage import RecordStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DHTConfig:
    k: int = 20  # bucket size, and how many closest nodes a node lookup finds
    replicas: int = 8  # how many of the closest nodes hold each record (and a get asks)
    alpha: int = 3  # parallel queries per lookup
    rpc_timeout: float = 2.0  # one request/reply
    lookup_timeout: float = 5.0  # default deadline of one get/store/find (lookup and stores)
    join_timeout: float = 10.0  # the join attempt inside start()
    bootstrap_backoff: float = 1.0  # first retry delay while isolated; doubles up to the max
    bootstrap_backoff_max: float = 60.0
    refresh_interval: float = 600.0
    republish_interval: float = 1800.0
    sweep_interval: float = 60.0
    maintenance_period: float = 5.0  # how often the maintenance loop wakes
    max_background_tasks: int = 32  # pings of stale nodes and replications, together
    replication_senders: int = 3  # how many of the closest holders hand a record to a newcomer
    ban_seconds: float = 600.0  # a peer that returned a forged record is ignored this long
    client_mode: bool = False  # query and store via others; answer no DHT RPCs
    limits: RecordLimits = field(default_factory=RecordLimits)


class DHTNode:
    """A Kademlia node: serves the DHT (unless in client mode), stores and reads signed records."""

    def __init__(self, transport: PeerTransport, identity: Identity, config: DHTConfig | None = None,
                 *, clock: Callable[[], float] = timebase.now, rng: random.Random | None = None,
                 access: KeyAccess | None = None) -> None:
        if transport.peer_id != identity.peer_id:
            raise ValueError("the transport and the identity name different peers")
        self.transport = transport
        self.identity = identity
        self.config = config or DHTConfig()
        self.peer_id = identity.peer_id
        self.node_id = node_id_of(self.peer_id)
        self.routing_table = RoutingTable(self.node_id, k=self.config.k)
        self.storage = RecordStore(self.config.limits)
        self.stats: Counter[str] = Counter()
        self.access = access
        self._clock = clock
        self._rng = rng or random.Random()
        self._bootstrap: list[PeerAddress] = []
        self._own: dict[tuple[str, str | None], Entry] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._busy: set[str] = set()  # peers with a ping or a replication under way
        self._bans = Bans()  # peers that returned a forged record
        self._started = False
        self._closed = False
        self._joined_event = asyncio.Event()  # the first join succeeded
        self._known_event = asyncio.Event()  # the routing table gained a peer (wait_joined)
        self._routes = RouteCache(self.config.replicas)  # the closest nodes of keys, a while
        self._lost = LostContacts()  # evicted contacts, tried again now and then
        self._log = log.bind(peer_id=self.peer_id[:12], client=self.config.client_mode)

    # The node's work, by what it does (functions of the node, bound as its methods).
    _on_ping = serving.on_ping  # answering other nodes
    _on_find_node = serving.on_find_node
    _on_find_value = serving.on_find_value
    _on_store = serving.on_store
    _call = peers.call  # calling them, and keeping those met in the routing table
    _seen = peers.seen
    _probe_lost = peers.probe_lost
    _lookup = queries.lookup  # looking up nodes and values
    _ask_route = queries.ask_route
    _checked = queries.checked
    _replicate = replication.replicate  # storing records at their keys' closest nodes
    _replicate_to = replication.replicate_to
    _join = maintenance.join  # joining, and the maintenance loop
    _maintain = maintenance.maintain

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self, bootstrap: Sequence[PeerAddress | str] = (), *, wait: bool = True) -> bool:
        """Serve the DHT RPCs (unless in client mode), then join through `bootstrap`. With `wait`,
        one join attempt (bounded by `join_timeout`) runs before returning; failures are logged and
        retried in the background. Returns whether the node knows at least one peer."""
        if self._started:
            raise RuntimeError("DHTNode.start() was already called")
        self._started = True
        self._bootstrap = [a if isinstance(a, PeerAddress) else PeerAddress.parse(a) for a in bootstrap]
        if not self.config.client_mode:
            self.transport.add_unary_handler(protocol.PING, self._on_ping)
            self.transport.add_unary_handler(protocol.FIND_NODE, self._on_find_node)
            self.transport.add_unary_handler(protocol.FIND_VALUE, self._on_find_value)
            self.transport.add_unary_handler(protocol.STORE, self._on_store)
        if self._bootstrap and wait:
            try:
                async with asyncio.timeout(self.config.join_timeout):
                    await self._join()
            except TimeoutError:
                self._log.warning("dht_join_timed_out", timeout=self.config.join_timeout)
        self._spawn(self._maintain(), "dht-maintenance")
        return self.joined

    def set_client_mode(self, client: bool) -> None:
        """Decide, before `start`, whether this node serves the DHT (once reachability is known)."""
        if self._started:
            raise RuntimeError("the DHT's mode is fixed once it has started")
        self.config = dataclasses.replace(self.config, client_mode=client)
        self._log = log.bind(peer_id=self.peer_id[:12], client=client)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def joined(self) -> bool:
        return len(self.routing_table) > 0

    async def wait_joined(self, timeout: float) -> bool:
        """Wait (up to `timeout`) until a join through the bootstrap peers has succeeded and the
        node knows a peer now (`joined`): one that lost every contact since waits for a peer
        again. (It returned at once then, and a caller looping until `joined` held the event
        loop: a daemon whose only peer left answered nothing.)"""
        try:
            async with asyncio.timeout(timeout):
                await self._joined_event.wait()
                while not self.joined:
                    self._known_event.clear()
                    await self._known_event.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Cancel and await every background task. The transport stays open (its owner closes it)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._log.error("dht_task_failed", task=task.get_name(), exc_info=exc)

    # ---- public operations ------------------------------------------------------------------

    async def store(self, key: str, value: bytes, expiration: float, sub_key: str | None = None, *,
                    timeout: float | None = None) -> int:
        """Sign and store `value` under `key` (or `key`/`sub_key`) at the k nodes closest to the
        key, this one included when it is among them. Returns how many nodes accepted it (0: none).
        Raises an InvalidRecord subclass (e.g. ForbiddenWrite) if no honest node would take it,
        AccessDenied if `access` refuses to conceal it (a closed run's key, no run key held).
        The nodes hold what `access.conceal` made of `value` (for a closed run, ciphertext)."""
        value = bytes(value)
        if self.access is not None:
            value = self.access.conceal(key, sub_key, value)
        entry = Entry.create(self.identity, key, value, expiration, sub_key)
        if self.access is not None and (proof := self.access.credential(key)) is not None:
            entry = dataclasses.replace(entry, proof=proof)
        validate(entry, self._clock(), self.config.limits)
        self._own[(key, sub_key)] = entry
        return await self._replicate(entry, self._deadline(timeout))

    async def get(self, key: str, *, latest: bool = True, timeout: float | None = None,
                  replicas: int | None = None, min_expiration: float | None = None,
                  start: int = 0, by_route: bool = False) -> Record | None:
        """The live value of `key`: every signature checked, expired entries dropped. With `latest`,
        ask the `replicas` nodes closest to the key (default: all that hold it) and merge what
        they hold (newest per sub-key); without, stop at the first node that has it. With
        `min_expiration`, only entries expiring at or after it (the changes since a reader's last
        read, for a key that many peers update). `start`: once the key's nodes are known, ask
        `replicas` of them beginning with the start-th closest (counting round all that hold it),
        so that the readers of a key that hundreds of peers read spread over all its nodes
        instead of all asking the closest. None when no node has it. The entries' values are
        what their writers stored before `access.conceal` (a closed run's, decrypted); those
        `access.reveal` cannot read are left out (`unreadable_records`).

        `by_route` (with `latest`), for a key that many peers write (a run's progress board):
        when no route to its nodes is remembered, look up its nodes only (find_node, no
        entries), within half the deadline, then read every node found as a route (one node's
        entries, the others' summaries, then what only they hold; see `ask_route`), beginning
        with the `start`-th. A lookup for the key's entries gets them from every node near the
        key that holds it, each the whole key: 531 KB a read at 256 reports against 119 KB, 134
        KB against 45 KB at 64 (benchmarks/board.py). It costs the read a round trip more.
        Where that lookup is cut short, or the read fails or brings nothing, the key's entries
        are looked up as without `by_route`, in the time left."""
        now = self._clock()
        local = [] if self.config.client_mode else self.storage.get(key, now)
        if min_expiration is not None:
            local = [entry for entry in local if entry.expiration >= min_expiration]
        if local and not latest and (revealed := readable(self.access, local, self.stats)):
            return Record(key, tuple(revealed))
        key_id = key_id_of(key)
        count = self.config.replicas if replicas is None else max(1, min(replicas, self.config.replicas))
        deadline = self._deadline(timeout)
        found = None
        # spreading: a lookup finds all the key's nodes (not only `count`) and `count` are asked
        known = self.config.replicas if start else count
        route = self._routes.get(key_id, count, asyncio.get_running_loop().time()) if latest else None
        if route is not None and start:
            route = _from_start(self._routes.held(key_id), start)[:count]  # (of all it holds)
        complete = True
        if route is None and latest and by_route:
            found = await self._read_found_route(key_id, key, deadline, count, known, start,
                                                 min_expiration)
        elif route is not None:
            found = await self._ask_route(route, key, deadline, min_expiration)
            if found is None:
                self._routes.forget(key_id)
        if found is None:
            result = await self._lookup(key_id, deadline, key=key,
                                        stop=None if latest else (lambda r: bool(r.entries)),
                                        count=known, min_expiration=min_expiration)
            if latest:
                self._routes.remember(key_id, result, count, asyncio.get_running_loop().time())
            found = [e for entries in result.entries.values() for e in entries]
            complete = result.finished  # (nodes that failed in it are taken for gone)
        gathered = [*local, *found]
        merged = readable(self.access, merge_entries(gathered, self._clock()), self.stats)
        return Record(key, tuple(merged), complete) if merged else None

    async def _read_found_route(self, key_id: int, key: str, deadline: float, count: int,
                                known: int, start: int, min_expiration: float | None
                                ) -> list[Entry] | None:
        """`get(by_route=True)` without a remembered route: look up the key's nodes within half
        the time left and remember them; then read all of them as a route, from the
        `start`-th, so that a node near the key that holds news the others lack (a publish that
        reached only some; a node that withholds) is still read, once per route, for 16 bytes
        an entry. None (the caller looks the entries up) if the lookup was cut short or found
        none, or the read failed or brought nothing."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        result = await self._lookup(key_id, now + (deadline - now) / 2, count=known)
        self._routes.remember(key_id, result, count, loop.time())
        held = result.closest[:self._routes.keep]
        if not result.finished or not held:
            return None
        found = await self._ask_route(_from_start(held, start), key, deadline, min_expiration)
        if found is None:
            self._routes.forget(key_id)
        return found or None

    async def find_nodes(self, target: int, *, timeout: float | None = None) -> list[Contact]:
        """The (up to k) nodes closest to `target` that answered, nearest first."""
        return (await self._lookup(target, self._deadline(timeout))).closest

    async def introduce(self, peer_id: str, addresses: Sequence[PeerAddress] = (), *,
                        timeout: float | None = None) -> bool:
        """Ping a peer met outside the DHT (node.connect); if it serves the DHT it enters the
        routing table and we look up our own id through it. False if it did not answer."""
        try:
            await self._call(Contact(peer_id, tuple(addresses)), protocol.PING,
                             Message(self._caller_header()), self.config.rpc_timeout)
        except TransportError as exc:
            self._log.info("dht_introduce_failed", peer=peer_id[:12], error=str(exc))
            return False
        await self._lookup(self.node_id, self._deadline(timeout))
        if self.routing_table.get(peer_id) is not None:
            self._joined_event.set()
        return True

    async def addresses_of(self, peer_id: str, *, timeout: float | None = None) -> list[PeerAddress]:
        """How to dial `peer_id` as the DHT knows it: its routing-table entry, else a lookup of
        it (the transport asks this for a peer known only by id, e.g. a round's leader)."""
        node = self.routing_table.get(peer_id)
        if node is not None and node.addresses:
            return list(node.addresses)
        contact = await self.find_peer(peer_id, timeout=timeout)
        return [] if contact is None else list(contact.addresses)

    async def find_peer(self, peer_id: str, *, timeout: float | None = None) -> Contact | None:
        """Look up `peer_id` in the DHT; its contact if some node knows it (or it answered)."""
        if peer_id == self.peer_id:
            return Contact(peer_id, tuple(self._my_addresses()))
        contacts = await self.find_nodes(node_id_of(peer_id), timeout=timeout)
        return next((c for c in contacts if c.peer_id == peer_id), None)

    # ---- helpers of the parts ------------------------------------------------------------------

    def _my_addresses(self) -> list[PeerAddress]:
        return [] if self.config.client_mode else self.transport.listen_addresses()

    def _caller_header(self) -> dict[str, Any]:
        return protocol.encode_caller(self.config.client_mode, self._my_addresses())

    def _nearest(self, target: int, exclude: set[str] | frozenset[str] = frozenset(),
                 count: int | None = None) -> list[Contact]:
        nodes = self.routing_table.nearest(target, count or self.config.k, exclude=exclude)
        return [Contact(node.peer_id, node.addresses) for node in nodes]

    def _rpc_timeout(self, deadline: float) -> float:
        return min(self.config.rpc_timeout, deadline - asyncio.get_running_loop().time())

    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (timeout or self.config.lookup_timeout)


def _from_start(nodes: list[Contact], start: int) -> list[Contact]:
    """`nodes` beginning with the `start`-th (modulo their number), the others after in order:
    readers that pass different `start`s spread over a key's nodes."""
    first = start % len(nodes)
    return [*nodes[first:], *nodes[:first]]
