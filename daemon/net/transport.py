"""`TlsTransport`: the `PeerTransport` over direct TCP + TLS 1.3 (or plain TCP for benchmarks).

One link per peer pair. When both peers dial each other at once, both keep the link dialed by the
smaller peer id (between two links dialed by the same side: the older one); the other link says
GOAWAY, takes no new calls, finishes what runs on it and closes once both sides said GOAWAY.

Inbound connections each get one handshake task under `handshake_timeout` (TLS + hellos), at most
`max_handshakes` at once and `max_handshakes_per_source` from one source address (an IPv6 /64
counts as one; loopback is exempt unless `limit_loopback`: a host's own peers, the tests' and
benchmarks' many, all come from 127.0.0.1); when every slot is held, a source holding fewer
than another takes over that source's oldest slot once it is `handshake_evict_after` seconds
old (admission.py), so that silent connections from a few hosts cannot keep everyone else out
and no handshake is dropped before it could complete; garbage, silence, half-done
handshakes and slowloris clients are dropped and counted without disturbing established links.
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
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from ..identity import Identity
from .addresses import PeerAddress, ip_of
from .admission import FairSlots
from .errors import (
    CallTimeout,
    HandshakeError,
    LimitExceeded,
    PeerIdMismatchError,
    PeerUnreachableError,
    TransportClosed,
    TransportError,
)
from .handshake import Handshaken, client_handshake, server_handshake
from .inbound import InboundBudget
from .interface import LinkInfo, Message, StreamHandler, UnaryHandler
from .link import Dispatcher, Link, LinkLimits
from .link_stream import LinkStream
from .ratelimit import Bandwidth
from .tls import Certificate, client_context, server_context

log = structlog.get_logger(__name__)

_MAX_BOOK_ADDRESSES = 16


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
CircuitDialer = Callable[[PeerAddress], Awaitable["Link"]]
AddressResolver = Callable[[str], Awaitable[list[PeerAddress]]]
#: Links by path, best first: when a peer has several, the best one stays (and the others drain).
PATH_RANK = {"tcp": 0, "holepunch": 1, "webrtc": 2, "relay": 3}


def _local_ipv4_addresses() -> list[str]:
    """Concrete addresses for a wildcard bind: the host name's IPv4 addresses, loopback last."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM):
            host = str(info[4][0])
            if host not in found and not host.startswith("127."):
                found.append(host)
    found.append("127.0.0.1")
    return found


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
        self._listeners: list[socket.socket] = []
        self._bound: list[PeerAddress] = []
        self._announced: list[PeerAddress] | None = None
        self._book: dict[str, list[PeerAddress]] = {}
        self._links: dict[str, list[Link]] = {}
        self._all_links: dict[Link, None] = {}  # (in the order they came: closing is ordered)
        self._accept_tasks: set[asyncio.Task[None]] = set()
        self._handshakes: FairSlots[asyncio.Task[None]] = FairSlots(
            self.limits.max_handshakes, self.limits.max_handshakes_per_source,
            self.limits.handshake_evict_after)
        self._evicted: set[asyncio.Task[None]] = set()  # until they end (close waits for them)
        self._inbound = InboundBudget(self.limits.max_inbound_bytes)
        self._dialing: dict[str, asyncio.Task[Link]] = {}
        self._link_listeners: list[LinkListener] = []
        self._counters: dict[str, int] = {
            "connections_accepted": 0, "connections_refused": 0, "connections_refused_per_source": 0,
            "handshakes_evicted": 0, "handshake_failures": 0,
            "protocol_violations": 0, "limits_exceeded": 0, "links_opened": 0, "links_closed": 0,
            "dial_failures": 0, "peer_id_mismatches": 0, "streams_refused": 0, "unknown_methods": 0,
        }
        self._closed = False
        self._circuit_dialer: CircuitDialer | None = None
        self._resolver: AddressResolver | None = None
        self._relayed: list[PeerAddress] = []  # our circuit addresses (through relays we reserved)
        self._log = log.bind(peer_id=identity.peer_id)

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
        if address.transport != "tcp" or address.host_kind not in ("ip4", "ip6"):
            raise ValueError(f"can only listen on /ip4 or /ip6 tcp addresses, not {address}")
        family = socket.AF_INET6 if address.host_kind == "ip6" else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address.host, address.port))
            # SO_REUSEPORT, set after the bind: a port another listener holds stays an error, yet a
            # hole-punching socket (holepunch.py, same user) may bind this port too, so that its
            # SYNs leave through the NAT mapping of the port we announce.
            if hasattr(socket, "SO_REUSEPORT"):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.listen(self.limits.listen_backlog)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        self._listeners.append(sock)
        port = sock.getsockname()[1]
        if address.host in ("0.0.0.0", "::"):
            hosts = _local_ipv4_addresses() if family == socket.AF_INET else ["::1"]
        else:
            hosts = [address.host]
        for host in hosts:
            self._bound.append(PeerAddress.from_socket(host, port, self._identity.peer_id))
        task = self._loop.create_task(self._accept_loop(sock), name=f"accept-{port}")
        self._accept_tasks.add(task)
        self._log.info("transport_listening", address=str(self._bound[-1]), tls=self.tls)

    async def close(self) -> None:
        """Close listeners and links; pending calls fail with TransportClosed."""
        if self._closed:
            return
        self._closed = True
        tasks = [*self._accept_tasks, *self._handshakes, *self._evicted, *self._dialing.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for sock in self._listeners:
            sock.close()
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
        self._circuit_dialer = dialer

    def set_address_resolver(self, resolver: AddressResolver | None) -> None:
        """Who finds the addresses of a peer we know only by id (`await resolver(peer_id)`)."""
        self._resolver = resolver

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
        if peer_id == self.peer_id:
            return
        book = self._book.setdefault(peer_id, [])
        for address in addresses:
            if address.target not in (None, peer_id) or address.transport != "tcp":
                continue
            if address.circuit is not None and address.peer_id in (peer_id, self.peer_id):
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
        del book[_MAX_BOOK_ADDRESSES:]

    def _forget_address(self, address: PeerAddress) -> None:
        """A direct address whose host refused the connection: nobody listens there any more
        (a restarted peer took a new port); dialing it again would only fail again."""
        if address.target is None or address.circuit is not None:
            return
        book = self._book.get(address.target, [])
        if address in book:
            book.remove(address)
            self._counters["addresses_forgotten"] = self._counters.get("addresses_forgotten", 0) + 1

    def known_addresses(self, peer_id: str) -> list[PeerAddress]:
        return list(self._book.get(peer_id, []))

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
                    if self._circuit_dialer is None:
                        raise PeerUnreachableError(f"{address} is a circuit address and relays "
                                                   "are off")
                    link = await self._circuit_dialer(address)
                else:
                    link = await self._dial(address)
        except TimeoutError:
            self._counters["dial_failures"] += 1
            raise PeerUnreachableError(f"dialing {address} timed out after {timeout}s") from None
        return link.peer_id

    async def connect_peer(self, peer_id: str, *, timeout: float) -> None:
        """Make sure there is a link to a known peer (any path from its known addresses)."""
        self._check_open()
        await self._link_for(peer_id, self._loop.time() + timeout)

    async def call(self, peer_id: str, method: str, message: Message, *, timeout: float) -> Message:
        self._check_open()
        deadline = self._loop.time() + timeout
        link = await self._link_for(peer_id, deadline)
        if not link.usable:  # it began to drain while we waited for the dial
            link = await self._link_for(peer_id, deadline)
        return await link.call(method, message, deadline)

    async def open_stream(self, peer_id: str, method: str, header: dict[str, Any], *,
                          timeout: float) -> LinkStream:
        self._check_open()
        deadline = self._loop.time() + timeout
        link = await self._link_for(peer_id, deadline)
        if not link.usable:
            link = await self._link_for(peer_id, deadline)
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

    async def _link_for(self, peer_id: str, deadline: float) -> Link:
        link = self._usable(peer_id)
        if link is not None:
            return link
        if peer_id == self.peer_id:
            raise TransportError("a transport cannot call itself")
        task = self._dialing.get(peer_id)
        if task is None:
            addresses = self.known_addresses(peer_id)
            if not addresses and self._resolver is not None:  # e.g. a DHT record of its circuits
                with contextlib.suppress(TransportError, TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        self.learn_addresses(peer_id, await self._resolver(peer_id))
                addresses = self.known_addresses(peer_id)
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
        found later replaces the link, see `_dedupe`)."""
        errors: list[str] = []
        direct = [a for a in addresses if a.circuit is None]
        circuits = [a for a in addresses if a.circuit is not None and self._circuit_dialer is not None]
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
                    assert self._circuit_dialer is not None
                    try:
                        return await self._circuit_dialer(address)
                    except (PeerUnreachableError, HandshakeError) as exc:
                        errors.append(str(exc))
        except TimeoutError:
            errors.append(f"timed out after {self.limits.dial_timeout}s")
        raise PeerUnreachableError(f"no address of {peer_id} answered: {'; '.join(errors)}")

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

    async def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = await self._loop.sock_accept(listener)
            except OSError as exc:
                self._log.warning("accept_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            self._counters["connections_accepted"] += 1
            source, now = self._source_of(sock), self._loop.time()
            admission = self._handshakes.admit(source, now)
            if not admission.admitted or len(self._all_links) >= self.limits.max_links:
                self._counters["connections_refused"] += 1
                if admission.refused == "per_source":
                    self._counters["connections_refused_per_source"] += 1
                sock.close()
                continue
            if admission.evict is not None:  # its slot is this connection's now
                self._handshakes.remove(admission.evict)
                admission.evict.cancel()
                self._evicted.add(admission.evict)
                admission.evict.add_done_callback(self._evicted.discard)
                self._counters["handshakes_evicted"] += 1
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._serve_handshake(sock), name="handshake")
            self._handshakes.add(task, source, now)
            task.add_done_callback(self._handshakes.remove)
            # evicted or the transport closing, before or during the handshake: the socket too
            task.add_done_callback(lambda done, s=sock: s.close() if done.cancelled() else None)

    def _source_of(self, sock: socket.socket) -> str | None:
        """The source a connection's handshake counts against (None: not limited)."""
        try:
            address = ip_of(str(sock.getpeername()[0]))
        except (OSError, IndexError):
            return None
        if address is None:
            return None
        if address.is_loopback and not self.limits.limit_loopback:
            return None
        if isinstance(address, ipaddress.IPv6Address):  # one host holds a whole /64
            return str(ipaddress.IPv6Network((address, 64), strict=False))
        return str(address)

    async def _serve_handshake(self, sock: socket.socket) -> None:
        peer = None
        with contextlib.suppress(OSError):
            peer = sock.getpeername()
        try:
            async with asyncio.timeout(self.limits.handshake_timeout):
                der = self._certificate.der if self._certificate is not None else None
                done = await server_handshake(sock, self._identity, self._server_ctx, der,
                                              self.listen_addresses())
        except TimeoutError:
            sock.close()
            self._counters["handshake_failures"] += 1
            self._log.info("handshake_timed_out", remote=str(peer))
            return
        except (HandshakeError, TransportError, OSError) as exc:
            sock.close()
            self._counters["handshake_failures"] += 1
            self._log.info("handshake_failed", remote=str(peer), error=str(exc))
            return
        address = str(PeerAddress.from_socket(str(peer[0]), int(peer[1]))) if peer else None
        try:
            self._add_link(done, outbound=False, address=address)
        except HandshakeError as exc:
            self._counters["handshake_failures"] += 1
            self._log.info("handshake_failed", remote=str(peer), error=str(exc))

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
