"""The simulated internet: real links over in-memory pipes with latency, bandwidth and faults.

Each simulated host has an uplink and a downlink (bytes per second) and a one-way latency to the
core; a byte from A to B waits for A's uplink, travels `A.latency + B.latency`, then waits for
B's downlink. The pipes carry the bytes of the daemon's own `Link` (daemon/net/link.py): framing,
multiplexing, flow control and keepalives are the real ones, and `SimTransport` is the daemon's
`TlsTransport` with its sockets replaced (dialing, the hello handshake that binds peer ids, link
deduplication and the address book are the real ones; TLS is left out: it would only cost time).

Faults, as on the internet:
- `partition(a, b)` / `heal()`: bytes between the two sides are held (a bridge that drops
  packets, no reset); a dial across waits for its caller's timeout. Held bytes flow again at the
  heal if the link is still up (TCP retransmits), but links' keepalives drop a link after
  `ping_timeout` of silence, as they would on the internet.
- `silence(host)` / `restore(host)`: one host behind such a cut.
- A host that stops (its transport closes) resets its links: the other end reads the end at once.

Time is the event loop's (`VirtualClockLoop`): nothing here sleeps in wall time.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from dedloc.daemon.identity import Identity
from dedloc.daemon.net.addresses import PeerAddress
from dedloc.daemon.net.errors import (
    HandshakeError,
    PeerIdMismatchError,
    PeerUnreachableError,
    TransportClosed,
    TransportError,
)
from dedloc.daemon.net.handshake import hello_as_client, hello_as_server
from dedloc.daemon.net.link import Link
from dedloc.daemon.net.ratelimit import Bandwidth
from dedloc.daemon.net.tls import PLAIN_CERT_HASH
from dedloc.daemon.net.transport import TlsTransport, TransportLimits

__all__ = ["LinkProfile", "SimNetwork", "SimPipe", "SimTransport"]

log = structlog.get_logger(__name__)

Buffer = bytes | bytearray | memoryview
DOMAIN = "sim.invalid"  # RFC 6761: never resolves, so no simulated address can reach a real host
#: What a sender may have in flight before `send_all` waits (a socket's send buffer).
SEND_BUFFER_BYTES = 256 * 1024


@dataclass(frozen=True)
class LinkProfile:
    """A host's connection: uplink and downlink in bytes per second, one-way latency in seconds."""

    upload: float = 12.5e6  # 100 Mbit/s
    download: float = 12.5e6
    latency: float = 0.01

    def __post_init__(self) -> None:
        if not (self.upload > 0 and self.download > 0 and self.latency >= 0):
            raise ValueError("a link profile needs positive bandwidths and a latency >= 0")


class _Host:
    """One host's network interface: when its uplink and downlink are next free."""

    def __init__(self, index: int, profile: LinkProfile) -> None:
        self.index = index
        self.profile = profile
        self.tx_free = 0.0
        self.rx_free = 0.0
        self.silenced = False
        self.transport: SimTransport | None = None

    @property
    def name(self) -> str:
        return f"peer-{self.index}.{DOMAIN}"


