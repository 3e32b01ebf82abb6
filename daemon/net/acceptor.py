"""`Acceptor`: a transport's listen sockets, and the handshakes of the connections they accept.

A wildcard listen address (0.0.0.0, ::) is told to peers as the host's concrete addresses. The
listen sockets set SO_REUSEPORT after their bind, so that a hole-punching socket (holepunch.py)
may bind the port we announce.

Inbound connections each get one handshake task under `handshake_timeout` (TLS + hellos), at most
`max_handshakes` at once and `max_handshakes_per_source` from one source address (an IPv6 /64
counts as one; loopback is exempt unless `limit_loopback`: a host's own peers, the tests' and
benchmarks' many, all come from 127.0.0.1); when every slot is held, a source holding fewer
than another takes over that source's oldest slot once it is `handshake_evict_after` seconds
old (admission.py), so that silent connections from a few hosts cannot keep everyone else out
and no handshake is dropped before it could complete; garbage, silence, half-done
handshakes and slowloris clients are dropped and counted without disturbing established links.
The transport's `counters()` gives the counts for metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .addresses import PeerAddress, ip_of
from .admission import FairSlots
from .errors import HandshakeError, TransportError
from .handshake import Handshaken

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from .transport import TransportLimits


def local_ipv4_addresses() -> list[str]:
    """Concrete addresses for a wildcard bind: the host name's IPv4 addresses, loopback last."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM):
            host = str(info[4][0])
            if host not in found and not host.startswith("127."):
                found.append(host)
    found.append("127.0.0.1")
    return found


def bind_listener(address: PeerAddress, backlog: int) -> socket.socket:
    """A listening, non-blocking socket on an /ip4 or /ip6 tcp address (port 0: any free port)."""
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
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen on {address}: {exc}") from exc
    return sock


def source_of(sock: socket.socket, limit_loopback: bool) -> str | None:
    """The source a connection's handshake counts against (None: not limited)."""
    try:
        address = ip_of(str(sock.getpeername()[0]))
    except (OSError, IndexError):
        return None
    if address is None:
        return None
    if address.is_loopback and not limit_loopback:
        return None
    if isinstance(address, ipaddress.IPv6Address):  # one host holds a whole /64
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Acceptor:
    """Accepts on the listen sockets and runs each connection's server handshake (`handshake`)
    in one of the `handshakes` slots; a completed one is handed to `adopt` with the remote
    address. Refused while `link_count()` is at `max_links`."""

    def __init__(self, limits: TransportLimits, handshakes: FairSlots[asyncio.Task[None]], *,
                 handshake: Callable[[socket.socket], Awaitable[Handshaken]],
                 adopt: Callable[[Handshaken, str | None], object], link_count: Callable[[], int],
                 counters: dict[str, int], log: FilteringBoundLogger) -> None:
        self.limits = limits
        self.handshakes = handshakes
        self._handshake = handshake
        self._adopt = adopt
        self._link_count = link_count
        self._counters = counters
        self._log = log
        self._loop = asyncio.get_running_loop()
        self._listeners: list[socket.socket] = []
        self._accept_tasks: set[asyncio.Task[None]] = set()
        self._evicted: set[asyncio.Task[None]] = set()  # until they end (close waits for them)

    def listen(self, address: PeerAddress, peer_id: str) -> list[PeerAddress]:
        """Bind `address` and accept on it; the addresses it is reached at (with `peer_id`)."""
        sock = bind_listener(address, self.limits.listen_backlog)
        self._listeners.append(sock)
        port = sock.getsockname()[1]
        if address.host in ("0.0.0.0", "::"):
            hosts = local_ipv4_addresses() if sock.family == socket.AF_INET else ["::1"]
        else:
            hosts = [address.host]
        bound = [PeerAddress.from_socket(host, port, peer_id) for host in hosts]
        task = self._loop.create_task(self._accept_loop(sock), name=f"accept-{port}")
        self._accept_tasks.add(task)
        return bound

    def tasks(self) -> list[asyncio.Task[None]]:
        """What runs: the accept loops, the handshakes, and the evicted ones not ended yet."""
        return [*self._accept_tasks, *self.handshakes, *self._evicted]

    def close_listeners(self) -> None:
        for sock in self._listeners:
            sock.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = await self._loop.sock_accept(listener)
            except OSError as exc:
                self._log.warning("accept_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            self._counters["connections_accepted"] += 1
            source, now = source_of(sock, self.limits.limit_loopback), self._loop.time()
            admission = self.handshakes.admit(source, now)
            if not admission.admitted or self._link_count() >= self.limits.max_links:
                self._counters["connections_refused"] += 1
                if admission.refused == "per_source":
                    self._counters["connections_refused_per_source"] += 1
                sock.close()
                continue
            if admission.evict is not None:  # its slot is this connection's now
                self.handshakes.remove(admission.evict)
                admission.evict.cancel()
                self._evicted.add(admission.evict)
                admission.evict.add_done_callback(self._evicted.discard)
                self._counters["handshakes_evicted"] += 1
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._serve_handshake(sock), name="handshake")
            self.handshakes.add(task, source, now)
            task.add_done_callback(self.handshakes.remove)
            # evicted or the transport closing, before or during the handshake: the socket too
            task.add_done_callback(lambda done, s=sock: s.close() if done.cancelled() else None)

    async def _serve_handshake(self, sock: socket.socket) -> None:
        peer = None
        with contextlib.suppress(OSError):
            peer = sock.getpeername()
        try:
            async with asyncio.timeout(self.limits.handshake_timeout):
                done = await self._handshake(sock)
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
            self._adopt(done, address)
        except HandshakeError as exc:
            self._counters["handshake_failures"] += 1
            self._log.info("handshake_failed", remote=str(peer), error=str(exc))
