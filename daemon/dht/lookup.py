"""Parallel iterative lookup (Kademlia's node lookup), apart from the network.

`iterative_lookup` asks up to `alpha` peers at a time for nodes closer to `target` (and, through
the query function, for values), always querying the nearest not-yet-asked of the `k` closest
known nodes, until the `k` closest have all answered or failed, `stop` says enough, or the
deadline passes. It always returns what it has by the deadline; it never raises for a peer's
failure (the query function reports those).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .ids import node_id_of
from .protocol import Contact
from .records import Entry


@dataclass
class QueryReply:
    contacts: list[Contact]
    entries: list[Entry] = field(default_factory=list)


@dataclass
class LookupResult:
    closest: list[Contact]  # nodes that answered, nearest first, at most k
    entries: dict[str, list[Entry]]  # peer id -> the valid entries it returned
    finished: bool  # False when the deadline (or `stop`) cut the lookup short
    queried: int
    failed: int


Query = Callable[[Contact], Awaitable[QueryReply]]


async def iterative_lookup(target: int, initial: list[Contact], query: Query, *, k: int, alpha: int,
                           deadline: float, exclude: frozenset[str] = frozenset(),
                           stop: Callable[[LookupResult], bool] | None = None) -> LookupResult:
    """Find the k nodes closest to `target`. `deadline` is in `loop.time()` units.

    As in the Kademlia paper, once an answer brings no node closer than the closest known, the
    lookup stops holding back to `alpha` and asks all of the k closest not yet asked at once."""
    distances: dict[str, int] = {}
    contacts: dict[str, Contact] = {}
    answered: set[str] = set()
    failed: set[str] = set()
    asked: set[str] = set()
    in_flight: dict[asyncio.Task[QueryReply], str] = {}
    result = LookupResult([], {}, False, 0, 0)

    def learn(contact: Contact) -> None:
        if contact.peer_id in contacts or contact.peer_id in exclude:
            return
        try:
            distances[contact.peer_id] = node_id_of(contact.peer_id) ^ target
        except ValueError:
            return  # not a peer id: ignore the bogus entry
        contacts[contact.peer_id] = contact

    def best() -> list[str]:
        alive = (p for p in contacts if p not in failed)
        return sorted(alive, key=distances.__getitem__)[:k]

    for contact in initial:
        learn(contact)
    limit = alpha
    try:
        async with asyncio.timeout_at(deadline):
            while True:
                nearest = best()
                for peer_id in nearest:
                    if len(in_flight) >= limit:
                        break
                    if peer_id not in asked:
                        asked.add(peer_id)
                        task = asyncio.create_task(query(contacts[peer_id]))
                        in_flight[task] = peer_id
                if not in_flight:
                    result.finished = True
                    break
                closest_before = min((distances[p] for p in contacts if p not in failed), default=None)
                done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                # (in the order they were asked, not the set's: the same in every simulated run)
                for task in [t for t in in_flight if t in done]:
                    peer_id = in_flight.pop(task)
                    if task.exception() is not None:
                        failed.add(peer_id)
                        continue
                    reply = task.result()
                    answered.add(peer_id)
                    if reply.entries:
                        result.entries[peer_id] = reply.entries
                    for contact in reply.contacts:
                        learn(contact)
                closest_after = min((distances[p] for p in contacts if p not in failed), default=None)
                if closest_before is not None and closest_after == closest_before:
                    limit = k
                if stop is not None:
                    result.closest = [contacts[p] for p in best() if p in answered]
                    if stop(result):
                        break
    except TimeoutError:
        pass
    finally:
        if in_flight:
            for task in in_flight:
                task.cancel()
            await asyncio.wait(in_flight)
            for task in in_flight:
                if not task.cancelled():
                    task.exception()  # retrieved: a failure after the deadline does not matter
    result.closest = [contacts[p] for p in sorted(answered, key=distances.__getitem__)[:k]]
    result.queried = len(answered) + len(failed)
    result.failed = len(failed)
    return result
