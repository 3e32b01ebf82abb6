"""Routes: the nodes closest to a key, as a lookup found them, remembered a while. Pure: times
(the event loop's) are arguments.

A key that is stored and read again and again (a run's progress: every peer, several times an
epoch) has the same closest nodes from one minute to the next; remembering them spares an
iterative lookup per operation. A route whose node fails is forgotten (by the node's caller).
"""

from __future__ import annotations

from .lookup import LookupResult
from .protocol import Contact

ROUTE_SECONDS = 30.0  # how long the closest nodes of a key found by a lookup are used again
ROUTE_CACHE_KEYS = 256


class RouteCache:
    def __init__(self, keep: int) -> None:
        self.keep = keep  # how many of a key's closest nodes a route holds
        self._routes: dict[int, tuple[float, list[Contact]]] = {}  # key id -> (until, closest)

    def get(self, key_id: int, count: int, now: float) -> list[Contact] | None:
        """The `count` closest nodes of the key, if a live route holds that many."""
        held = self._routes.get(key_id)
        if held is None:
            return None
        until, contacts = held
        if until <= now or len(contacts) < count:
            del self._routes[key_id]
            return None
        return contacts[:count]

    def held(self, key_id: int) -> list[Contact]:
        """All the nodes the key's route holds (KeyError if none)."""
        return self._routes[key_id][1]

    def remember(self, key_id: int, result: LookupResult, count: int, now: float) -> None:
        """Remember the `keep` closest nodes `result` found, if it found `count` and was not cut short."""
        if not result.finished or len(result.closest) < count:
            return  # a cut-short lookup may have missed closer nodes: not worth keeping
        if len(self._routes) >= ROUTE_CACHE_KEYS:
            del self._routes[next(iter(self._routes))]
        self._routes[key_id] = (now + ROUTE_SECONDS, result.closest[: self.keep])

    def forget(self, key_id: int) -> None:
        self._routes.pop(key_id, None)
