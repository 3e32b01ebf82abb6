"""`AddressBook`: the addresses a transport knows for each peer, the ones to dial first first.

A peer's addresses come from its hello (first hand: they go to the front, newest first), or from
others (hearsay, e.g. a DHT record: appended, so that a restarted peer's old port never jumps the
queue), at most `MAX_ADDRESSES` per peer. Only tcp addresses are kept (direct or circuits through
a relay; a circuit through the peer itself, or through us, leads nowhere). A direct address whose
host refused a connection is forgotten.
"""

from __future__ import annotations

from .addresses import PeerAddress

MAX_ADDRESSES = 16  # per peer


class AddressBook:
    """The known addresses of each peer but `own_peer_id` (ours are never booked)."""

    def __init__(self, own_peer_id: str) -> None:
        self._own_peer_id = own_peer_id
        self._book: dict[str, list[PeerAddress]] = {}

    def learn(self, peer_id: str, addresses: list[PeerAddress], *, first_hand: bool = True) -> None:
        if peer_id == self._own_peer_id:
            return
        book = self._book.setdefault(peer_id, [])
        for address in addresses:
            if address.target not in (None, peer_id) or address.transport != "tcp":
                continue
            if address.circuit is not None and address.peer_id in (peer_id, self._own_peer_id):
                continue  # a circuit through the peer itself, or through us, leads nowhere
            if address.target != peer_id:  # (an address naming no peer yet)
                address = address.with_peer(peer_id)
            if not first_hand:  # hearsay (a restarted peer's old port, say) never jumps the queue
                if address not in book:
                    book.append(address)
                continue
            if address in book:
                book.remove(address)
            book.insert(0, address)  # newest first
        del book[MAX_ADDRESSES:]

    def forget(self, address: PeerAddress) -> bool:
        """A direct address whose host refused the connection: nobody listens there any more
        (a restarted peer took a new port); dialing it again would only fail again. True if it
        was booked."""
        if address.target is None or address.circuit is not None:
            return False
        book = self._book.get(address.target, [])
        if address in book:
            book.remove(address)
            return True
        return False

    def known(self, peer_id: str) -> list[PeerAddress]:
        return list(self._book.get(peer_id, []))
