"""Lost contacts: peers evicted from the routing table for failing, kept to be tried again now and
then. Pure: times (the event loop's) are arguments; peers.py pings the contacts `due` returns.

A network cut makes each side evict the other from its routing tables; lookups then only ever
meet their own side, and the swarm would stay split in two after the cut heals. So evicted
contacts are kept a while and pinged again, a few at a time: one that answers is back in the
table, and lookups reach across again.
"""

from __future__ import annotations

import collections
from collections.abc import Container

from .protocol import Contact

LOST_CONTACTS = 256  # evicted contacts kept to be tried again
LOST_PROBES = 3  # per maintenance round
LOST_RETRY_SECONDS = 30.0
LOST_FORGET_SECONDS = 3600.0


class LostContacts:
    def __init__(self) -> None:
        # peer id -> (contact, lost at, last tried), the least recently tried first
        self._lost: collections.OrderedDict[str, tuple[Contact, float, float]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._lost)

    def lose(self, contact: Contact, now: float) -> None:
        """`contact` was evicted: keep it (the oldest beyond LOST_CONTACTS are forgotten)."""
        lost = self._lost
        lost.pop(contact.peer_id, None)
        lost[contact.peer_id] = (contact, now, now)
        while len(lost) > LOST_CONTACTS:
            lost.popitem(last=False)

    def due(self, now: float, known: Container[str]) -> list[Contact]:
        """The (up to LOST_PROBES) contacts to try again now, those not `known` (in the routing
        table) and not tried for LOST_RETRY_SECONDS; they count as tried now and go to the end.
        Contacts lost more than LOST_FORGET_SECONDS ago are forgotten."""
        for peer_id in [p for p, (_, lost_at, _) in self._lost.items()
                        if now - lost_at > LOST_FORGET_SECONDS]:
            del self._lost[peer_id]
        due = [(peer_id, contact, lost_at) for peer_id, (contact, lost_at, tried) in self._lost.items()
               if now - tried >= LOST_RETRY_SECONDS and peer_id not in known]
        for peer_id, contact, lost_at in due[:LOST_PROBES]:
            del self._lost[peer_id]
            self._lost[peer_id] = (contact, lost_at, now)  # to the end: the others go first
        return [contact for _, contact, _ in due[:LOST_PROBES]]

    def found(self, peer_id: str) -> None:
        """`peer_id` answered again: no longer lost."""
        self._lost.pop(peer_id, None)
