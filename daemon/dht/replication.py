"""Storing records at the nodes closest to their keys: a DHTNode's stores (its own records, and
their republishing) and the hand-over of held records to a newly seen node.

A record goes to the `replicas` nodes closest to its key, this node included when it is one of
them; the key's route (routes.py) spares the lookup while it lasts, and is forgotten when one of
its nodes did not take the record. A node that enters our routing table among the closest to a
held record's key is handed it by the `replication_senders` holders closest to the key (in each
holder's own view: views are alike, so a few send, not all).

Functions of a `DHTNode`, bound as its methods (`DHTNode._replicate`, `_replicate_to`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..net.errors import RemoteError, TransportError
from . import protocol
from .errors import DHTError
from .ids import key_id_of, node_id_of
from .protocol import Contact
from .records import Entry

if TYPE_CHECKING:
    from .node import DHTNode


async def replicate(node: DHTNode, entry: Entry, deadline: float) -> int:
    """Store `entry` at the `replicas` nodes closest to its key (this one included when it is one)."""
    key_id = key_id_of(entry.key)
    replicas = node.config.replicas
    targets = node._routes.get(key_id, replicas, asyncio.get_running_loop().time())
    if targets is None:
        found = await node._lookup(key_id, deadline, count=replicas)
        node._routes.remember(key_id, found, replicas, asyncio.get_running_loop().time())
        targets = found.closest[:replicas]
    stored = 0
    if not node.config.client_mode and (
            len(targets) < replicas
            or node.node_id ^ key_id < node_id_of(targets[-1].peer_id) ^ key_id):
        targets = targets[: replicas - 1]
        try:
            node.storage.store(entry, node._clock())
            stored += 1
        except DHTError as exc:
            node._log.info("dht_local_store_refused", key=entry.key, reason=type(exc).__name__)
    if targets:
        results = await asyncio.gather(*(_store_at(node, c, entry, deadline) for c in targets))
        stored += sum(results)
        if not all(results):
            node._routes.forget(key_id)
    return stored


async def _store_at(node: DHTNode, contact: Contact, entry: Entry, deadline: float) -> bool:
    message = protocol.encode_store(entry, node._caller_header())
    try:
        await node._call(contact, protocol.STORE, message, node._rpc_timeout(deadline))
    except RemoteError as exc:
        # a holder that has a newer record of it already (handing records to a new node,
        # which has just been sent the same report by its writer) is no news
        log_refusal = node._log.debug if exc.kind == "StaleRecord" else node._log.info
        log_refusal("dht_store_refused_by_peer", peer=contact.peer_id[:12], key=entry.key,
                    kind=exc.kind, error=exc.message)
        return False
    except TransportError as exc:
        node._log.debug("dht_store_failed", peer=contact.peer_id[:12], error=str(exc))
        return False
    return True


async def replicate_to(node: DHTNode, peer_id: str) -> None:
    """A new node joined our table: hand it the records it is now responsible for, for the keys
    where we are among the `replication_senders` closest holders we know of (views are alike,
    so a few send, not all k)."""
    newcomer = node.routing_table.get(peer_id)
    if newcomer is None:
        return
    k, sent = node.config.replicas, 0
    now = node._clock()
    for entry in list(node.storage.entries()):
        if entry.expiration <= now:
            continue
        key_id = key_id_of(entry.key)
        nearest = node.routing_table.nearest(key_id, k)
        if all(n.peer_id != peer_id for n in nearest):
            continue
        own_distance = node.node_id ^ key_id
        closer = sum(1 for n in nearest if n.peer_id != peer_id and n.node_id ^ key_id < own_distance)
        if closer >= node.config.replication_senders:
            continue  # closer holders will send it
        deadline = asyncio.get_running_loop().time() + node.config.rpc_timeout
        if not await _store_at(node, Contact(peer_id, newcomer.addresses), entry, deadline):
            if peer_id not in node.routing_table:
                return
        else:
            sent += 1
    if sent:
        node._log.debug("dht_replicated_to_new_node", peer=peer_id[:12], entries=sent)
