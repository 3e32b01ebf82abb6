"""A DHTNode's joining and its maintenance loop (the background task `DHTNode.start` spawns):
- joining: connect to the bootstrap addresses, look up our own id, then a random id in every
  bucket; while the routing table is empty this is retried with capped exponential backoff;
- discovery: while fewer than k peers are known, a lookup of our own id, less and less often;
- bucket refresh: a lookup of a random id in every bucket no lookup touched in `refresh_interval`;
- pings of lost contacts that are due again (peers.py, lost.py);
- expiry sweeps of the record store;
- republish of our own records every `republish_interval`, until they expire.

Functions of a `DHTNode`, bound as its methods (`DHTNode._join`, `_maintain`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..net.errors import TransportError
from ..net.interface import Message
from . import protocol
from .protocol import Contact
from .routing import RoutingTable

if TYPE_CHECKING:
    from .node import DHTNode


async def join(node: DHTNode) -> bool:
    """Contact the bootstrap peers, look up our own id, then refresh every bucket."""
    header = node._caller_header()
    for address in node._bootstrap:
        try:
            peer_id = await node.transport.connect(address, timeout=node.config.rpc_timeout)
            await node._call(Contact(peer_id, (address,)), protocol.PING, Message(header),
                             node.config.rpc_timeout)
        except TransportError as exc:
            node._log.info("dht_bootstrap_peer_failed", address=str(address), error=str(exc))
    if not node.joined:
        node._log.warning("dht_bootstrap_failed", addresses=[str(a) for a in node._bootstrap])
        return False
    await node._lookup(node.node_id, node._deadline(None))
    await _refresh(node, force=True)
    node._log.info("dht_joined", known=len(node.routing_table))
    node._joined_event.set()
    return True


async def _refresh(node: DHTNode, *, force: bool = False) -> None:
    loop = asyncio.get_running_loop()
    interval = -1.0 if force else node.config.refresh_interval
    for bucket in node.routing_table.stale_buckets(loop.time(), interval):
        await node._lookup(RoutingTable.random_id_in(bucket, node._rng), node._deadline(None))


async def _republish(node: DHTNode) -> None:
    now = node._clock()
    for key, entry in list(node._own.items()):
        if entry.expiration <= now:
            del node._own[key]
            continue
        await node._replicate(entry, node._deadline(None))


async def maintain(node: DHTNode) -> None:
    """The maintenance loop; runs until cancelled (`DHTNode.close`)."""
    config = node.config
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
        if not node.joined and node._bootstrap:
            if await node._join():
                backoff = config.bootstrap_backoff
                continue
            delay = backoff * (0.5 + node._rng.random())
            backoff = min(backoff * 2, config.bootstrap_backoff_max)
            node._log.info("dht_bootstrap_retry", in_seconds=round(delay, 3))
            await asyncio.sleep(delay)
            continue
        await asyncio.sleep(config.maintenance_period)
        if len(node.routing_table) < config.k and loop.time() >= next_discover:
            await node._lookup(node.node_id, node._deadline(None))
            discover_every = min(discover_every * 2, config.refresh_interval)
            next_discover = loop.time() + discover_every
        await _refresh(node)
        await node._probe_lost()
        if loop.time() >= next_sweep:
            next_sweep = loop.time() + config.sweep_interval
            swept = node.storage.sweep(node._clock())
            if swept:
                node._log.debug("dht_swept", entries=swept)
        if loop.time() >= next_republish:
            next_republish = loop.time() + config.republish_interval
            await _republish(node)
