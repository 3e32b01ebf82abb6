"""Reachability, AutoNAT style: a peer asks others to dial it back on its listen addresses.

The answerer dials each address on a fresh connection, runs the full handshake (so only the asking
peer itself can pass), hangs up, and says which addresses answered. It dials only addresses at
the IP the request came from (the other end of a direct link, as its socket sees it): identities
are free, so a limit per peer alone let a stranger make every daemon it reached send SYNs and
TLS hellos to any host (a third party, the answerer's own LAN); now a peer can only have itself
dialed. Addresses at another IP, or named by a host name, are left out of the answer (counted:
`addresses_skipped`); a request over a relayed or WebRTC link is refused (no IP to dial back:
`refused_indirect`). Counters reach node.info as `net.dial_back_*`.
Requests are rate-limited per peer and bounded in count.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence

import structlog

from .. import timebase
from .addresses import PeerAddress, ip_of
from .errors import TransportError
from .interface import Message, PeerTransport, RequestContext

log = structlog.get_logger(__name__)

DIAL_BACK = "net.dial_back"
MAX_ADDRESSES = 4

Prober = Callable[[PeerAddress, float], Awaitable[str]]


class DialBackRefused(TransportError):
    """The dial-back request was refused (too frequent or malformed)."""


class DialBackService:
    """Answers `net.dial_back` on a transport."""

    def __init__(self, transport: PeerTransport, probe: Prober, *, timeout: float = 5.0,
                 min_interval: float = 10.0) -> None:
        self._probe = probe
        self._timeout = timeout
        self._min_interval = min_interval
        self._last_request: dict[str, float] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        transport.add_unary_handler(DIAL_BACK, self._on_dial_back)

    async def _on_dial_back(self, ctx: RequestContext, message: Message) -> Message:
        observed = ip_of(ctx.remote_host)
        if observed is None:
            self.counters["refused_indirect"] += 1
            raise DialBackRefused("a dial-back is answered over a direct link only: it dials the "
                                  "address the request came from")
        now = timebase.monotonic()
        if now - self._last_request.get(ctx.peer_id, -self._min_interval) < self._min_interval:
            self.counters["refused_rate"] += 1
            raise DialBackRefused(f"at most one dial-back per {self._min_interval:.0f} s")
        self._last_request[ctx.peer_id] = now
        if len(self._last_request) > 10_000:  # forget the oldest; bounded memory
            for peer in sorted(self._last_request, key=self._last_request.__getitem__)[:5_000]:
                del self._last_request[peer]
        texts = message.header.get("addresses")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise DialBackRefused("'addresses' must be a list of address strings")
        addresses = []
        for text in texts[:MAX_ADDRESSES]:
            try:
                address = PeerAddress.parse(text).with_peer(ctx.peer_id)
            except ValueError as exc:
                raise DialBackRefused(str(exc)) from None
            if ip_of(address.host) != observed or address.circuit is not None:
                self.counters["addresses_skipped"] += 1  # not the requester's own IP
                continue
            addresses.append(address)
        self.counters["answered"] += 1
        results = await asyncio.gather(*(self._try(a) for a in addresses))
        return Message({"reachable": [str(a) for a, ok in zip(addresses, results, strict=True) if ok]})

    async def _try(self, address: PeerAddress) -> bool:
        try:
            await self._probe(address, self._timeout)
        except (TransportError, OSError, TimeoutError) as exc:
            log.debug("dial_back_failed", address=str(address), error=str(exc))
            return False
        return True


async def check_reachability(transport: PeerTransport, helpers: Sequence[str],
                             addresses: Sequence[PeerAddress], *, timeout: float = 10.0) -> bool | None:
    """Ask up to three connected peers to dial us back. True: some address answered; False: the
    helpers tried and none did; None: nobody could be asked."""
    if not addresses:
        return False
    header = {"addresses": [str(a.without_peer()) for a in addresses[:MAX_ADDRESSES]]}
    answered = False
    for helper in list(helpers)[:3]:
        try:
            reply = await transport.call(helper, DIAL_BACK, Message(header), timeout=timeout)
        except (TransportError, TimeoutError) as exc:
            log.debug("dial_back_request_failed", helper=helper, error=str(exc))
            continue
        answered = True
        if reply.header.get("reachable"):
            return True
    return False if answered else None
