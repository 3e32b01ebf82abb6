"""Better paths for peers reached through a relay, found in the background.

When the first link to a peer is a relayed one, the side with the smaller peer id tries, in
order, the paths that beat a relay: TCP hole punching (when a puncher is set and both sides can
guess their public TCP address) and then WebRTC (ICE with our own STUN servers and any configured
STUN/TURN servers). The signalling runs over the relayed link itself (a `path.*` stream). Each try
is bounded by its own deadline; the first that succeeds becomes a link of its kind, and the
transport keeps the best link per peer (`PATH_RANK`), so the relayed one drains away. Failures are
counted and retried after `retry_after` seconds while the relayed link lives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from .. import timebase
from .errors import HandshakeError, PeerUnreachableError, TransportClosed, TransportError
from .interface import Message, RequestContext, Stream
from .transport import LinkEvent, TlsTransport

log = structlog.get_logger(__name__)

WEBRTC = "path.webrtc"
WEBRTC_SECONDS = 8.0  # our own ICE deadline: aiortc's would be about a minute
RETRY_AFTER = 60.0

# An extra path to try before WebRTC: `await puncher(peer_id, stream_opener) -> bool` (True: a
# better link was made). Set by whoever implements TCP hole punching.
Puncher = Callable[[str], Awaitable[bool]]


class StreamSignaller:
    """Signalling messages (dicts) as the headers of a stream's messages."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    async def send(self, message: dict[str, Any]) -> None:
        await self._stream.send(Message({"s": message}), timeout=10)

    async def receive(self, timeout: float) -> dict[str, Any]:
        message = await self._stream.receive(timeout=timeout)
        if message is None or not isinstance(message.header.get("s"), dict):
            raise TransportClosed("the signalling stream ended")
        return dict(message.header["s"])


class PathUpgrader:
    def __init__(self, transport: TlsTransport, ice_servers: Callable[[], list[str]], *,
                 webrtc: bool = True, webrtc_seconds: float = WEBRTC_SECONDS,
                 retry_after: float = RETRY_AFTER) -> None:
        self._transport = transport
        self._ice_servers = ice_servers
        self._webrtc = webrtc
        self._webrtc_seconds = webrtc_seconds
        self._retry_after = retry_after
        self.puncher: Puncher | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._last_try: dict[str, float] = {}
        self.counters: dict[str, int] = {"upgrades_tried": 0, "upgrades_webrtc": 0,
                                         "upgrades_punched": 0, "upgrades_failed": 0}
        transport.add_link_listener(self._on_link)
        if webrtc:
            transport.add_stream_handler(WEBRTC, self._on_webrtc)

    def _on_link(self, event: LinkEvent) -> None:
        if event.kind == "up":
            self.consider(event.peer_id)

    def consider(self, peer_id: str) -> None:
        """Try to upgrade the link to `peer_id` if it is relayed and it is our turn to try."""
        transport = self._transport
        if transport.link_kind(peer_id) != "relay" or transport.peer_id > peer_id:
            return
        last = self._last_try.get(peer_id, -1e9)
        if peer_id in self._tasks or timebase.monotonic() - last < self._retry_after:
            return
        task = asyncio.get_running_loop().create_task(self._upgrade(peer_id), name="path-upgrade")
        self._tasks[peer_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(peer_id, None))

    async def _upgrade(self, peer_id: str) -> None:
        self._last_try[peer_id] = timebase.monotonic()
        self.counters["upgrades_tried"] += 1
        if self.puncher is not None:
            with contextlib.suppress(TransportError, TimeoutError):
                if await self.puncher(peer_id):
                    self.counters["upgrades_punched"] += 1
                    return
        if self._webrtc:
            try:
                await self._offer(peer_id)
                self.counters["upgrades_webrtc"] += 1
                return
            except (TransportError, TimeoutError) as exc:
                log.info("webrtc_upgrade_failed", peer=peer_id[:12], error=str(exc))
        self.counters["upgrades_failed"] += 1

    async def _offer(self, peer_id: str) -> None:
        from .webrtc import webrtc_connect  # aiortc and its codecs: loaded only when needed

        transport = self._transport
        stream = await transport.open_stream(peer_id, WEBRTC, {}, timeout=10)
        loop = asyncio.get_running_loop()
        try:
            done = await webrtc_connect(StreamSignaller(stream), transport.identity, offerer=True,
                                        ice_servers=self._ice_servers(),
                                        deadline=loop.time() + self._webrtc_seconds,
                                        addresses=transport.listen_addresses(),
                                        expected_peer_id=peer_id)
        finally:
            with contextlib.suppress(TransportError):
                await stream.close()
        transport.adopt(done, outbound=True, address=f"webrtc:{peer_id}")
        log.info("link_upgraded", peer=peer_id[:12], kind="webrtc")

    async def _on_webrtc(self, ctx: RequestContext, stream: Stream) -> None:
        from .webrtc import webrtc_connect

        transport = self._transport
        if ctx.link_kind != "relay":
            await stream.abort("this link needs no better path")
            return
        loop = asyncio.get_running_loop()
        try:
            done = await webrtc_connect(StreamSignaller(stream), transport.identity, offerer=False,
                                        ice_servers=self._ice_servers(),
                                        deadline=loop.time() + self._webrtc_seconds,
                                        addresses=transport.listen_addresses(),
                                        expected_peer_id=ctx.peer_id)
        except (PeerUnreachableError, HandshakeError, TransportError, TimeoutError) as exc:
            log.info("webrtc_answer_failed", peer=ctx.peer_id[:12], error=str(exc))
            return
        transport.adopt(done, outbound=False, address=f"webrtc:{ctx.peer_id}")
        log.info("link_upgraded", peer=ctx.peer_id[:12], kind="webrtc")

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
