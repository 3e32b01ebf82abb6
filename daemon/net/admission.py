"""`HandshakeSlots`: which inbound connection gets one of a transport's handshake slots.

A connection holds a slot from its accept until its handshake ends (a link, a failure, or the
handshake timeout). At most `total` are held at once and `per_source` by one source address (the
transport says what a source is: an IPv4 address, an IPv6 /64; `None` for a source that is not
limited, the host's own loopback peers).

When every slot is held, a connection from a source that holds fewer slots than the source holding
the most takes the oldest slot of that source (the handshake is dropped and counted as evicted).
Without it, a few addresses' silent connections held every slot until their handshake timeout and
nobody else could connect; with it, an attacker has to hold more slots than any honest source
from more sources than there are slots, and keep replacing those that newcomers evict faster
than an honest handshake completes. Pure code, no I/O: the transport acts on the decisions.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class Admission(Generic[Key]):
    """What to do with a new connection: `admitted`, and the slot it takes over (`evict`: drop
    that handshake first), or why it is refused."""

    admitted: bool
    evict: Key | None = None
    refused: Literal["", "full", "per_source"] = ""


class HandshakeSlots(Generic[Key]):
    """The handshakes under way, by source, in the order they were admitted."""

    def __init__(self, total: int, per_source: int) -> None:
        if total < 1 or per_source < 1:
            raise ValueError("handshake slots: total and per_source must be at least 1")
        self.total = total
        self.per_source = per_source
        self._order = itertools.count()
        self._held: dict[Key, tuple[int, str | None]] = {}  # key -> (admission order, source)
        self._by_source: dict[str, collections.OrderedDict[Key, int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._held))

    def held_by(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def admit(self, source: str | None) -> Admission[Key]:
        """Decide on a new connection from `source` (nothing changes until `add`)."""
        mine = 0 if source is None else self.held_by(source)
        if source is not None and mine >= self.per_source:
            return Admission(False, refused="per_source")
        if len(self._held) < self.total:
            return Admission(True)
        victim = self._heaviest()
        if victim is None or self.held_by(victim) <= mine:
            return Admission(False, refused="full")
        return Admission(True, evict=next(iter(self._by_source[victim])))

    def add(self, key: Key, source: str | None) -> None:
        if key in self._held:
            raise ValueError("handshake slots: this handshake holds a slot already")
        order = next(self._order)
        self._held[key] = (order, source)
        if source is not None:
            self._by_source.setdefault(source, collections.OrderedDict())[key] = order

    def remove(self, key: Key) -> None:
        """Free the slot `key` holds (nothing if it holds none: an evicted handshake ends later)."""
        held = self._held.pop(key, None)
        if held is None or held[1] is None:
            return
        slots = self._by_source[held[1]]
        del slots[key]
        if not slots:
            del self._by_source[held[1]]

    def _heaviest(self) -> str | None:
        """The source holding the most slots; among equals the one whose oldest slot is oldest."""
        best: tuple[int, int] | None = None
        heaviest = None
        for source, slots in self._by_source.items():
            rank = (-len(slots), next(iter(slots.values())))
            if best is None or rank < best:
                best, heaviest = rank, source
        return heaviest
