"""An in-memory `PeerTransport` for fast tests of the layers above the transport.

`MemoryNetwork` is the wire: it routes calls between the `MemoryTransport`s registered on it, with
the unary-call semantics of the real transport:
- a call needs a way to reach the peer: addresses learned for it, or a link opened by `connect`
  or by the peer calling us; otherwise, or when the peer is gone, down or partitioned away from
  us: `PeerUnreachableError`;
- the reply must come within `timeout`, else `CallTimeout` (a "blackholed" peer swallows calls);
- a handler's exception becomes `RemoteError(kind=<its class name>, message)` at the caller, a
  missing handler `UnknownMethod`; headers round-trip through orjson (so they must be JSON-able)
  and payloads are copied; a message over `max_message_bytes` raises `LimitExceeded`;
- `close()` cancels the handlers it runs and fails its pending calls with `TransportClosed`.
Faults: `set_down(peer_id)` (refuses at once, like a closed port), `blackhole(peer_id)` (calls
hang until their timeout), `partition(group_a, group_b)`, `heal()`, `restore(peer_id)`; `latency`
adds a one-way delay to every call.

Streams are not supported: `open_stream` raises TransportError("streams not supported by
MemoryTransport").
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import structlog

from .. import timebase
from .addresses import PeerAddress
from .errors import (
    CallTimeout,
    LimitExceeded,
    PeerIdMismatchError,
    PeerUnreachableError,
    RemoteError,
    TransportClosed,
    TransportError,
    UnknownMethod,
)
from .interface import LinkInfo, Message, RequestContext, Stream, StreamHandler, UnaryHandler

log = structlog.get_logger(__name__)

MEMORY_HOST = "memory"


class MemoryNetwork:
    def __init__(self, *, latency: float = 0.0, max_message_bytes: int = 16 * 1024 * 1024) -> None:
        self.latency = latency
        self.max_message_bytes = max_message_bytes
        self._by_peer: dict[str, MemoryTransport] = {}
        self._by_port: dict[int, MemoryTransport] = {}
        self._next_port = 1
        self._down: set[str] = set()
        self._blackholed: set[str] = set()
        self._partitions: list[tuple[frozenset[str], frozenset[str]]] = []

    def transport(self, peer_id: str) -> MemoryTransport:
        """Attach a new peer to the network and return its transport."""
        if peer_id in self._by_peer:
            raise ValueError(f"peer {peer_id} is already on this network")
        port = self._next_port
        self._next_port += 1
        transport = MemoryTransport(self, peer_id, port)
        self._by_peer[peer_id] = transport
        self._by_port[port] = transport
        return transport

    def set_down(self, peer_id: str) -> None:
        self._down.add(peer_id)

    def blackhole(self, peer_id: str) -> None:
        self._blackholed.add(peer_id)

    def restore(self, peer_id: str) -> None:
        self._down.discard(peer_id)
        self._blackholed.discard(peer_id)

    def partition(self, group_a: set[str], group_b: set[str]) -> None:
        self._partitions.append((frozenset(group_a), frozenset(group_b)))

    def heal(self) -> None:
        self._partitions.clear()

    def _detach(self, transport: MemoryTransport) -> None:
        if self._by_peer.get(transport.peer_id) is transport:
            del self._by_peer[transport.peer_id]
            del self._by_port[transport.port]

    def _separated(self, a: str, b: str) -> bool:
        return any((a in x and b in y) or (a in y and b in x) for x, y in self._partitions)

    def _reachable(self, source: str, target: str) -> MemoryTransport:
        peer = self._by_peer.get(target)
        if peer is None or target in self._down or self._separated(source, target):
            raise PeerUnreachableError(f"peer {target} does not answer")
        return peer


class MemoryTransport:
    """One peer's end of a `MemoryNetwork` (see the module docstring for the semantics)."""

    def __init__(self, network: MemoryNetwork, peer_id: str, port: int) -> None:
        self._network = network
        self._peer_id = peer_id
        self.port = port
        self._unary: dict[str, UnaryHandler] = {}
        self._known: dict[str, list[PeerAddress]] = {}
        self._links: dict[str, float] = {}  # peer id -> opened at
        self._handler_tasks: set[asyncio.Task[Message]] = set()
        self._pending: set[asyncio.Future[Message]] = set()
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def listen_addresses(self) -> list[PeerAddress]:
        return [PeerAddress("dns", MEMORY_HOST, self.port, "tcp", self._peer_id)]

    def add_unary_handler(self, method: str, handler: UnaryHandler) -> None:
        self._unary[method] = handler

    def add_stream_handler(self, method: str, handler: StreamHandler) -> None:
        raise TransportError("streams not supported by MemoryTransport")

    def learn_addresses(self, peer_id: str, addresses: list[PeerAddress], *,
                        first_hand: bool = True) -> None:
        if peer_id == self._peer_id or not addresses:
            return
        if first_hand or peer_id not in self._known:
            self._known[peer_id] = list(addresses)

    async def connect(self, address: PeerAddress, *, timeout: float) -> str:
        self._check_open()
        peer = self._network._by_port.get(address.port) if address.host == MEMORY_HOST else None
        if peer is None:
            raise PeerUnreachableError(f"nothing listens at {address}")
        self._network._reachable(self._peer_id, peer.peer_id)
        if address.peer_id is not None and address.peer_id != peer.peer_id:
            raise PeerIdMismatchError(f"{address} is served by {peer.peer_id}")
        if peer.peer_id in self._network._blackholed:
            await asyncio.sleep(timeout)
            raise CallTimeout(f"connecting to {address} timed out after {timeout} s")
        self._open_link(peer)
        return peer.peer_id

    def _open_link(self, peer: MemoryTransport) -> None:
        now = timebase.now()
        self._links.setdefault(peer.peer_id, now)
        peer._links.setdefault(self._peer_id, now)

    async def call(self, peer_id: str, method: str, message: Message, *, timeout: float) -> Message:
        self._check_open()
        if peer_id == self._peer_id:
            raise TransportError("a peer cannot call itself")
        if peer_id not in self._links and peer_id not in self._known:
            raise PeerUnreachableError(f"no known address for peer {peer_id}")
        request = self._copy(message)
        network = self._network
        try:
            async with asyncio.timeout(timeout):
                peer = network._reachable(self._peer_id, peer_id)
                self._open_link(peer)
                reply: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
                self._pending.add(reply)
                try:
                    if peer_id not in network._blackholed:
                        peer._serve(self._peer_id, method, request, reply)
                    return self._copy(await reply)
                finally:
                    self._pending.discard(reply)
        except TimeoutError:
            raise CallTimeout(f"{method} to {peer_id} got no reply within {timeout} s") from None

    def _serve(self, caller: str, method: str, request: Message, reply: asyncio.Future[Message]) -> None:
        task = asyncio.create_task(self._run_handler(caller, method, request))
        self._handler_tasks.add(task)

        def done(task: asyncio.Task[Message]) -> None:
            self._handler_tasks.discard(task)
            if reply.done():
                if not task.cancelled():
                    task.exception()  # the caller gave up: nobody reads this reply
                return
            if task.cancelled():
                reply.set_exception(TransportClosed(f"peer {self._peer_id} closed the link"))
            elif (exc := task.exception()) is not None:
                reply.set_exception(exc)
            else:
                reply.set_result(task.result())

        task.add_done_callback(done)

    async def _run_handler(self, caller: str, method: str, request: Message) -> Message:
        latency = self._network.latency
        if latency:
            await asyncio.sleep(latency)
        handler = self._unary.get(method)
        if handler is None:
            raise UnknownMethod("UnknownMethod", f"no handler for {method!r}")
        try:
            response = await handler(RequestContext(caller, "memory"), request)
        except (RemoteError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise RemoteError(type(exc).__name__, str(exc)) from None
        if not isinstance(response, Message):
            raise RemoteError("BadReply", f"handler for {method!r} returned {type(response).__name__}")
        if latency:
            await asyncio.sleep(latency)
        return response

    def _copy(self, message: Message) -> Message:
        payload = bytes(message.payload)
        header = orjson.loads(orjson.dumps(message.header))
        if len(payload) + len(orjson.dumps(header)) > self._network.max_message_bytes:
            raise LimitExceeded(f"message over {self._network.max_message_bytes} bytes")
        return Message(header, payload)

    async def open_stream(self, peer_id: str, method: str, header: dict[str, Any], *,
                          timeout: float) -> Stream:
        raise TransportError("streams not supported by MemoryTransport")

    def links(self) -> list[LinkInfo]:
        return [LinkInfo(peer_id, None, "memory", True, None, 0, 0, 0, opened)
                for peer_id, opened in self._links.items()]

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("the transport is closed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._network._detach(self)
        for reply in list(self._pending):
            if not reply.done():
                reply.set_exception(TransportClosed("the transport was closed"))
        tasks = list(self._handler_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