class _Direction:
    """The bytes in flight from one end of a pipe to the other, delivered in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.in_flight: deque[tuple[float, bytes]] = deque()
        self.arrived = bytearray()
        self.closed = False  # the sender closed: the reader sees the end after what arrived
        self.held = False  # a partition between the ends: nothing is delivered
        self._readable = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def push(self, at: float, data: bytes) -> None:
        self.in_flight.append((at, data))
        self._schedule()

    def close(self) -> None:
        self.closed = True
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None or self.held:
            return
        if not self.in_flight:
            if self.closed:
                self._readable.set()
            return
        self._timer = self._loop.call_at(self.in_flight[0][0], self._deliver)

    def _deliver(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self.in_flight and self.in_flight[0][0] <= now and not self.held:
            self.arrived += self.in_flight.popleft()[1]
        if self.arrived:
            self._readable.set()
        self._schedule()

    def discard(self) -> None:
        """The reading end closed: what is in flight or unread is dropped; the sender's next
        write fails (a reset)."""
        self.closed = True
        self.in_flight.clear()
        self.arrived.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._readable.set()

    def hold(self, held: bool) -> None:
        self.held = held
        if held and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not held:
            self._schedule()

    async def read_into(self, buffer: memoryview) -> int:
        while not self.arrived:
            if self.closed and not self.in_flight:
                return 0
            self._readable.clear()
            await self._readable.wait()
        count = min(len(buffer), len(self.arrived))
        buffer[:count] = self.arrived[:count]
        del self.arrived[:count]
        return count


class SimPipe:
    """One end of a simulated TCP connection (the `Pipe` a `Link` runs over)."""

    kind = "tcp"

    def __init__(self, network: SimNetwork, local: _Host, remote: _Host, inbound: _Direction,
                 outbound: _Direction) -> None:
        self._network = network
        self.local = local
        self.remote = remote
        self._in = inbound
        self._out = outbound
        self.closed = False

    async def recv_into(self, buffer: memoryview) -> int:
        if self.closed:
            raise TransportClosed("the connection is closed")
        return await self._in.read_into(buffer)

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        if self.closed or self._out.closed:
            raise TransportClosed("the connection is closed")
        data = b"".join(buffers)
        if not data:
            return
        loop = self._network.loop
        now = loop.time()
        src, dst = self.local, self.remote
        start = max(now, src.tx_free)
        src.tx_free = start + len(data) / src.profile.upload
        arrival = src.tx_free + src.profile.latency + dst.profile.latency
        dst.rx_free = max(arrival, dst.rx_free) + len(data) / dst.profile.download
        self._out.push(dst.rx_free, data)
        backlog = (src.tx_free - now) * src.profile.upload
        if backlog > SEND_BUFFER_BYTES:  # the send buffer is full: wait until it drains
            await asyncio.sleep((backlog - SEND_BUFFER_BYTES) / src.profile.upload)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._out.close()
        self._in.discard()  # our own reader (if any) ends too; the far end's writes fail
        self._network._forget(self)


class SimNetwork:
    """Hosts and the pipes between them (see the module docstring)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._hosts: dict[str, _Host] = {}
        self._pipes: dict[SimPipe, None] = {}  # (ordered: runs of one seed alike)
        self._partitions: list[tuple[frozenset[int], frozenset[int]]] = []
        self._topology_changed = asyncio.Event()

    def add_host(self, profile: LinkProfile | None = None) -> _Host:
        host = _Host(len(self._hosts), profile or LinkProfile())
        self._hosts[host.name] = host
        return host

    def _separated(self, a: _Host, b: _Host) -> bool:
        if a.silenced or b.silenced:
            return True
        return any((a.index in x and b.index in y) or (a.index in y and b.index in x)
                   for x, y in self._partitions)

    # Faults ------------------------------------------------------------------------------

    def partition(self, side_a: set[int], side_b: set[int]) -> None:
        """Cut the hosts of `side_a` (host indexes) off from those of `side_b`."""
        self._partitions.append((frozenset(side_a), frozenset(side_b)))
        self._apply()

    def heal(self) -> None:
        self._partitions.clear()
        self._apply()

    def silence(self, host: _Host) -> None:
        host.silenced = True
        self._apply()

    def restore(self, host: _Host) -> None:
        host.silenced = False
        self._apply()

    def _apply(self) -> None:
        for pipe in self._pipes:
            pipe._out.hold(self._separated(pipe.local, pipe.remote))
        self._topology_changed.set()
        self._topology_changed = asyncio.Event()

    def _forget(self, pipe: SimPipe) -> None:
        self._pipes.pop(pipe, None)

    # Connections -------------------------------------------------------------------------

    def _pair(self, a: _Host, b: _Host) -> tuple[SimPipe, SimPipe]:
        a_to_b, b_to_a = _Direction(self.loop), _Direction(self.loop)
        ours = SimPipe(self, a, b, b_to_a, a_to_b)
        theirs = SimPipe(self, b, a, a_to_b, b_to_a)
        self._pipes.update(dict.fromkeys((ours, theirs)))
        held = self._separated(a, b)
        a_to_b.hold(held)
        b_to_a.hold(held)
        return ours, theirs

    async def dial(self, source: _Host, address: PeerAddress) -> SimPipe:
        """A TCP connect from `source` to `address`: one round trip, then a pipe to whoever
        listens there (its transport runs the server side of the handshake)."""
        target = self._hosts.get(address.host)
        if target is None or address.transport != "tcp":
            raise PeerUnreachableError(f"no simulated host at {address}")
        rtt = 2 * (source.profile.latency + target.profile.latency)
        while self._separated(source, target):  # the SYN is dropped: wait out the caller's timeout
            await self._topology_changed.wait()
        await asyncio.sleep(rtt)
        listener = target.transport
        if listener is None or listener.closed:
            raise PeerUnreachableError(f"connection refused by {address}")
        ours, theirs = self._pair(source, target)
        listener.accept(theirs)
        return ours


