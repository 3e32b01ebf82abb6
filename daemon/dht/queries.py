"""A DHTNode's queries of other nodes: iterative lookups of nodes and values (lookup.py's
algorithm over real RPCs), reads at a key's remembered route (routes.py), and the checks on the
records that replies bring.

A reply that cannot be read is counted (`malformed_replies`) and its sender taken for failed. A
record is checked before it is used: one that expired on its way is dropped
(`expired_in_transit`); a forged one drops its sender's whole reply and bans the sender
(`forged_records`, bans.py); one under a closed run's key without its writer's membership proof
is dropped (`unproven_records`).

Functions of a `DHTNode`, bound as its methods (`DHTNode._lookup`, `_checked`, `_ask_route`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..net.errors import TransportError
from ..net.interface import Message
from . import protocol
from .errors import DHTError, InvalidRecord, MalformedMessage
from .lookup import LookupResult, Query, QueryReply, iterative_lookup
from .peers import IN_CALL
from .protocol import Contact
from .records import Entry, validate

if TYPE_CHECKING:
    from .node import DHTNode


async def lookup(node: DHTNode, target: int, deadline: float, *, key: str | None = None,
                 stop: Callable[[LookupResult], bool] | None = None,
                 count: int | None = None, min_expiration: float | None = None) -> LookupResult:
    """The nodes closest to `target` (and, given `key`, the key's entries they hold)."""
    if IN_CALL.get():  # see IN_CALL
        node.stats["nested_lookups_refused"] += 1
        return LookupResult([], {}, False, 0, 0)
    header = node._caller_header()

    async def find_node(contact: Contact) -> QueryReply:
        message = Message({**header, "target": protocol.encode_target(target)})
        reply = await node._call(contact, protocol.FIND_NODE, message, node._rpc_timeout(deadline))
        return QueryReply(protocol.decode_contacts(reply.header.get("nodes", [])))

    query = find_node if key is None else _value_query(node, key, deadline, min_expiration)
    result = await iterative_lookup(
        target, node._nearest(target), _counts_malformed(node, query),
        k=count or node.config.k, alpha=node.config.alpha, deadline=deadline,
        exclude=frozenset({node.peer_id, *node._bans}), stop=stop)
    node.routing_table.touch(target, asyncio.get_running_loop().time())
    return result


def _value_request(node: DHTNode, key: str, min_expiration: float | None) -> dict[str, Any]:
    request: dict[str, Any] = {**node._caller_header(), "key": key, "accept": protocol.ACCEPT}
    token = None if node.access is None else node.access.credential(key)
    if token is not None:
        request["token"] = token
    if min_expiration is not None:
        request["min_expiration"] = min_expiration
    return request


def _value_query(node: DHTNode, key: str, deadline: float, min_expiration: float | None) -> Query:
    request = _value_request(node, key, min_expiration)

    async def find_value(contact: Contact) -> QueryReply:
        reply = await node._call(contact, protocol.FIND_VALUE, Message(request),
                                 node._rpc_timeout(deadline))
        entries, contacts = protocol.decode_values(key, reply)
        return QueryReply(contacts, node._checked(contact.peer_id, entries))

    return find_value


def _counts_malformed(node: DHTNode, query: Query) -> Query:
    """A reply that cannot be read is counted; the lookup counts its sender as failed."""

    async def counted(contact: Contact) -> QueryReply:
        try:
            return await query(contact)
        except MalformedMessage as exc:
            node.stats["malformed_replies"] += 1
            node._log.info("dht_malformed_reply", sender=contact.peer_id[:12], error=str(exc)[:200])
            raise

    return counted


async def ask_route(node: DHTNode, route: list[Contact], key: str, deadline: float,
                    min_expiration: float | None) -> list[Entry] | None:
    """find_value at the remembered closest nodes of `key`; None if any of them failed, sent
    what does not read, or sent a forged entry (the caller then looks the key up).

    The first node is asked for the entries, the others for a summary of what they hold (a
    sub-key's digest and expiration, protocol.py), then only for the entries they hold newer
    than what came: a key that hundreds of peers write (a run's progress board) travels once
    per read, not once per node asked. Each sub-key is asked of the node that claims its newest
    entry; where that node does not deliver it (a lie, or an entry that did not pass the
    checks), of the next that claims more than what came, so that a summary that lies cannot
    hide another node's news: at most one fetch per node asked."""
    request = {**_value_request(node, key, min_expiration), "nodes": False}
    replies = await asyncio.gather(
        _ask(node, route[0], key, request, deadline),
        *(_ask(node, contact, key, {**request, "summary": True}, deadline) for contact in route[1:]))
    entries: list[Entry] = []
    summaries: list[tuple[Contact, dict[bytes, float]]] = []
    for contact, reply in zip(route, replies, strict=True):
        if reply is None:
            return None
        if isinstance(reply, dict):
            summaries.append((contact, reply))
        else:  # (a node that does not know summaries sends the entries)
            entries.extend(reply)
    newest: dict[bytes, float] = {}

    def received(found: list[Entry]) -> None:
        for entry in found:
            digest = protocol.sub_key_digest(entry.sub_key)
            newest[digest] = max(entry.expiration, newest.get(digest, entry.expiration))

    received(entries)
    claims: dict[bytes, list[tuple[float, int]]] = {}  # digest -> [(expiration, summary)]
    for index, (_, held) in enumerate(summaries):
        for digest, expiration in held.items():
            if expiration > newest.get(digest, -math.inf):
                claims.setdefault(digest, []).append((expiration, index))
    for listed in claims.values():
        listed.sort(key=lambda claim: (-claim[0], claim[1]))  # (ties: the node asked first)
    asked: set[tuple[bytes, int]] = set()
    for _ in summaries:  # (each round asks each node at most once)
        wanted: dict[int, list[bytes]] = {}
        for digest, listed in claims.items():
            have = newest.get(digest, -math.inf)
            for expiration, index in listed:
                if expiration <= have:
                    break
                if (digest, index) not in asked:
                    asked.add((digest, index))
                    wanted.setdefault(index, []).append(digest)
                    break
        if not wanted:
            break
        node.stats["summary_fetches"] += len(wanted)
        fetched = await asyncio.gather(*(
            _ask(node, summaries[index][0], key,
                 {**request, "want": protocol.encode_want(digests)}, deadline)
            for index, digests in wanted.items()))
        for reply in fetched:
            if reply is None or isinstance(reply, dict):
                return None
            entries.extend(reply)
            received(reply)
    return entries


async def _ask(node: DHTNode, contact: Contact, key: str, request: dict[str, Any],
               deadline: float) -> list[Entry] | dict[bytes, float] | None:
    """One find_value: the checked entries, or the summary; None if the node failed, sent what
    does not read or sent a forged entry (banned: none of its reply is used)."""
    try:
        reply = await node._call(contact, protocol.FIND_VALUE, Message(request),
                                 node._rpc_timeout(deadline))
        if protocol.is_summary(reply):
            return protocol.decode_summary(reply)
        entries, _ = protocol.decode_values(key, reply, contacts=False)
    except MalformedMessage as exc:
        node.stats["malformed_replies"] += 1
        node._log.info("dht_malformed_reply", sender=contact.peer_id[:12], error=str(exc)[:200])
        return None
    except (TransportError, TimeoutError):
        return None
    forged = node.stats["forged_records"]
    good = node._checked(contact.peer_id, entries)
    return None if node.stats["forged_records"] > forged else good


def checked(node: DHTNode, peer_id: str, entries: list[Entry]) -> list[Entry]:
    """The entries that pass validation; a peer that returns a forged one leaves our table,
    and none of its reply is used."""
    now, good = node._clock(), []
    for entry in entries:
        if entry.expiration <= now:
            # It expired on its way here (the sender checked it at its own "now"): an honest
            # race, not a forgery. Drop it without blaming the sender.
            node.stats["expired_in_transit"] += 1
            continue
        try:
            validate(entry, now, node.config.limits)
        except InvalidRecord as exc:
            # the rest of its reply is dropped unchecked (a reply of a thousand forged entries
            # would cost a thousand signature checks and log lines)
            node.stats["forged_records"] += 1
            node._log.warning("dht_invalid_record_received", sender=peer_id[:12], key=entry.key,
                              sub_key=entry.sub_key, reason=type(exc).__name__, error=str(exc))
            _ban(node, peer_id)
            return []
        if node.access is not None:
            try:  # a closed run's record needs its writer's membership proof, read or stored
                node.access.authorize_write(entry.signer, entry.key, entry.proof)
            except DHTError:  # (dropped, the sender not blamed: a node that knows
                node.stats["unproven_records"] += 1  # no closed runs may store anything)
                continue
        good.append(entry)
    return good


def _ban(node: DHTNode, peer_id: str) -> None:
    node.routing_table.remove(peer_id)
    node._bans.ban(peer_id, asyncio.get_running_loop().time() + node.config.ban_seconds)
