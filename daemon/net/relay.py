"""Relays: a reachable daemon carries links between peers that cannot dial each other.

Like a circuit relay: a peer nobody can dial (B) keeps a link to one or more reachable peers and
*reserves* a slot on each (`relay.reserve`); it then announces circuit addresses,
`<relay address>/p2p-circuit/p2p/<B>`. A peer A that wants B opens a `relay.connect` stream to the
relay naming B; the relay opens a `relay.incoming` stream to B naming A and pumps the bytes both
ways. A and B then run TLS and the usual hellos *inside* that pipe (pipes.py), so the relay sees
only ciphertext and cannot pretend to be either. The result is an ordinary link of kind "relay"
(shown in `node.peers`), which the transport replaces when a better path succeeds later.

The relay is bounded per relayed peer: reservations, concurrent circuits, bytes per second (a
token bucket shared by all of that peer's circuits) and a circuit's lifetime; every refusal says
which limit and is counted. It is meant for signalling and for light traffic, not bulk: bulk
traffic belongs on a better path, and a relayed link is never silent about being one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from .. import timebase
from .addresses import PeerAddress
from .errors import CallTimeout, HandshakeError, PeerUnreachableError, RemoteError, TransportError
from .handshake import pipe_client_handshake, pipe_server_handshake
from .interface import Message, RequestContext, Stream
from .pipes import StreamPipe

if TYPE_CHECKING:
    from .link import Link
    from .transport import TlsTransport

log = structlog.get_logger(__name__)

RESERVE = "relay.reserve"
MAX_TOKENS = 16  # closed runs' tokens a peer presents to a relay
CONNECT = "relay.connect"
INCOMING = "relay.incoming"
ADDRESSES = "net.addresses"  # a peer's addresses changed (e.g. it reserved a relay slot)
MAX_ANNOUNCED = 32
_PUMP_IDLE = 3600.0


class RelayRefused(TransportError):
    """The relay refused (not a relay, no reservation, a limit); the message says which."""


@dataclass(frozen=True)
class RelayLimits:
    enabled: bool = True
    max_reservations: int = 128
    reservation_seconds: float = 600.0
    max_circuits: int = 256
    max_circuits_per_peer: int = 8
    bytes_per_second_per_peer: float = 4 * 1024 * 1024
    burst_bytes: int = 8 * 1024 * 1024
    max_circuit_seconds: float = 3600.0


@dataclass
class _Bucket:
    rate: float
    capacity: float
    tokens: float
    stamp: float = field(default_factory=timebase.monotonic)

    async def take(self, amount: int) -> None:
        """Wait until `amount` bytes may pass (a message bigger than the burst passes alone)."""
        while True:
            now = timebase.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= min(amount, self.capacity):
                self.tokens -= amount
                return
            await asyncio.sleep((min(amount, self.capacity) - self.tokens) / self.rate)


class RelayService:
    """The relay side: reservations and circuits, with limits and counters."""

    def __init__(self, transport: TlsTransport, limits: RelayLimits | None = None,
                 reachable: Callable[[], bool | None] = lambda: True,
                 admit: Callable[[str, Any], None] | None = None) -> None:
        self._transport = transport
        self.limits = limits or RelayLimits()
        self._reachable = reachable
        # Who may use this relay (relay.members_only: members of our closed runs, by the tokens
        # in the request's "tokens"); raises to refuse. None: anyone.
        self._admit_peer = admit
        self._reservations: dict[str, float] = {}  # peer id -> expiry (monotonic)
        self._circuits: dict[str, int] = {}  # relayed peer id -> open circuits
        self._buckets: dict[str, _Bucket] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters: dict[str, int] = {
            "reservations": 0, "reservations_refused": 0, "circuits": 0, "circuits_refused": 0,
            "circuits_expired": 0, "bytes_relayed": 0, "refused_not_member": 0}
        transport.add_unary_handler(RESERVE, self._on_reserve)
        transport.add_stream_handler(CONNECT, self._on_connect)

    def _refuse(self, counter: str, message: str) -> RelayRefused:
        self.counters[counter] += 1
        return RelayRefused(message)

    async def _on_reserve(self, ctx: RequestContext, message: Message) -> Message:
        if not self.limits.enabled or self._reachable() is False:
            raise self._refuse("reservations_refused", "this peer is not a relay")
        self._check_member(ctx.peer_id, message.header.get("tokens"))
        now = timebase.monotonic()
        for peer, expiry in list(self._reservations.items()):
            if expiry <= now:
                del self._reservations[peer]
        if ctx.peer_id not in self._reservations and len(self._reservations) >= self.limits.max_reservations:
            raise self._refuse("reservations_refused", "the relay is full (max_reservations)")
        self._reservations[ctx.peer_id] = now + self.limits.reservation_seconds
        self.counters["reservations"] += 1
        return Message({"seconds": self.limits.reservation_seconds})

    def _bucket(self, peer_id: str) -> _Bucket:
        bucket = self._buckets.get(peer_id)
        if bucket is None:
            limits = self.limits
            bucket = _Bucket(limits.bytes_per_second_per_peer, float(limits.burst_bytes),
                             float(limits.burst_bytes))
            self._buckets[peer_id] = bucket
        return bucket

    async def _on_connect(self, ctx: RequestContext, stream: Stream) -> None:
        header = getattr(stream, "header", {})
        target = header.get("target")
        source = ctx.peer_id
        try:
            self._check_member(source, header.get("tokens"))
            self._admit(source, target)
        except RelayRefused as exc:
            await stream.abort(str(exc))
            return
        assert isinstance(target, str)
        self._circuits[source] = self._circuits.get(source, 0) + 1
        self._circuits[target] = self._circuits.get(target, 0) + 1
        self.counters["circuits"] += 1
        try:
            try:
                onward = await self._transport.open_stream(target, INCOMING, {"from": source}, timeout=10)
            except TransportError as exc:
                await stream.abort(f"the relay cannot reach {target[:12]}: {exc}")
                return
            await self._pump_both(stream, onward, source, target)
        finally:
            for peer in (source, target):
                self._circuits[peer] -= 1
                if not self._circuits[peer]:
                    del self._circuits[peer]
                    self._buckets.pop(peer, None)

    def _check_member(self, peer_id: str, tokens: Any) -> None:
        if self._admit_peer is None:
            return
        try:
            self._admit_peer(peer_id, tokens)
        except (ValueError, PermissionError) as exc:
            raise self._refuse("refused_not_member", f"this relay serves its closed runs' members "
                                                     f"only: {exc}") from None

    def _admit(self, source: str, target: Any) -> None:
        limits = self.limits
        if not limits.enabled:
            raise self._refuse("circuits_refused", "this peer is not a relay")
        if not isinstance(target, str) or not target:
            raise self._refuse("circuits_refused", "relay.connect needs a 'target' peer id")
        expiry = self._reservations.get(target)
        if expiry is None or expiry <= timebase.monotonic():
            raise self._refuse("circuits_refused", f"{target[:12]} has no reservation on this relay")
        if sum(self._circuits.values()) // 2 >= limits.max_circuits:
            raise self._refuse("circuits_refused", "the relay carries too many circuits (max_circuits)")
        for peer in (source, target):
            if self._circuits.get(peer, 0) >= limits.max_circuits_per_peer:
                raise self._refuse("circuits_refused",
                                   f"{peer[:12]} has too many circuits on this relay (max_circuits_per_peer)")

    async def _pump_both(self, a: Stream, b: Stream, source: str, target: str) -> None:
        pumps = [asyncio.create_task(self._pump(a, b, source)), asyncio.create_task(self._pump(b, a, target))]
        try:
            done, _ = await asyncio.wait(pumps, timeout=self.limits.max_circuit_seconds,
                                         return_when=asyncio.FIRST_EXCEPTION)
            if not done or any(not t.cancelled() and t.exception() is not None for t in done):
                if not done:
                    self.counters["circuits_expired"] += 1
                for stream in (a, b):
                    with contextlib.suppress(TransportError):
                        await stream.abort("circuit closed by the relay")
            else:
                await asyncio.wait(pumps, timeout=self.limits.max_circuit_seconds)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, source: Stream, sink: Stream, sender: str) -> None:
        """Carry one direction until the source ends (then close the sink); errors propagate."""
        bucket = self._bucket(sender)
        while True:
            try:
                message = await source.receive(timeout=_PUMP_IDLE)
            except CallTimeout:
                continue
            if message is None:
                await sink.close()
                return
            size = len(message.payload)
            await bucket.take(size)
            await sink.send(Message({}, message.payload), timeout=120)
            self.counters["bytes_relayed"] += size


class RelayClient:
    """The peer side: dial circuit addresses; accept circuits; reserve slots when unreachable."""

    def __init__(self, transport: TlsTransport, *, handshake_timeout: float = 10.0,
                 credentials: Callable[[], list[str]] = list) -> None:
        self._transport = transport
        self._handshake_timeout = handshake_timeout
        self._credentials = credentials  # our closed runs' tokens, for relays that ask
        self.relays: dict[str, PeerAddress] = {}  # relay peer id -> its address, while reserved
        self.counters: dict[str, int] = {"circuits_dialed": 0, "circuits_accepted": 0,
                                         "circuit_failures": 0, "circuits_not_reserved": 0}
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_addresses: Callable[[list[str]], None] | None = None  # e.g. publish them in the DHT
        transport.add_stream_handler(INCOMING, self._on_incoming)
        transport.add_unary_handler(ADDRESSES, self._on_addresses)
        transport.set_circuit_dialer(self.dial)

    async def dial(self, address: PeerAddress) -> Link:
        """A link to `address.circuit` through the relay `address.peer_id` (TLS end to end)."""
        transport = self._transport
        target, relay = address.circuit, address.peer_id
        if target is None or relay is None:
            raise PeerUnreachableError(f"{address} is not a circuit address")
        if relay not in {link.peer_id for link in transport.links()}:
            await transport.connect(address.relay, timeout=self._handshake_timeout)
        _, client_ctx, _ = transport.tls_contexts
        if client_ctx is None:
            raise PeerUnreachableError("relayed links need TLS")
        try:
            stream = await transport.open_stream(relay, CONNECT, self._header({"target": target}),
                                                 timeout=self._handshake_timeout)
            async with asyncio.timeout(self._handshake_timeout):
                done = await pipe_client_handshake(StreamPipe(stream), transport.identity, client_ctx,
                                                   target, transport.listen_addresses())
        except (TransportError, TimeoutError) as exc:
            self.counters["circuit_failures"] += 1
            reason = exc.message if isinstance(exc, RemoteError) else str(exc) or "timed out"
            raise PeerUnreachableError(f"no circuit to {target[:12]} through {relay[:12]}: {reason}") \
                from exc
        self.counters["circuits_dialed"] += 1
        log.info("relayed_link_up", peer=target[:12], relay=relay[:12], outbound=True)
        return transport.adopt(done, outbound=True, address=str(address))

    async def _on_incoming(self, ctx: RequestContext, stream: Stream) -> None:
        transport = self._transport
        source = getattr(stream, "header", {}).get("from")
        server_ctx, _, der = transport.tls_contexts
        if server_ctx is None or der is None or not isinstance(source, str):
            await stream.abort("this peer takes no relayed links")
            return
        if ctx.peer_id not in self.relays:  # any linked peer could nest links in its own link
            self.counters["circuits_not_reserved"] += 1
            await stream.abort("this peer takes relayed links only from relays it reserved with")
            return
        try:
            async with asyncio.timeout(self._handshake_timeout):
                done = await pipe_server_handshake(StreamPipe(stream), transport.identity, server_ctx,
                                                   der, transport.listen_addresses())
        except (HandshakeError, TransportError, TimeoutError) as exc:
            self.counters["circuit_failures"] += 1
            log.info("relayed_link_failed", relay=ctx.peer_id[:12], error=str(exc))
            return
        if done.peer.peer_id != source:
            done.io.close()
            self.counters["circuit_failures"] += 1
            log.warning("relayed_link_peer_mismatch", relay=ctx.peer_id[:12], claimed=source[:12])
            return
        self.counters["circuits_accepted"] += 1
        log.info("relayed_link_up", peer=source[:12], relay=ctx.peer_id[:12], outbound=False)
        link = transport.adopt(done, outbound=False, address=f"relay:{ctx.peer_id}")
        await link.wait_closed()  # the stream (and so the pipe) lives as long as the link

    async def reserve(self, relay: PeerAddress, timeout: float = 10.0) -> float:
        """Reserve a slot on `relay` (an address with its peer id); seconds it lasts."""
        transport = self._transport
        assert relay.peer_id is not None
        await transport.connect(relay, timeout=timeout)
        reply = await transport.call(relay.peer_id, RESERVE, Message(self._header({})), timeout=timeout)
        self.relays[relay.peer_id] = relay
        self._announce()
        return float(reply.header.get("seconds", 0.0))

    def _header(self, header: dict[str, Any]) -> dict[str, Any]:
        tokens = self._credentials()
        return {**header, "tokens": tokens[:MAX_TOKENS]} if tokens else header

    def forget(self, relay_id: str) -> None:
        if self.relays.pop(relay_id, None) is not None:
            self._announce()

    def _announce(self) -> None:
        """Our circuit addresses changed: use them in hellos, and tell the peers we are linked to
        (they may need to dial us back later, through a relay)."""
        transport = self._transport
        own = transport.peer_id
        transport.set_relayed_addresses([a.via(own) for a in self.relays.values()])
        addresses = [str(a) for a in transport.listen_addresses()]
        if self.on_addresses is not None:
            self.on_addresses(addresses)
        for peer_id in {info.peer_id for info in transport.links()}:
            task = asyncio.create_task(self._tell(peer_id, addresses), name="announce-addresses")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _tell(self, peer_id: str, addresses: list[str]) -> None:
        with contextlib.suppress(TransportError, TimeoutError):
            await self._transport.call(peer_id, ADDRESSES, Message({"addrs": addresses}), timeout=10)

    async def _on_addresses(self, ctx: RequestContext, message: Message) -> Message:
        raw = message.header.get("addrs")
        if not isinstance(raw, list) or len(raw) > MAX_ANNOUNCED:
            raise RelayRefused(f"'addrs' must be a list of at most {MAX_ANNOUNCED} addresses")
        addresses = []
        for text in raw:
            with contextlib.suppress(ValueError, TypeError):
                addresses.append(PeerAddress.parse(text))
        self._transport.learn_addresses(ctx.peer_id, addresses)
        return Message({})

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
