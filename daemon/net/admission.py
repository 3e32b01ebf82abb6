"""`FairSlots`: who gets one of a bounded number of slots that strangers compete for.

Two users: a transport's handshake slots (a connection holds one from its accept until its
handshake ends: a link, a failure, or the handshake timeout; a source is an IPv4 address or an
IPv6 /64, `None` for a source that is not limited, the host's own loopback peers), and the
all-reduce's slots for streams that came before their round started (averaging/allreduce.py; a
source is the sender's peer id). At most `total` are held at once and `per_source` by one source.

When every slot is held, a newcomer from a source that holds fewer slots than another source
takes over that source's oldest slot, if that slot is older than `evict_after` seconds (its
holder is dropped and counted as evicted); among such sources, the one holding the most, and
among equals the one whose oldest slot is oldest. Without it, a few sources' silent holders
kept every slot until their timeout and nobody else got one (with free sources, such as peer
ids, an attacker needs more sources than there are slots, each slot refreshed faster than
`evict_after`). The age floor keeps a holder from being dropped before it could be served:
without it, handshakes from many addresses arriving faster than the slots free up (a bootstrap
node after a restart) dropped each other before they finished, and none did. Slots of an
unlimited source are never taken over. Pure code, no I/O: the caller acts on the decisions,
with its clock's time.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class Admission(Generic[Key]):
    """What to do with a newcomer: `admitted`, and the slot it takes over (`evict`: drop that
    holder first), or why it is refused."""

    admitted: bool
    evict: Key | None = None
    refused: Literal["", "full", "per_source"] = ""


class FairSlots(Generic[Key]):
    """The slots held, by source, in the order they were admitted."""

    def __init__(self, total: int, per_source: int, evict_after: float) -> None:
        if total < 1 or per_source < 1:
            raise ValueError("fair slots: total and per_source must be at least 1")
        if not evict_after >= 0:
            raise ValueError("fair slots: evict_after must be at least 0 seconds")
        self.total = total
        self.per_source = per_source
        self.evict_after = evict_after
        self._held: dict[Key, str | None] = {}  # in admission order
        self._by_source: dict[str, dict[Key, float]] = {}  # key -> admitted at, oldest first

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._held))

    def held_by(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def admit(self, source: str | None, now: float) -> Admission[Key]:
        """Decide on a newcomer from `source` at time `now` (nothing changes until `add`)."""
        mine = 0 if source is None else self.held_by(source)
        if source is not None and mine >= self.per_source:
            return Admission(False, refused="per_source")
        if len(self._held) < self.total:
            return Admission(True)
        best: tuple[int, float] | None = None
        evict = None
        for slots in self._by_source.values():
            oldest, since = next(iter(slots.items()))
            if len(slots) <= mine or now - since < self.evict_after:
                continue
            rank = (-len(slots), since)
            if best is None or rank < best:
                best, evict = rank, oldest
        return Admission(False, refused="full") if evict is None else Admission(True, evict=evict)

    def add(self, key: Key, source: str | None, now: float) -> None:
        if key in self._held:
            raise ValueError("fair slots: this key holds a slot already")
        self._held[key] = source
        if source is not None:
            self._by_source.setdefault(source, {})[key] = now

    def remove(self, key: Key) -> None:
        """Free the slot `key` holds (nothing if it holds none: an evicted holder ends later)."""
        if key not in self._held:
            return
        source = self._held.pop(key)
        if source is None:
            return
        slots = self._by_source[source]
        del slots[key]
        if not slots:
            del self._by_source[source]
