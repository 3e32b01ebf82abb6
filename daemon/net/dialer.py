"""`Dialer`: how a transport gets a link to a peer it has none to, from the peer's known addresses.

One dial per peer at a time, shared by every call that needs it and owned by the transport (a
call that gives up at its deadline leaves it to the others). A peer with no known address is
looked up with the address resolver first (e.g. a DHT record of its circuits). Direct addresses
are tried first, then circuits through relays (the circuit dialer: the relay client); with a
relay to fall back on, a direct address that does not answer within `direct_attempt_timeout` is
given up, and the whole dial is bounded by `dial_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .address_book import AddressBook
from .addresses import PeerAddress
from .errors import CallTimeout, HandshakeError, PeerUnreachableError, TransportError
from .link import Link

if TYPE_CHECKING:
    from .transport import TransportLimits

CircuitDialer = Callable[[PeerAddress], Awaitable[Link]]
AddressResolver = Callable[[str], Awaitable[list[PeerAddress]]]


class Dialer:
    """Links to peers by id for `own_peer_id`: `usable(peer_id)` if there is one, else dialed
    with `dial(address)` (a direct address; it returns the link now in use for the peer)."""

    def __init__(self, own_peer_id: str, limits: TransportLimits, book: AddressBook, *,
                 dial: Callable[[PeerAddress], Awaitable[Link]],
                 usable: Callable[[str], Link | None]) -> None:
        self._own_peer_id = own_peer_id
        self.limits = limits
        self._book = book
        self._dial = dial
        self._usable = usable
        self._loop = asyncio.get_running_loop()
        self._dialing: dict[str, asyncio.Task[Link]] = {}
        self.circuit_dialer: CircuitDialer | None = None
        self.resolver: AddressResolver | None = None

    def tasks(self) -> list[asyncio.Task[Link]]:
        """The dials under way."""
        return list(self._dialing.values())

    async def link_for(self, peer_id: str, deadline: float) -> Link:
        link = self._usable(peer_id)
        if link is not None:
            return link
        if peer_id == self._own_peer_id:
            raise TransportError("a transport cannot call itself")
        task = self._dialing.get(peer_id)
        if task is None:
            addresses = self._book.known(peer_id)
            if not addresses and self.resolver is not None:  # e.g. a DHT record of its circuits
                with contextlib.suppress(TransportError, TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        self._book.learn(peer_id, await self.resolver(peer_id))
                addresses = self._book.known(peer_id)
            if not addresses:
                raise PeerUnreachableError(f"no link to {peer_id} and no known address for it")
            # one dial per peer, shared by every call that needs it, owned by the transport
            task = self._loop.create_task(self._dial_any(peer_id, addresses), name="dial")
            self._dialing[peer_id] = task
            task.add_done_callback(lambda done: self._dial_done(peer_id, done))
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(task)
        except TimeoutError:
            raise CallTimeout(f"dialing {peer_id} did not finish before the call's deadline") from None

    def _dial_done(self, peer_id: str, task: asyncio.Task[Link]) -> None:
        if self._dialing.get(peer_id) is task:
            del self._dialing[peer_id]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have given up

    async def _dial_any(self, peer_id: str, addresses: list[PeerAddress]) -> Link:
        """Direct addresses first, then circuits through relays (best path first; a better one
        found later replaces the link, see the transport's `_dedupe`)."""
        errors: list[str] = []
        direct = [a for a in addresses if a.circuit is None]
        circuits = [a for a in addresses if a.circuit is not None and self.circuit_dialer is not None]
        # With a relay to fall back on, a direct address that does not answer soon is given up
        # (behind a NAT a SYN is dropped silently: waiting the whole dial timeout helps nobody).
        each = self.limits.direct_attempt_timeout if circuits else self.limits.dial_timeout
        try:
            async with asyncio.timeout(self.limits.dial_timeout):
                for address in direct:
                    try:
                        async with asyncio.timeout(each):
                            return await self._dial(address)
                    except (PeerUnreachableError, HandshakeError) as exc:
                        errors.append(str(exc))
                    except TimeoutError:
                        errors.append(f"{address}: no answer within {each}s")
                for address in circuits:
                    assert self.circuit_dialer is not None
                    try:
                        return await self.circuit_dialer(address)
                    except (PeerUnreachableError, HandshakeError) as exc:
                        errors.append(str(exc))
        except TimeoutError:
            errors.append(f"timed out after {self.limits.dial_timeout}s")
        raise PeerUnreachableError(f"no address of {peer_id} answered: {'; '.join(errors)}")
