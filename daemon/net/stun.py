"""A STUN responder: every reachable daemon answers Binding requests on a UDP port of its own.

A peer behind a NAT learns its public address (its server-reflexive ICE candidate) by sending a
Binding request (RFC 5389) to any daemon it can reach, so a collaboration needs no outside STUN
server. The daemon announces the port as `/ip4/<host>/udp/<port>/p2p/<peer-id>`;
`ice_servers_from` turns such addresses into `stun:host:port` URLs for aiortc's RTCIceServer.

The responder is stateless and hardened for the open internet: it answers only well-formed
Binding requests, with a Binding success response that is never much larger than the request
(XOR-MAPPED-ADDRESS, MAPPED-ADDRESS for old clients, FINGERPRINT if the request had one), and at
most `StunLimits.rate` replies a second to one source address (plus a cap on all replies), so
that a spoofed flood cannot turn it into an amplifier. Anything else is dropped silently and
counted. The message codec is aioice's (`aioice.stun`).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from aioice import stun

from .. import timebase
from .addresses import PeerAddress
from .errors import TransportError

log = structlog.get_logger(__name__)

MAX_DATAGRAM = 1500
"""Longer datagrams are dropped unread: a Binding request is a few dozen bytes."""
MAX_GROWTH = 40
"""A reply is never more than this many bytes longer than the request it answers."""

_COUNTERS = ("stun_requests", "stun_answered", "stun_malformed", "stun_ignored", "stun_rate_limited")


@dataclass(frozen=True)
class StunLimits:
    rate: float = 50.0
    """Replies per second to one source address, on average."""
    burst: float = 100.0
    """Replies one source address may get at once before `rate` applies."""
    max_sources: int = 4096
    """Source addresses whose rate is remembered; the least recently seen is forgotten first."""
    total_rate: float = 2000.0
    """Replies per second to all sources together (spoofed sources are many)."""
    total_burst: float = 4000.0


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp

    def take(self, now: float, rate: float, burst: float) -> bool:
        self.tokens = min(burst, self.tokens + max(0.0, now - self.stamp) * rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class StunResponder(asyncio.DatagramProtocol):
    """Answers STUN Binding requests on one UDP socket. Start with `await StunResponder.start()`."""

    def __init__(self, limits: StunLimits | None = None,
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.limits = limits or StunLimits()
        self._clock = clock
        self._transport: asyncio.DatagramTransport | None = None
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._sources: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self._total = _Bucket(self.limits.total_burst, clock())
        self._failed_once = False

    @classmethod
    async def start(cls, host: str, port: int = 0, *, prefer_port: int | None = None,
                    limits: StunLimits | None = None,
                    clock: Callable[[], float] = timebase.monotonic) -> StunResponder:
        """Bind a UDP socket on `host` and start answering.

        `port` 0 picks a port: `prefer_port` (e.g. the TCP listen port) if it is free, else any
        free one. A port that cannot be bound is a TransportError with the reason.
        """
        if not 0 <= port <= 65535:
            raise ValueError(f"STUN port {port} is out of range")
        loop = asyncio.get_running_loop()
        candidates = [port]
        if port == 0 and prefer_port:
            candidates = [prefer_port, 0]
        error: OSError | None = None
        for candidate in candidates:
            responder = cls(limits, clock)
            try:
                await loop.create_datagram_endpoint(responder._itself, local_addr=(host, candidate))
            except OSError as exc:
                error = exc
                continue
            return responder
        raise TransportError(f"cannot listen for STUN on udp {host}:{port}: {error}") from error

    def _itself(self) -> StunResponder:
        return self

    # --- the socket -----------------------------------------------------------------------------
    @property
    def bound_port(self) -> int:
        return int(self._sockname()[1])

    @property
    def bound_host(self) -> str:
        return str(self._sockname()[0])

    def _sockname(self) -> tuple[Any, ...]:
        if self._transport is None:
            raise RuntimeError("the STUN responder is not started")
        return tuple(self._transport.get_extra_info("sockname"))

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    @property
    def closed(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # --- asyncio.DatagramProtocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (cast: asyncio's own UDP transport is not a DatagramTransport subclass in 3.11)
        self._transport = typing.cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self._counters["stun_requests"] += 1
        try:
            self._answer(data, addr)
        except Exception as exc:  # a bug here must never stop the responder
            self._counters["stun_malformed"] += 1
            if not self._failed_once:
                self._failed_once = True
                log.warning("stun_datagram_failed", error=repr(exc), size=len(data))

    def error_received(self, exc: Exception) -> None:
        # ICMP errors for earlier replies (port unreachable, ...): nothing to do about them.
        log.debug("stun_socket_error", error=str(exc))

    # --- answering ------------------------------------------------------------------------------
    def _answer(self, data: bytes, addr: tuple[Any, ...]) -> None:
        source = _source_address(addr)
        if source is None or not _is_stun_header(data):
            self._counters["stun_malformed"] += 1
            return
        try:
            request = stun.parse_message(data)
        except Exception:  # ValueError mostly; struct.error on a truncated attribute
            self._counters["stun_malformed"] += 1
            return
        if (request.message_method != stun.Method.BINDING
                or request.message_class != stun.Class.REQUEST):
            self._counters["stun_ignored"] += 1
            return
        if not self._allow(source[0]):
            self._counters["stun_rate_limited"] += 1
            return
        reply = _binding_response(request, source, fingerprint="FINGERPRINT" in request.attributes,
                                  max_size=len(data) + MAX_GROWTH)
        if reply is None or self._transport is None or self._transport.is_closing():
            self._counters["stun_ignored"] += 1
            return
        self._transport.sendto(reply, addr)
        self._counters["stun_answered"] += 1

    def _allow(self, host: str) -> bool:
        limits = self.limits
        now = self._clock()
        bucket = self._sources.get(host)
        if bucket is None:
            bucket = self._sources[host] = _Bucket(limits.burst, now)
            while len(self._sources) > limits.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(host)
        if not bucket.take(now, limits.rate, limits.burst):
            return False
        if not self._total.take(now, limits.total_rate, limits.total_burst):
            bucket.tokens += 1.0  # not this source's fault: give its token back
            return False
        return True


def _is_stun_header(data: bytes) -> bool:
    """An RFC 5389 message: small enough, first two bits zero, the magic cookie, a length that
    matches the datagram and is a multiple of 4 (aioice's parser checks only the length)."""
    if not stun.HEADER_LENGTH <= len(data) <= MAX_DATAGRAM or data[0] & 0xC0:
        return False
    length = int.from_bytes(data[2:4], "big")
    cookie = int.from_bytes(data[4:8], "big")
    return cookie == stun.COOKIE and length % 4 == 0 and len(data) == stun.HEADER_LENGTH + length


def _source_address(addr: tuple[Any, ...]) -> tuple[str, int] | None:
    """The request's source as (ip, port), IPv4-mapped IPv6 as IPv4; None if not answerable."""
    try:
        ip = ipaddress.ip_address(str(addr[0]).split("%", 1)[0])
        port = int(addr[1])
    except (ValueError, IndexError, TypeError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if port == 0 or ip.is_multicast or ip.is_unspecified:
        return None
    if isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address("255.255.255.255"):
        return None
    return str(ip), port


def _binding_response(request: stun.Message, source: tuple[str, int], *, fingerprint: bool,
                      max_size: int) -> bytes | None:
    """The Binding success response for `request` from `source`, no longer than `max_size`
    (MAPPED-ADDRESS is left out if it would not fit); None if even the smallest does not."""
    for with_mapped in (True, False):
        response = stun.Message(stun.Method.BINDING, stun.Class.RESPONSE,
                                transaction_id=request.transaction_id)
        response.attributes["XOR-MAPPED-ADDRESS"] = source
        if with_mapped:
            response.attributes["MAPPED-ADDRESS"] = source
        if fingerprint:
            response.add_fingerprint()
        data = bytes(response)
        if len(data) <= max_size:
            return data
    return None


# --- addresses ----------------------------------------------------------------------------------


def stun_address(host: str, port: int, peer_id: str | None) -> PeerAddress:
    """The address we announce for a STUN responder: `/ip4/<host>/udp/<port>/p2p/<peer-id>`."""
    kind = "ip6" if ":" in host else "ip4"
    return PeerAddress(kind, host, port, "udp", peer_id)


def ice_servers_from(addresses: Iterable[PeerAddress], limit: int = 4) -> list[str]:
    """`stun:host:port` URLs (for aiortc's RTCIceServer) of the udp addresses, in order, without
    repeats, at most `limit`."""
    urls: list[str] = []
    for address in addresses:
        if len(urls) >= limit:
            break
        if address.transport != "udp" or not address.host or not 0 < address.port <= 65535:
            continue
        host = f"[{address.host}]" if address.host_kind == "ip6" else address.host
        url = f"stun:{host}:{address.port}"
        if url not in urls:
            urls.append(url)
    return urls
