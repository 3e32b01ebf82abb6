"""The narrow port through which the DHT and averaging talk to peers: `PeerTransport`.

Whatever carries the bytes (TCP+TLS today; WebRTC data channels and relays later), users of the
transport see authenticated peers (by peer id), unary calls and streams of messages. A message is
a small JSON-able header plus a raw binary payload (tensor bytes never go through JSON).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .addresses import PeerAddress
from .errors import TransportError


@dataclass(frozen=True)
class Message:
    """What a call or a stream carries: a JSON-able header and raw bytes."""

    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes | bytearray | memoryview = b""


@dataclass(frozen=True)
class RequestContext:
    """Who is calling: the authenticated peer id and the link it came over (`remote_host`: the
    IP address at the other end of a direct link, as this side's socket sees it; None over a
    relayed or WebRTC link)."""

    peer_id: str
    link_kind: str = "tcp"
    addresses: tuple[PeerAddress, ...] = ()
    remote_host: str | None = None


@dataclass(frozen=True)
class LinkInfo:
    """One open link to a peer, for `node.peers`."""

    peer_id: str
    address: str | None
    kind: str
    outbound: bool
    rtt_ms: float | None
    bytes_in: int
    bytes_out: int
    streams: int
    opened_at: float


class Stream(Protocol):
    """A bidirectional, ordered, flow-controlled sequence of messages within one link."""

    header: dict[str, Any]
    """The header given to `open_stream` (what the serving handler reads to know what is asked)."""

    async def send(self, message: Message, *, timeout: float) -> None:
        """Send one message; waits (up to `timeout`) while the peer's window is full."""

    async def receive(self, *, timeout: float) -> Message | None:
        """The next message, or None once the peer has closed its side."""

    async def receive_into(self, buffer: bytearray | memoryview, *, timeout: float) -> Message | None:
        """Like receive(), but the payload is received straight into `buffer` (the message's
        payload is then a view of its first bytes); a message bigger than the buffer aborts the
        stream with LimitExceeded."""

    async def close(self) -> None:
        """Close our sending side (the peer's receive returns None after what was sent)."""

    async def abort(self, reason: str) -> None:
        """Tear the stream down both ways; the peer's next call raises StreamAborted."""

    def failure(self) -> asyncio.Future[TransportError]:
        """Resolved with the stream's error once it fails (aborted by either side, or its link
        ended), without reading it."""


UnaryHandler = Callable[[RequestContext, Message], Awaitable[Message]]
StreamHandler = Callable[[RequestContext, Stream], Awaitable[None]]


class PeerTransport(Protocol):
    """Authenticated links to peers by peer id. Implementations: TlsTransport, MemoryTransport."""

    @property
    def peer_id(self) -> str: ...

    def listen_addresses(self) -> list[PeerAddress]:
        """Addresses other peers may dial to reach us (with our peer id)."""

    def add_unary_handler(self, method: str, handler: UnaryHandler) -> None:
        """Serve `method`: the handler's returned Message is the reply; an exception becomes a
        RemoteError at the caller (its message, not its traceback)."""

    def add_stream_handler(self, method: str, handler: StreamHandler) -> None:
        """Serve streams opened with `method`."""

    def learn_addresses(self, peer_id: str, addresses: list[PeerAddress], *,
                        first_hand: bool = True) -> None:
        """Remember how to dial `peer_id`. First-hand addresses (the peer's own word) go first;
        second-hand ones (what others' routing tables say) only fill in after them."""

    async def connect(self, address: PeerAddress, *, timeout: float) -> str:
        """Open (or reuse) a link to the peer at `address`; return its authenticated peer id.
        If the address names a peer id and another peer answers: PeerIdMismatchError."""

    async def call(self, peer_id: str, method: str, message: Message, *, timeout: float) -> Message:
        """One request, one reply, within `timeout` (dialing included)."""

    async def open_stream(self, peer_id: str, method: str, header: dict[str, Any], *,
                          timeout: float) -> Stream:
        """Open a stream to `peer_id` served by its handler for `method`."""

    def links(self) -> list[LinkInfo]:
        """The open links."""

    async def close(self) -> None:
        """Close every link and listener; pending calls fail with TransportClosed."""
