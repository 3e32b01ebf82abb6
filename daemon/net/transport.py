"""`TlsTransport`: the `PeerTransport` over direct TCP + TLS 1.3 (or plain TCP for benchmarks).

One link per peer pair. When both peers dial each other at once, both keep the link dialed by the
smaller peer id (between two links dialed by the same side: the older one); the other link says
GOAWAY, takes no new calls, finishes what runs on it and closes once both sides said GOAWAY.

Its parts:
- acceptor.py: the listen sockets, and the handshakes of inbound connections under fair slots
  (`Acceptor`);
- dialer.py: one dial per peer, direct addresses first, then circuits through relays (`Dialer`);
- address_book.py: the addresses known for each peer (`AddressBook`).
`counters()` gives the counts for metrics.

Bandwidth caps: `bandwidth` (ratelimit.py) is one pair of token buckets that every link of this
transport books its frames on (relayed links excepted: the link to the relay carries and meters
their bytes); `transport.bandwidth.set(...)` changes the caps at once.

Link events: `add_link_listener(callback)`; the callback gets a `LinkEvent` ("up" when the first
link to a peer opens, "down" when its last link closes), synchronously from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from ..identity import Identity
from .acceptor import Acceptor
from .address_book import AddressBook
from .addresses import PeerAddress
from .admission import FairSlots
from .dialer import AddressResolver, CircuitDialer, Dialer
from .errors import (
    HandshakeError,
    LimitExceeded,
    PeerIdMismatchError,
    PeerUnreachableError,
    TransportClosed,
)
from .handshake import Handshaken, client_handshake, server_handshake
from .inbound import InboundBudget
from .interface import LinkInfo, Message, StreamHandler, UnaryHandler
from .link import Dispatcher, Link, LinkLimits
from .link_stream import LinkStream
from .ratelimit import Bandwidth
from .tls import Certificate, client_context, server_context

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TransportLimits:
    """Limits and timings of a transport; `link` applies to every link."""

    handshake_timeout: float = 10.0
    dial_timeout: float = 15.0
    direct_attempt_timeout: float = 3.0  # per direct address, when a relayed path is known too
    max_handshakes: int = 64
    max_handshakes_per_source: int = 16
    # all slots held: a handshake this old may be taken over by another source's (admission.py)
    handshake_evict_after: float = 2.0
    limit_loopback: bool = False  # apply max_handshakes_per_source to loopback sources too
    max_links: int = 1024
    # Bytes of inbound messages under way (announced, not yet received) over all links together
    max_inbound_bytes: int = 1024 * 1024 * 1024
    listen_backlog: int = 128
    link: LinkLimits = field(default_factory=LinkLimits)


@dataclass(frozen=True)
class LinkEvent:
    kind: Literal["up", "down"]
    peer_id: str
    addresses: tuple[PeerAddress, ...] = ()


LinkListener = Callable[[LinkEvent], None]
#: Links by path, best first: when a peer has several, the best one stays (and the others drain).
PATH_RANK = {"tcp": 0, "holepunch": 1, "webrtc": 2, "relay": 3}


class TlsTransport:
    """Start with `await TlsTransport.start(identity, [PeerAddress...])`; close with `close()`."""

    def __init__(self, identity: Identity, *, limits: TransportLimits, tls: bool,
                 bandwidth: Bandwidth | None = None) -> None:
        self._identity = identity
        self.limits = limits
        self.tls = tls
        # the caps on all links together (ratelimit.py); set_rate on its buckets acts at once
        self.bandwidth = bandwidth if bandwidth is not None else Bandwidth()
        self._loop = asyncio.get_running_loop()
        self._certificate = Certificate.generate(identity.peer_id) if tls else None
        self._server_ctx: ssl.SSLContext | None = (
            server_context(self._certificate) if self._certificate is not None else None)
        self._client_ctx: ssl.SSLContext | None = client_context() if tls else None
        self._dispatcher = Dispatcher()
        self._bound: list[PeerAddress] = []
        self._announced: list[PeerAddress] | None = None
        self._book = AddressBook(identity.peer_id)
        self._links: dict[str, list[Link]] = {}
        self._all_links: dict[Link, None] = {}  # (in the order they came: closing is ordered)
        self._handshakes: FairSlots[asyncio.Task[None]] = FairSlots(
            self.limits.max_handshakes, self.limits.max_handshakes_per_source,
            self.limits.handshake_evict_after)
        self._inbound = InboundBudget(self.limits.max_inbound_bytes)
        self._link_listeners: list[LinkListener] = []
        self._counters: dict[str, int] = {
            "connections_accepted": 0, "connections_refused": 0, "connections_refused_per_source": 0,
            "handshakes_evicted": 0, "handshake_failures": 0,
            "protocol_violations": 0, "limits_exceeded": 0, "links_opened": 0, "links_closed": 0,
            "dial_failures": 0, "peer_id_mismatches": 0, "streams_refused": 0, "unknown_methods": 0,
        }
        self._closed = False
        self._relayed: list[PeerAddress] = []  # our circuit addresses (through relays we reserved)
        self._log = log.bind(peer_id=identity.peer_id)
        self._acceptor = Acceptor(
            self.limits, self._handshakes, handshake=self._handshake_inbound,
            adopt=lambda done, address: self._add_link(done, outbound=False, address=address),
            link_count=lambda: len(self._all_links), counters=self._counters, log=self._log)
        self._dialer = Dialer(identity.peer_id, self.limits, self._book, dial=self._dial,
                              usable=self._usable)

    # --- start / stop -------------------------------------------------------------------------
    @classmethod
    async def start(cls, identity: Identity, listen: list[PeerAddress] | None = None, *,
                    limits: TransportLimits | None = None, tls: bool = True,
                    bandwidth: Bandwidth | None = None) -> TlsTransport:
        """Bind the listen addresses (port 0: any free port) and start accepting; `bandwidth`:
        caps shared by every link (default: none)."""
        transport = cls(identity, limits=limits or TransportLimits(), tls=tls, bandwidth=bandwidth)
        try:
            for address in listen or []:
                transport._listen(address)
        except BaseException:
            await transport.close()
            raise
        return transport

    def _listen(self, address: PeerAddress) -> None:
        self._bound.extend(self._acceptor.listen(address, self._identity.peer_id))
        self._log.info("transport_listening", address=str(self._bound[-1]), tls=self.tls)

    async def close(self) -> None:
        """Close listeners and links; pending calls fail with TransportClosed."""
        if self._closed:
            return
        self._closed = True
        tasks = [*self._acceptor.tasks(), *self._dialer.tasks()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self._acceptor.close_listeners()
        closers = [link.begin_close("transport closed") for link in list(self._all_links)]
        if closers:
            await asyncio.wait(closers, timeout=10.0)

    # --- the PeerTransport port -----------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    def listen_addresses(self) -> list[PeerAddress]:
        """The announced addresses if set (`set_announced`), else the bound ones, with our id;
        then our circuit addresses through relays, if any."""
        return [*(self._announced if self._announced is not None else self._bound), *self._relayed]

    # --- other paths (relays, punched holes, WebRTC) plug in here -------------------------------
    def set_circuit_dialer(self, dialer: CircuitDialer | None) -> None:
        """Who dials circuit addresses (the relay client): `await dialer(address) -> Link`."""
        self._dialer.circuit_dialer = dialer

    def set_address_resolver(self, resolver: AddressResolver | None) -> None:
        """Who finds the addresses of a peer we know only by id (`await resolver(peer_id)`)."""
        self._dialer.resolver = resolver

    def set_relayed_addresses(self, addresses: list[PeerAddress]) -> None:
        """Our circuit addresses (told to peers in hellos and `listen_addresses`)."""
        self._relayed = list(addresses)

    @property
    def tls_contexts(self) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None, bytes | None]:
        """(server context, client context, our certificate in DER) for TLS over other pipes."""
        der = self._certificate.der if self._certificate is not None else None
        return self._server_ctx, self._client_ctx, der

    @property
    def identity(self) -> Identity:
        return self._identity

    def adopt(self, done: Handshaken, *, outbound: bool, address: str | None) -> Link:
        """Take a link made over another path (its handshake done); the best link per peer stays."""
        self._check_open()
        if len(self._all_links) >= self.limits.max_links:  # relayed links count like direct ones
            done.io.close()
            self._counters["limits_exceeded"] += 1
            raise LimitExceeded(f"already {len(self._all_links)} links (max_links)")
        link = self._add_link(done, outbound=outbound, address=address)
        return self._usable(link.peer_id) or link

    def link_kind(self, peer_id: str) -> str | None:
        link = self._usable(peer_id)
        return None if link is None else link.kind

    def bound_addresses(self) -> list[PeerAddress]:
        return list(self._bound)

    def set_announced(self, addresses: list[PeerAddress]) -> None:
        """Addresses to tell peers (in hellos and `listen_addresses`) instead of the bound ones,
        e.g. a public address behind port forwarding."""
        self._announced = [a.with_peer(self.peer_id) for a in addresses]

    async def probe(self, address: PeerAddress, timeout: float) -> str:
        """Dial `address` on a fresh connection, run the full handshake, hang up; the peer id
        that answered (for dial-back checks). Never reuses or registers a link."""
        self._check_open()
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(timeout):
                family = socket.AF_INET6 if address.host_kind in ("ip6", "dns6") else socket.AF_INET
                infos = await self._loop.getaddrinfo(address.host, address.port, family=family,
                                                     type=socket.SOCK_STREAM)
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                await self._loop.sock_connect(sock, infos[0][4][:2])
                done = await client_handshake(sock, self._identity, self._client_ctx, address.peer_id,
                                              self.listen_addresses())
        except TimeoutError:
            raise PeerUnreachableError(f"probing {address} timed out after {timeout}s") from None
        except OSError as exc:
            raise PeerUnreachableError(f"cannot connect to {address}: {exc}") from exc
        finally:
            if sock is not None:
                sock.close()
        done.io.close()
        return done.peer.peer_id

    def add_unary_handler(self, method: str, handler: UnaryHandler) -> None:
        self._dispatcher.unary[method] = handler

    def add_stream_handler(self, method: str, handler: StreamHandler) -> None:
        self._dispatcher.streams[method] = handler

    def add_link_listener(self, listener: LinkListener) -> None:
        self._link_listeners.append(listener)

    def remove_link_listener(self, listener: LinkListener) -> None:
        with contextlib.suppress(ValueError):
            self._link_listeners.remove(listener)

    def learn_addresses(self, peer_id: str, addresses: list[PeerAddress], *,
                        first_hand: bool = True) -> None:
        self._book.learn(peer_id, addresses, first_hand=first_hand)

    def _forget_address(self, address: PeerAddress) -> None:
        """A direct address whose host refused the connection (see `AddressBook.forget`)."""
        if self._book.forget(address):
            self._counters["addresses_forgotten"] = self._counters.get("addresses_forgotten", 0) + 1

    def known_addresses(self, peer_id: str) -> list[PeerAddress]:
        return self._book.known(peer_id)

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def links(self) -> list[LinkInfo]:
        return [link.info() for link in self._all_links if not link.closed]

    async def connect(self, address: PeerAddress, *, timeout: float) -> str:
        self._check_open()
        if address.target is not None and self._usable(address.target) is not None:
            return address.target
        try:
            async with asyncio.timeout(timeout):
                if address.circuit is not None:
                    if self._dialer.circuit_dialer is None:
                        raise PeerUnreachableError(f"{address} is a circuit address and relays "
                                                   "are off")
                    link = await self._dialer.circuit_dialer(address)
                else:
                    link = await self._dial(address)
        except TimeoutError:
            self._counters["dial_failures"] += 1
            raise PeerUnreachableError(f"dialing {address} timed out after {timeout}s") from None
        return link.peer_id

    async def connect_peer(self, peer_id: str, *, timeout: float) -> None:
        """Make sure there is a link to a known peer (any path from its known addresses)."""
        self._check_open()
        await self._dialer.link_for(peer_id, self._loop.time() + timeout)

    async def call(self, peer_id: str, method: str, message: Message, *, timeout: float) -> Message:
        self._check_open()
        deadline = self._loop.time() + timeout
        link = await self._dialer.link_for(peer_id, deadline)
        if not link.usable:  # it began to drain while we waited for the dial
            link = await self._dialer.link_for(peer_id, deadline)
        return await link.call(method, message, deadline)

    async def open_stream(self, peer_id: str, method: str, header: dict[str, Any], *,
                          timeout: float) -> LinkStream:
        self._check_open()
        deadline = self._loop.time() + timeout
        link = await self._dialer.link_for(peer_id, deadline)
        if not link.usable:
            link = await self._dialer.link_for(peer_id, deadline)
        return await link.open_stream(method, header, deadline)

    # --- links ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("the transport is closed")

    def _usable(self, peer_id: str) -> Link | None:
        for link in self._links.get(peer_id, ()):
            if link.usable:
                return link
        return None

    async def _dial(self, address: PeerAddress) -> Link:
        """Connect and handshake (the caller bounds it); returns the link now in use for the peer."""
        family = socket.AF_INET6 if address.host_kind in ("ip6", "dns6") else socket.AF_INET
        host = address.host
        if address.host_kind.startswith("dns"):
            try:
                infos = await self._loop.getaddrinfo(host, address.port, family=family,
                                                     type=socket.SOCK_STREAM)
            except OSError as exc:
                self._counters["dial_failures"] += 1
                raise PeerUnreachableError(f"cannot resolve {address}: {exc}") from exc
            host = str(infos[0][4][0])
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self._loop.sock_connect(sock, (host, address.port))
            done = await client_handshake(sock, self._identity, self._client_ctx, address.peer_id,
                                          self.listen_addresses())
        except PeerIdMismatchError:
            sock.close()
            self._counters["peer_id_mismatches"] += 1
            raise
        except HandshakeError:
            sock.close()
            self._counters["handshake_failures"] += 1
            raise
        except OSError as exc:
            sock.close()
            self._counters["dial_failures"] += 1
            if isinstance(exc, ConnectionRefusedError):
                self._forget_address(address)
            raise PeerUnreachableError(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        if self._closed:
            done.io.close()
            raise TransportClosed("the transport closed while dialing")
        link = self._add_link(done, outbound=True, address=str(address))
        return self._usable(link.peer_id) or link

    async def _handshake_inbound(self, sock: socket.socket) -> Handshaken:
        """The server side of an accepted connection's handshake (the acceptor bounds it)."""
        der = self._certificate.der if self._certificate is not None else None
        return await server_handshake(sock, self._identity, self._server_ctx, der,
                                      self.listen_addresses())

    def _add_link(self, done: Handshaken, *, outbound: bool, address: str | None) -> Link:
        peer_id = done.peer.peer_id
        if peer_id == self.peer_id:
            done.io.close()
            raise HandshakeError("connected to ourselves")
        self.learn_addresses(peer_id, list(done.peer.addresses))
        link = Link(done.io, peer_id=peer_id, peer_addresses=done.peer.addresses, outbound=outbound,
                    address=address, limits=self.limits.link, dispatcher=self._dispatcher,
                    on_closed=self._on_link_closed, counters=self._counters,
                    local_peer_id=self.peer_id,
                    # a relayed link's bytes are metered on the link to the relay that carries them
                    bandwidth=None if done.io.kind == "relay" else self.bandwidth,
                    budget=self._inbound)
        existing = self._links.setdefault(peer_id, [])
        first = not any(not other.closed for other in existing)
        existing.append(link)
        self._all_links[link] = None
        self._counters["links_opened"] += 1
        link.start()
        self._dedupe(peer_id)
        self._log.debug("link_up", remote=peer_id, outbound=outbound, address=address)
        if first:
            self._emit(LinkEvent("up", peer_id, done.peer.addresses))
        return link

    def _dedupe(self, peer_id: str) -> None:
        """Keep one link: the one dialed by the smaller peer id (then the oldest); drain others."""
        live = [link for link in self._links.get(peer_id, []) if not link.closed and not link.draining]
        if len(live) < 2:
            return

        def rank(link: Link) -> tuple[int, int, float]:
            dialer = self.peer_id if link.outbound else peer_id
            return (PATH_RANK.get(link.kind, len(PATH_RANK)),
                    0 if dialer == min(self.peer_id, peer_id) else 1, link.opened_at)

        keep = min(live, key=rank)
        for link in live:
            if link is not keep:
                link.start_drain()

    def _on_link_closed(self, link: Link) -> None:
        self._counters["links_closed"] += 1
        self._all_links.pop(link, None)
        links = self._links.get(link.peer_id, [])
        if link in links:
            links.remove(link)
        if not links:
            self._links.pop(link.peer_id, None)
            self._emit(LinkEvent("down", link.peer_id))

    def _emit(self, event: LinkEvent) -> None:
        for listener in list(self._link_listeners):
            try:
                listener(event)
            except Exception as exc:  # a listener's bug must not break the transport
                self._log.warning("link_listener_failed", error=repr(exc))