class SimTransport(TlsTransport):
    """The daemon's transport on a simulated host (see the module docstring). Start with
    `SimTransport.start_on(network, host, identity)`, close with `close()`."""

    def __init__(self, network: SimNetwork, host: _Host, identity: Identity, *,
                 limits: TransportLimits, bandwidth: Bandwidth | None = None) -> None:
        super().__init__(identity, limits=limits, tls=False, bandwidth=bandwidth)
        self.network = network
        self.host = host
        self._context = contextvars.copy_context()  # the peer's own (its clock, its log context)
        self._bound.append(PeerAddress("dns", host.name, 4100, "tcp", identity.peer_id))

    @classmethod
    def start_on(cls, network: SimNetwork, host: _Host, identity: Identity, *,
                 limits: TransportLimits | None = None,
                 bandwidth: Bandwidth | None = None) -> SimTransport:
        transport = cls(network, host, identity, limits=limits or TransportLimits(),
                        bandwidth=bandwidth)
        host.transport = transport
        return transport

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        if self.host.transport is self:
            self.host.transport = None
        await super().close()

    def accept(self, pipe: SimPipe) -> None:
        """An inbound connection: run the server side of the handshake in this peer's context."""
        now = self._loop.time()  # (simulated hosts are one source each, not limited per source)
        if not self._handshakes.admit(None, now).admitted or \
                len(self._all_links) >= self.limits.max_links:
            self._counters["connections_refused"] += 1
            pipe.close()
            return
        self._counters["connections_accepted"] += 1
        task = self._loop.create_task(self._serve_pipe(pipe), name="handshake", context=self._context)
        self._handshakes.add(task, None, now)
        task.add_done_callback(self._handshakes.remove)

    async def _serve_pipe(self, pipe: SimPipe) -> None:
        try:
            async with asyncio.timeout(self.limits.handshake_timeout):
                done = await hello_as_server(pipe, self._identity, PLAIN_CERT_HASH,
                                             self.listen_addresses())
            self._add_link(done, outbound=False, address=pipe.remote.name)
        except (TimeoutError, HandshakeError, TransportError) as exc:
            pipe.close()
            self._counters["handshake_failures"] += 1
            self._log.info("handshake_failed", remote=pipe.remote.name, error=str(exc))

    async def _dial(self, address: PeerAddress) -> Link:
        pipe = await self.network.dial(self.host, address)
        try:
            done = await hello_as_client(pipe, self._identity, PLAIN_CERT_HASH, address.peer_id,
                                         self.listen_addresses())
        except PeerIdMismatchError:
            self._counters["peer_id_mismatches"] += 1
            raise
        except HandshakeError:
            self._counters["handshake_failures"] += 1
            raise
        except BaseException:
            pipe.close()
            raise
        if self._closed:
            pipe.close()
            raise TransportClosed("the transport closed while dialing")
        link = self._add_link(done, outbound=True, address=str(address))
        return self._usable(link.peer_id) or link

    async def probe(self, address: PeerAddress, timeout: float) -> str:
        try:
            async with asyncio.timeout(timeout):
                pipe = await self.network.dial(self.host, address)
                done = await hello_as_client(pipe, self._identity, PLAIN_CERT_HASH,
                                             address.peer_id, self.listen_addresses())
        except TimeoutError:
            raise PeerUnreachableError(f"probing {address} timed out after {timeout}s") from None
        done.io.close()
        return done.peer.peer_id
