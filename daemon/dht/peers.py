"""Meeting other nodes: a DHTNode's RPCs to them, and what calls either way teach it about them.

A peer that answers us, or calls us and serves the DHT, is `seen`: it enters (or stays in) the
routing table, unless banned (bans.py). When its bucket is full, the bucket's least recently seen
node is pinged; a newcomer is handed the records it is now responsible for (replication.py). A
call that fails counts against the peer; one evicted for failing is kept among the lost contacts
(lost.py) and pinged again now and then (`probe_lost`, from the maintenance loop). The pings and
hand-overs run as background tasks, bounded by `max_background_tasks`.

Functions of a `DHTNode`, bound as its methods (`DHTNode._call`, `_seen`, `_probe_lost`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..net.addresses import PeerAddress
from ..net.errors import RemoteError, TransportError
from ..net.interface import Message
from . import protocol
from .ids import node_id_of
from .protocol import Contact
from .routing import NodeInfo

if TYPE_CHECKING:
    from .node import DHTNode

# Set while this node's RPC is under way in the current task. A lookup started inside one (the
# transport resolving the address of the peer being called, through this DHT) would call peers,
# which may need resolving in turn: with address-less contacts that never ends (it flooded the
# loop), so such a nested lookup finds nothing instead (queries.py).
IN_CALL: ContextVar[bool] = ContextVar("dht_in_call", default=False)


async def call(node: DHTNode, contact: Contact, method: str, message: Message, timeout: float) -> Message:
    """Call `contact`; it is `seen` if it answers, counted against (and maybe lost) if it fails."""
    if contact.addresses:  # second-hand: other nodes' (or our table's) view of the peer
        node.transport.learn_addresses(contact.peer_id, list(contact.addresses), first_hand=False)
    in_call = IN_CALL.set(True)
    try:
        reply = await node.transport.call(contact.peer_id, method, message,
                                          timeout=max(timeout, 0.001))
    except RemoteError:
        node.routing_table.mark_seen(contact.peer_id, asyncio.get_running_loop().time())  # alive, refused
        raise
    except TransportError as exc:
        node.stats["rpc_failed"] += 1
        known = node.routing_table.get(contact.peer_id)
        if node.routing_table.mark_failed(contact.peer_id) and known is not None:
            node._lost.lose(Contact(known.peer_id, known.addresses), asyncio.get_running_loop().time())
        node._log.debug("dht_rpc_failed", peer=contact.peer_id[:12], method=method,
                        kind=type(exc).__name__, error=str(exc)[:200], timeout=round(timeout, 3))
        raise
    finally:
        IN_CALL.reset(in_call)
    node._seen(contact.peer_id, contact.addresses)
    return reply


def seen(node: DHTNode, peer_id: str, addresses: tuple[PeerAddress, ...]) -> None:
    """`peer_id` answered or called us: keep it in the routing table."""
    loop = asyncio.get_running_loop()
    if node._bans.banned(peer_id, loop.time()):
        return
    table = node.routing_table
    is_new = peer_id not in table
    try:
        node_id = node_id_of(peer_id)
    except ValueError:
        return
    stale = table.add_or_update(NodeInfo(peer_id, node_id, addresses), loop.time())
    if peer_id in table:
        node._known_event.set()
    if stale is not None and stale.peer_id not in node._busy:
        _background(node, stale.peer_id, _ping_quietly(node, stale.peer_id), "dht-ping-stale")
    elif is_new and peer_id in table and len(node.storage) and not node.config.client_mode:
        _background(node, peer_id, node._replicate_to(peer_id), "dht-replicate")


def _background(node: DHTNode, peer_id: str, coro: Coroutine[Any, Any, Any], name: str) -> None:
    if node._closed or len(node._tasks) >= node.config.max_background_tasks:
        coro.close()  # at capacity: the next maintenance round catches up
        return
    node._busy.add(peer_id)
    task = node._spawn(coro, name)
    task.add_done_callback(lambda _: node._busy.discard(peer_id))


async def _ping_quietly(node: DHTNode, peer_id: str) -> None:
    known = node.routing_table.get(peer_id)
    if known is None:
        return
    try:
        await node._call(Contact(peer_id, known.addresses), protocol.PING,
                         Message(node._caller_header()), node.config.rpc_timeout)
    except TransportError as exc:
        node._log.debug("dht_ping_failed", peer=peer_id[:12], error=str(exc))


async def probe_lost(node: DHTNode) -> None:
    """Ping the lost contacts that are due again (lost.py), in the background."""
    now = asyncio.get_running_loop().time()
    for contact in node._lost.due(now, node.routing_table):
        _background(node, contact.peer_id, _ping_lost(node, contact), "dht-ping-lost")


async def _ping_lost(node: DHTNode, contact: Contact) -> None:
    try:
        await node._call(contact, protocol.PING, Message(node._caller_header()),
                         node.config.rpc_timeout)
    except TransportError:
        return
    node._lost.found(contact.peer_id)
    node.stats["lost_contacts_back"] += 1
