"""`DHTNode`: Kademlia over a `PeerTransport` (RPC handlers, lookups, store/get, maintenance).

The pure parts live apart: ids.py (metric), routing.py (k-buckets), records.py and storage.py
(signed expiring entries), protocol.py (wire codecs), lookup.py (the iterative lookup). This
module wires them to the network and owns the background tasks:
- joining: connect to the bootstrap addresses, look up our own id, then a random id in every
  bucket; while the routing table is empty this is retried with capped exponential backoff;
- bucket refresh: a lookup of a random id in every bucket no lookup touched in `refresh_interval`;
- republish of our own records every `republish_interval`, until they expire;
- replication of held records to a newly seen node that is among the k closest to their key
  (sent by the holder that is closest to the key in its own view);
- expiry sweeps of the record store.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from .. import timebase
from ..identity import Identity
from ..net.addresses import PeerAddress
from ..net.errors import RemoteError, TransportError
from ..net.interface import Message, PeerTransport, RequestContext
from . import protocol
from .errors import AccessDenied, DHTError, InvalidRecord, MalformedMessage
from .ids import key_id_of, node_id_of
from .lookup import LookupResult, QueryReply, iterative_lookup
from .protocol import Contact
from .records import Entry, Record, RecordLimits, merge_entries, validate
from .routing import NodeInfo, RoutingTable
from .storage import RecordStore

log = structlog.get_logger(__name__)

ROUTE_SECONDS = 30.0  # how long the closest nodes of a key found by a lookup are used again
ROUTE_CACHE_KEYS = 256
LOST_CONTACTS = 256  # evicted contacts kept to be tried again (see _lose)
LOST_PROBES = 3  # per maintenance round
LOST_RETRY_SECONDS = 30.0
LOST_FORGET_SECONDS = 3600.0


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


class KeyAccess(Protocol):
    """Who may read and write which keys (closed runs' keys; see daemon/collab/membership.py).
    `authorize_*` raise AccessDenied (or a subclass) to refuse."""

    def credential(self, key: str) -> str | None: ...

    def authorize_read(self, peer_id: str, key: str, token: Any) -> None: ...

    def authorize_write(self, signer: str, key: str, proof: Any) -> None: ...

    def stored(self, entry: Entry) -> None:
        """`entry` was stored here (a revocation list, say, is worth learning from)."""

    def conceal(self, key: str, sub_key: str | None, value: bytes) -> bytes:
        """The bytes to sign and store for `value` (a closed run's are encrypted for its members;
        raise AccessDenied when this node may not write them)."""

    def reveal(self, entry: Entry) -> bytes | None:
        """The value of `entry` as its writer gave it to `conceal`; None if this node cannot read
        it (the entry is then dropped from what `get` returns)."""


# Set while this node's RPC is under way in the current task. A lookup started inside one (the
# transport resolving the address of the peer being called, through this DHT) would call peers,
# which may need resolving in turn: with address-less contacts that never ends (it flooded the
# loop), so such a nested lookup finds nothing instead.
_IN_CALL: ContextVar[bool] = ContextVar("dht_in_call", default=False)

_Handler = Callable[["DHTNode", RequestContext, Message], Awaitable[Message]]
_Query = Callable[[Contact], Awaitable[QueryReply]]


def _counts_malformed(handler: _Handler) -> _Handler:
    """A request the handler cannot read is refused (MalformedMessage) and counted."""

    @functools.wraps(handler)
    async def counted(self: DHTNode, ctx: RequestContext, message: Message) -> Message:
        try:
            return await handler(self, ctx, message)
        except MalformedMessage as exc:
            self.stats["malformed_requests"] += 1
            self._log.info("dht_malformed_request", sender=ctx.peer_id[:12], error=str(exc)[:200])
            raise

    return counted


class DHTNode:
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
        self._banned: dict[str, float] = {}  # peer id -> loop time when the ban ends
        self._started = False
        self._closed = False
        self._joined_event = asyncio.Event()  # the first join succeeded
        self._known_event = asyncio.Event()  # the routing table gained a peer (wait_joined)
        self._routes: dict[int, tuple[float, list[Contact]]] = {}  # key id -> (until, closest)
        self._lost: collections.OrderedDict[str, tuple[Contact, float, float]] = \
            collections.OrderedDict()
        self._log = log.bind(peer_id=self.peer_id[:12], client=self.config.client_mode)

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
                  start: int = 0) -> Record | None:
        """The live value of `key`: every signature checked, expired entries dropped. With `latest`,
        ask the `replicas` nodes closest to the key (default: all that hold it) and merge what
        they hold (newest per sub-key); without, stop at the first node that has it. With
        `min_expiration`, only entries expiring at or after it (the changes since a reader's last
        read, for a key that many peers update). `start`: once the key's nodes are known, ask
        `replicas` of them beginning with the start-th closest (counting round all that hold it),
        so that the readers of a key that hundreds of peers read spread over all its nodes
        instead of all asking the closest. None when no node has it. The entries' values are
        what their writers stored before `access.conceal` (a closed run's, decrypted); those
        `access.reveal` cannot read are left out (`unreadable_records`)."""
        now = self._clock()
        local = [] if self.config.client_mode else self.storage.get(key, now)
        if min_expiration is not None:
            local = [entry for entry in local if entry.expiration >= min_expiration]
        if local and not latest and (readable := self._readable(local)):
            return Record(key, tuple(readable))
        key_id = key_id_of(key)
        count = self.config.replicas if replicas is None else max(1, min(replicas, self.config.replicas))
        deadline = self._deadline(timeout)
        found = None
        # spreading: a lookup finds all the key's nodes (not only `count`) and `count` are asked
        known = self.config.replicas if start else count
        route = self._route(key_id, count) if latest else None
        if route is not None and start:
            held = self._routes[key_id][1]  # (all of them that the route holds)
            first = start % len(held)
            route = [*held[first:], *held[:first]][:count]
        complete = True
        if route is not None:
            found = await self._ask_route(route, key, deadline, min_expiration)
            if found is None:
                self._forget_route(key_id)
        if found is None:
            result = await self._lookup(key_id, deadline, key=key,
                                        stop=None if latest else (lambda r: bool(r.entries)),
                                        count=known, min_expiration=min_expiration)
            if latest:
                self._remember_route(key_id, result, count)
            found = [e for entries in result.entries.values() for e in entries]
            complete = result.finished  # (nodes that failed in it are taken for gone)
        gathered = [*local, *found]
        merged = self._readable(merge_entries(gathered, self._clock()))
        return Record(key, tuple(merged), complete) if merged else None

    def _readable(self, entries: list[Entry]) -> list[Entry]:
        """`entries` with the values their writers gave (see `get`); unreadable ones left out.
        (Their signatures are over the stored bytes: such entries are for reading, not storing.)"""
        if self.access is None:
            return entries
        readable = []
        for entry in entries:
            value = self.access.reveal(entry)
            if value is None:
                self.stats["unreadable_records"] += 1
            elif value is entry.value:
                readable.append(entry)
            else:
                readable.append(dataclasses.replace(entry, value=value))
        return readable

    async def _ask_route(self, route: list[Contact], key: str, deadline: float,
                         min_expiration: float | None) -> list[Entry] | None:
        """find_value at the remembered closest nodes of `key`; None if any of them failed."""
        query = self._value_query(key, deadline, min_expiration)

        async def ask(contact: Contact) -> list[Entry] | None:
            try:
                return (await query(contact)).entries
            except (TransportError, MalformedMessage, TimeoutError):
                return None

        replies = await asyncio.gather(*(ask(c) for c in route))
        if any(reply is None for reply in replies):
            return None
        return [entry for reply in replies if reply is not None for entry in reply]

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

    # ---- RPC handlers -----------------------------------------------------------------------

    def _note_caller(self, ctx: RequestContext, header: dict[str, Any]) -> None:
        self.stats["rpc_in"] += 1
        caller = protocol.decode_caller(header)
        if caller.client or ctx.peer_id == self.peer_id:
            return
        addresses = caller.addresses or ctx.addresses
        if addresses:
            self.transport.learn_addresses(ctx.peer_id, list(addresses))
        self._seen(ctx.peer_id, addresses)

    @_counts_malformed
    async def _on_ping(self, ctx: RequestContext, message: Message) -> Message:
        self._note_caller(ctx, message.header)
        return Message({})

    @_counts_malformed
    async def _on_find_node(self, ctx: RequestContext, message: Message) -> Message:
        self._note_caller(ctx, message.header)
        target = protocol.decode_target(message.header)
        return Message({"nodes": protocol.encode_contacts(self._nearest(target, exclude={ctx.peer_id}))})

    @_counts_malformed
    async def _on_find_value(self, ctx: RequestContext, message: Message) -> Message:
        self._note_caller(ctx, message.header)
        key = protocol.decode_key(message.header)
        if self.access is not None:
            try:
                self.access.authorize_read(ctx.peer_id, key, message.header.get("token"))
            except AccessDenied:
                self.stats["reads_refused"] += 1
                raise
        entries = self.storage.get(key, self._clock())
        since = protocol.decode_min_expiration(message.header)
        if since is not None:
            entries = [entry for entry in entries if entry.expiration >= since]
        return protocol.encode_values(entries, self._nearest(key_id_of(key), exclude={ctx.peer_id}),
                                      compress=protocol.accepts_zlib(message.header))

    @_counts_malformed
    async def _on_store(self, ctx: RequestContext, message: Message) -> Message:
        self._note_caller(ctx, message.header)
        entry = protocol.decode_store(message)
        try:
            if self.access is not None:
                # the signature first: a refusal is then counted against a signer that signed
                validate(entry, self._clock(), self.config.limits)
                self.access.authorize_write(entry.signer, entry.key, entry.proof)
            stored = self.storage.store(entry, self._clock())
            if stored and self.access is not None:
                self.access.stored(entry)
        except DHTError as exc:
            self.stats["stores_refused"] += 1
            self._log.debug("dht_store_refused", sender=ctx.peer_id[:12], key=entry.key[:80],
                           sub_key=entry.sub_key, reason=type(exc).__name__)
            raise
        return Message({"stored": stored})

    # ---- outgoing RPCs ----------------------------------------------------------------------

    def _my_addresses(self) -> list[PeerAddress]:
        return [] if self.config.client_mode else self.transport.listen_addresses()

    def _caller_header(self) -> dict[str, Any]:
        return protocol.encode_caller(self.config.client_mode, self._my_addresses())

    def _nearest(self, target: int, exclude: set[str] | frozenset[str] = frozenset(),
                 count: int | None = None) -> list[Contact]:
        nodes = self.routing_table.nearest(target, count or self.config.k, exclude=exclude)
        return [Contact(node.peer_id, node.addresses) for node in nodes]

    def _seen(self, peer_id: str, addresses: tuple[PeerAddress, ...]) -> None:
        """`peer_id` answered or called us: keep it in the routing table."""
        if self._is_banned(peer_id):
            return
        table = self.routing_table
        is_new = peer_id not in table
        try:
            node_id = node_id_of(peer_id)
        except ValueError:
            return
        stale = table.add_or_update(NodeInfo(peer_id, node_id, addresses),
                                    asyncio.get_running_loop().time())
        if peer_id in table:
            self._known_event.set()
        if stale is not None and stale.peer_id not in self._busy:
            self._background(stale.peer_id, self._ping_quietly(stale.peer_id), "dht-ping-stale")
        elif is_new and peer_id in table and len(self.storage) and not self.config.client_mode:
            self._background(peer_id, self._replicate_to(peer_id), "dht-replicate")

    def _background(self, peer_id: str, coro: Coroutine[Any, Any, Any], name: str) -> None:
        if self._closed or len(self._tasks) >= self.config.max_background_tasks:
            coro.close()  # at capacity: the next maintenance round catches up
            return
        self._busy.add(peer_id)
        task = self._spawn(coro, name)
        task.add_done_callback(lambda _: self._busy.discard(peer_id))

    async def _call(self, contact: Contact, method: str, message: Message, timeout: float) -> Message:
        if contact.addresses:  # second-hand: other nodes' (or our table's) view of the peer
            self.transport.learn_addresses(contact.peer_id, list(contact.addresses), first_hand=False)
        in_call = _IN_CALL.set(True)
        try:
            reply = await self.transport.call(contact.peer_id, method, message,
                                              timeout=max(timeout, 0.001))
        except RemoteError:
            self.routing_table.mark_seen(contact.peer_id, asyncio.get_running_loop().time())  # alive, refused
            raise
        except TransportError as exc:
            self.stats["rpc_failed"] += 1
            node = self.routing_table.get(contact.peer_id)
            if self.routing_table.mark_failed(contact.peer_id) and node is not None:
                self._lose(Contact(node.peer_id, node.addresses))
            self._log.debug("dht_rpc_failed", peer=contact.peer_id[:12], method=method,
                            kind=type(exc).__name__, error=str(exc)[:200], timeout=round(timeout, 3))
            raise
        finally:
            _IN_CALL.reset(in_call)
        self._seen(contact.peer_id, contact.addresses)
        return reply

    # ---- lost contacts: peers evicted for failing, tried again now and then -----------------
    # A network cut makes each side evict the other from its routing tables; lookups then only
    # ever meet their own side, and the swarm would stay split in two after the cut heals. So
    # evicted contacts are kept a while and pinged again, a few at a time: one that answers is
    # back in the table, and lookups reach across again.

    def _lose(self, contact: Contact) -> None:
        lost, now = self._lost, asyncio.get_running_loop().time()
        lost.pop(contact.peer_id, None)
        lost[contact.peer_id] = (contact, now, now)  # (contact, lost at, last tried)
        while len(lost) > LOST_CONTACTS:
            lost.popitem(last=False)

    async def _probe_lost(self) -> None:
        now = asyncio.get_running_loop().time()
        for peer_id in [p for p, (_, lost_at, _) in self._lost.items()
                        if now - lost_at > LOST_FORGET_SECONDS]:
            del self._lost[peer_id]
        due = [(peer_id, contact, lost_at) for peer_id, (contact, lost_at, tried) in self._lost.items()
               if now - tried >= LOST_RETRY_SECONDS and peer_id not in self.routing_table]
        for peer_id, contact, lost_at in due[:LOST_PROBES]:
            del self._lost[peer_id]
            self._lost[peer_id] = (contact, lost_at, now)  # to the end: the others go first
            self._background(peer_id, self._ping_lost(contact), "dht-ping-lost")

    async def _ping_lost(self, contact: Contact) -> None:
        try:
            await self._call(contact, protocol.PING, Message(self._caller_header()),
                             self.config.rpc_timeout)
        except TransportError:
            return
        self._lost.pop(contact.peer_id, None)
        self.stats["lost_contacts_back"] += 1

    async def _ping_quietly(self, peer_id: str) -> None:
        node = self.routing_table.get(peer_id)
        if node is None:
            return
        try:
            await self._call(Contact(peer_id, node.addresses), protocol.PING,
                             Message(self._caller_header()), self.config.rpc_timeout)
        except TransportError as exc:
            self._log.debug("dht_ping_failed", peer=peer_id[:12], error=str(exc))

    def _rpc_timeout(self, deadline: float) -> float:
        return min(self.config.rpc_timeout, deadline - asyncio.get_running_loop().time())

    async def _lookup(self, target: int, deadline: float, *, key: str | None = None,
                      stop: Callable[[LookupResult], bool] | None = None,
                      count: int | None = None, min_expiration: float | None = None) -> LookupResult:
        if _IN_CALL.get():  # see _IN_CALL
            self.stats["nested_lookups_refused"] += 1
            return LookupResult([], {}, False, 0, 0)
        header = self._caller_header()

        async def find_node(contact: Contact) -> QueryReply:
            message = Message({**header, "target": protocol.encode_target(target)})
            reply = await self._call(contact, protocol.FIND_NODE, message, self._rpc_timeout(deadline))
            return QueryReply(protocol.decode_contacts(reply.header.get("nodes", [])))

        query = find_node if key is None else self._value_query(key, deadline, min_expiration)
        result = await iterative_lookup(
            target, self._nearest(target), self._counts_malformed(query),
            k=count or self.config.k, alpha=self.config.alpha, deadline=deadline,
            exclude=frozenset({self.peer_id, *self._banned}), stop=stop)
        self.routing_table.touch(target, asyncio.get_running_loop().time())
        return result

    def _value_query(self, key: str, deadline: float, min_expiration: float | None) -> _Query:
        request: dict[str, Any] = {**self._caller_header(), "key": key, "accept": protocol.ACCEPT}
        token = None if self.access is None else self.access.credential(key)
        if token is not None:
            request["token"] = token
        if min_expiration is not None:
            request["min_expiration"] = min_expiration

        async def find_value(contact: Contact) -> QueryReply:
            reply = await self._call(contact, protocol.FIND_VALUE, Message(request),
                                     self._rpc_timeout(deadline))
            entries, contacts = protocol.decode_values(key, reply)
            return QueryReply(contacts, self._checked(contact.peer_id, entries))

        return find_value

    def _counts_malformed(self, query: _Query) -> _Query:
        """A reply that cannot be read is counted; the lookup counts its sender as failed."""

        async def counted(contact: Contact) -> QueryReply:
            try:
                return await query(contact)
            except MalformedMessage as exc:
                self.stats["malformed_replies"] += 1
                self._log.info("dht_malformed_reply", sender=contact.peer_id[:12], error=str(exc)[:200])
                raise

        return counted

    def _ban(self, peer_id: str) -> None:
        self.routing_table.remove(peer_id)
        if len(self._banned) >= 4096:  # bounded: forget the ban that ends first
            del self._banned[min(self._banned, key=self._banned.__getitem__)]
        self._banned[peer_id] = asyncio.get_running_loop().time() + self.config.ban_seconds

    def _is_banned(self, peer_id: str) -> bool:
        until = self._banned.get(peer_id)
        if until is None:
            return False
        if until > asyncio.get_running_loop().time():
            return True
        del self._banned[peer_id]
        return False

    def _checked(self, peer_id: str, entries: list[Entry]) -> list[Entry]:
        """The entries that pass validation; a peer that returns a forged one leaves our table,
        and none of its reply is used."""
        now, good = self._clock(), []
        for entry in entries:
            if entry.expiration <= now:
                # It expired on its way here (the sender checked it at its own "now"): an honest
                # race, not a forgery. Drop it without blaming the sender.
                self.stats["expired_in_transit"] += 1
                continue
            try:
                validate(entry, now, self.config.limits)
            except InvalidRecord as exc:
                # the rest of its reply is dropped unchecked (a reply of a thousand forged entries
                # would cost a thousand signature checks and log lines)
                self.stats["forged_records"] += 1
                self._log.warning("dht_invalid_record_received", sender=peer_id[:12], key=entry.key,
                                  sub_key=entry.sub_key, reason=type(exc).__name__, error=str(exc))
                self._ban(peer_id)
                return []
            if self.access is not None:
                try:  # a closed run's record needs its writer's membership proof, read or stored
                    self.access.authorize_write(entry.signer, entry.key, entry.proof)
                except DHTError:  # (dropped, the sender not blamed: a node that knows
                    self.stats["unproven_records"] += 1  # no closed runs may store anything)
                    continue
            good.append(entry)
        return good

    # ---- routes: the nodes closest to a key, remembered a while --------------------------------
    # A key that is stored and read again and again (a run's progress: every peer, several times
    # an epoch) has the same closest nodes from one minute to the next; remembering them spares
    # an iterative lookup per operation. A route whose node fails is forgotten.

    def _route(self, key_id: int, count: int) -> list[Contact] | None:
        held = self._routes.get(key_id)
        if held is None:
            return None
        until, contacts = held
        if until <= asyncio.get_running_loop().time() or len(contacts) < count:
            del self._routes[key_id]
            return None
        return contacts[:count]

    def _remember_route(self, key_id: int, result: LookupResult, count: int) -> None:
        if not result.finished or len(result.closest) < count:
            return  # a cut-short lookup may have missed closer nodes: not worth keeping
        if len(self._routes) >= ROUTE_CACHE_KEYS:
            del self._routes[next(iter(self._routes))]
        until = asyncio.get_running_loop().time() + ROUTE_SECONDS
        self._routes[key_id] = (until, result.closest[: self.config.replicas])

    def _forget_route(self, key_id: int) -> None:
        self._routes.pop(key_id, None)

    async def _replicate(self, entry: Entry, deadline: float) -> int:
        """Store `entry` at the `replicas` nodes closest to its key (this one included when it is one)."""
        key_id = key_id_of(entry.key)
        replicas = self.config.replicas
        targets = self._route(key_id, replicas)
        if targets is None:
            found = await self._lookup(key_id, deadline, count=replicas)
            self._remember_route(key_id, found, replicas)
            targets = found.closest[:replicas]
        stored = 0
        if not self.config.client_mode and (
                len(targets) < replicas
                or self.node_id ^ key_id < node_id_of(targets[-1].peer_id) ^ key_id):
            targets = targets[: replicas - 1]
            try:
                self.storage.store(entry, self._clock())
                stored += 1
            except DHTError as exc:
                self._log.info("dht_local_store_refused", key=entry.key, reason=type(exc).__name__)
        if targets:
            results = await asyncio.gather(*(self._store_at(c, entry, deadline) for c in targets))
            stored += sum(results)
            if not all(results):
                self._forget_route(key_id)
        return stored

    async def _store_at(self, contact: Contact, entry: Entry, deadline: float) -> bool:
        message = protocol.encode_store(entry, self._caller_header())
        try:
            await self._call(contact, protocol.STORE, message, self._rpc_timeout(deadline))
        except RemoteError as exc:
            # a holder that has a newer record of it already (handing records to a new node,
            # which has just been sent the same report by its writer) is no news
            log_refusal = self._log.debug if exc.kind == "StaleRecord" else self._log.info
            log_refusal("dht_store_refused_by_peer", peer=contact.peer_id[:12], key=entry.key,
                        kind=exc.kind, error=exc.message)
            return False
        except TransportError as exc:
            self._log.debug("dht_store_failed", peer=contact.peer_id[:12], error=str(exc))
            return False
        return True

    async def _replicate_to(self, peer_id: str) -> None:
        """A new node joined our table: hand it the records it is now responsible for, for the keys
        where we are among the `replication_senders` closest holders we know of (views are alike,
        so a few send, not all k)."""
        node = self.routing_table.get(peer_id)
        if node is None:
            return
        k, sent = self.config.replicas, 0
        now = self._clock()
        for entry in list(self.storage.entries()):
            if entry.expiration <= now:
                continue
            key_id = key_id_of(entry.key)
            nearest = self.routing_table.nearest(key_id, k)
            if all(n.peer_id != peer_id for n in nearest):
                continue
            own_distance = self.node_id ^ key_id
            closer = sum(1 for n in nearest if n.peer_id != peer_id and n.node_id ^ key_id < own_distance)
            if closer >= self.config.replication_senders:
                continue  # closer holders will send it
            deadline = asyncio.get_running_loop().time() + self.config.rpc_timeout
            if not await self._store_at(Contact(peer_id, node.addresses), entry, deadline):
                if peer_id not in self.routing_table:
                    return
            else:
                sent += 1
        if sent:
            self._log.debug("dht_replicated_to_new_node", peer=peer_id[:12], entries=sent)

    # ---- joining and maintenance ------------------------------------------------------------

    def _deadline(self, timeout: float | None) -> float:
        return asyncio.get_running_loop().time() + (timeout or self.config.lookup_timeout)

    async def _join(self) -> bool:
        """Contact the bootstrap peers, look up our own id, then refresh every bucket."""
        header = self._caller_header()
        for address in self._bootstrap:
            try:
                peer_id = await self.transport.connect(address, timeout=self.config.rpc_timeout)
                await self._call(Contact(peer_id, (address,)), protocol.PING, Message(header),
                                 self.config.rpc_timeout)
            except TransportError as exc:
                self._log.info("dht_bootstrap_peer_failed", address=str(address), error=str(exc))
        if not self.joined:
            self._log.warning("dht_bootstrap_failed", addresses=[str(a) for a in self._bootstrap])
            return False
        await self._lookup(self.node_id, self._deadline(None))
        await self._refresh(force=True)
        self._log.info("dht_joined", known=len(self.routing_table))
        self._joined_event.set()
        return True

    async def _refresh(self, *, force: bool = False) -> None:
        loop = asyncio.get_running_loop()
        interval = -1.0 if force else self.config.refresh_interval
        for bucket in self.routing_table.stale_buckets(loop.time(), interval):
            await self._lookup(RoutingTable.random_id_in(bucket, self._rng), self._deadline(None))

    async def _republish(self) -> None:
        now = self._clock()
        for key, entry in list(self._own.items()):
            if entry.expiration <= now:
                del self._own[key]
                continue
            await self._replicate(entry, self._deadline(None))

    async def _maintain(self) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        backoff = config.bootstrap_backoff
        next_republish = loop.time() + config.republish_interval
        next_sweep = loop.time() + config.sweep_interval
        # While we know fewer than k peers, the swarm may hold peers that joined at the same time
        # as us through the same bootstrap peer (neither knew the other then): look up our own id
        # again, every few seconds at first, less often later, so small swarms link up quickly.
        discover_every = config.maintenance_period
        next_discover = loop.time() + discover_every
        while True:
            if not self.joined and self._bootstrap:
                if await self._join():
                    backoff = config.bootstrap_backoff
                    continue
                delay = backoff * (0.5 + self._rng.random())
                backoff = min(backoff * 2, config.bootstrap_backoff_max)
                self._log.info("dht_bootstrap_retry", in_seconds=round(delay, 3))
                await asyncio.sleep(delay)
                continue
            await asyncio.sleep(config.maintenance_period)
            if len(self.routing_table) < config.k and loop.time() >= next_discover:
                await self._lookup(self.node_id, self._deadline(None))
                discover_every = min(discover_every * 2, config.refresh_interval)
                next_discover = loop.time() + discover_every
            await self._refresh()
            await self._probe_lost()
            if loop.time() >= next_sweep:
                next_sweep = loop.time() + config.sweep_interval
                swept = self.storage.sweep(self._clock())
                if swept:
                    self._log.debug("dht_swept", entries=swept)
            if loop.time() >= next_republish:
                next_republish = loop.time() + config.republish_interval
                await self._republish()
