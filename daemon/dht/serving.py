"""The DHT RPCs a node answers for other nodes: PING, FIND_NODE, FIND_VALUE and STORE.

Functions of a `DHTNode`, bound as its methods (`DHTNode._on_ping`, ...) and registered with the
transport by `DHTNode.start` unless the node is in client mode. A caller that is not a client
enters the routing table (`note_caller`); reads and stores of closed runs' keys are checked with
the node's `KeyAccess` (access.py); requests that cannot be read (`malformed_requests`) and
refused reads and stores (`reads_refused`, `stores_refused`) are counted in `DHTNode.stats`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..net.interface import Message, RequestContext
from . import protocol
from .errors import AccessDenied, DHTError, MalformedMessage
from .ids import key_id_of
from .records import validate

if TYPE_CHECKING:
    from .node import DHTNode

Handler = Callable[["DHTNode", RequestContext, Message], Awaitable[Message]]


def _counts_malformed(handler: Handler) -> Handler:
    """A request the handler cannot read is refused (MalformedMessage) and counted."""

    @functools.wraps(handler)
    async def counted(node: DHTNode, ctx: RequestContext, message: Message) -> Message:
        try:
            return await handler(node, ctx, message)
        except MalformedMessage as exc:
            node.stats["malformed_requests"] += 1
            node._log.info("dht_malformed_request", sender=ctx.peer_id[:12], error=str(exc)[:200])
            raise

    return counted


def note_caller(node: DHTNode, ctx: RequestContext, header: dict[str, Any]) -> None:
    """Count the request; a caller that serves the DHT is `seen` (where it says it listens)."""
    node.stats["rpc_in"] += 1
    caller = protocol.decode_caller(header)
    if caller.client or ctx.peer_id == node.peer_id:
        return
    addresses = caller.addresses or ctx.addresses
    if addresses:
        node.transport.learn_addresses(ctx.peer_id, list(addresses))
    node._seen(ctx.peer_id, addresses)


@_counts_malformed
async def on_ping(node: DHTNode, ctx: RequestContext, message: Message) -> Message:
    note_caller(node, ctx, message.header)
    return Message({})


@_counts_malformed
async def on_find_node(node: DHTNode, ctx: RequestContext, message: Message) -> Message:
    note_caller(node, ctx, message.header)
    target = protocol.decode_target(message.header)
    return Message({"nodes": protocol.encode_contacts(node._nearest(target, exclude={ctx.peer_id}))})


@_counts_malformed
async def on_find_value(node: DHTNode, ctx: RequestContext, message: Message) -> Message:
    note_caller(node, ctx, message.header)
    key = protocol.decode_key(message.header)
    if node.access is not None:
        try:
            node.access.authorize_read(ctx.peer_id, key, message.header.get("token"))
        except AccessDenied:
            node.stats["reads_refused"] += 1
            raise
    header = message.header
    since = protocol.decode_min_expiration(header)
    want = protocol.decode_want(header)
    summary = protocol.decode_flag(header, "summary", False)
    contacts = protocol.decode_flag(header, "nodes", True)
    entries = node.storage.get(key, node._clock())
    if since is not None:
        entries = [entry for entry in entries if entry.expiration >= since]
    if want is not None:
        entries = [e for e in entries if protocol.sub_key_digest(e.sub_key) in want]
    if summary:
        return protocol.encode_summary(entries)
    nearest = node._nearest(key_id_of(key), exclude={ctx.peer_id}) if contacts else []
    return protocol.encode_values(entries, nearest, compress=protocol.accepts_zlib(header))


@_counts_malformed
async def on_store(node: DHTNode, ctx: RequestContext, message: Message) -> Message:
    note_caller(node, ctx, message.header)
    entry = protocol.decode_store(message)
    try:
        if node.access is not None:
            # the signature first: a refusal is then counted against a signer that signed
            validate(entry, node._clock(), node.config.limits)
            node.access.authorize_write(entry.signer, entry.key, entry.proof)
        stored = node.storage.store(entry, node._clock())
        if stored and node.access is not None:
            node.access.stored(entry)
    except DHTError as exc:
        node.stats["stores_refused"] += 1
        node._log.debug("dht_store_refused", sender=ctx.peer_id[:12], key=entry.key[:80],
                        sub_key=entry.sub_key, reason=type(exc).__name__)
        raise
    return Message({"stored": stored})
