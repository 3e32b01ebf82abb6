"""Banned peers: those that returned a forged record, ignored until their ban ends. Pure: times
(the event loop's) are arguments. Bounded: at most MAX_BANS are kept, the ban that ends first
forgotten to make room.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_BANS = 4096


class Bans:
    def __init__(self) -> None:
        self._until: dict[str, float] = {}  # peer id -> when the ban ends

    def __iter__(self) -> Iterator[str]:
        """The peers banned, ended bans not yet noticed included."""
        return iter(self._until)

    def __len__(self) -> int:
        return len(self._until)

    def ban(self, peer_id: str, until: float) -> None:
        if len(self._until) >= MAX_BANS:  # bounded: forget the ban that ends first
            del self._until[min(self._until, key=self._until.__getitem__)]
        self._until[peer_id] = until

    def banned(self, peer_id: str, now: float) -> bool:
        until = self._until.get(peer_id)
        if until is None:
            return False
        if until > now:
            return True
        del self._until[peer_id]
        return False
