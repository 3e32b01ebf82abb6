"""Relay slots for a node that nobody can dial: keep `wanted` reservations on reachable peers.

Candidates are peers this node dialed directly (so they are reachable), bootstrap peers first.
A reservation is renewed at half its lifetime; a relay whose link went down, or that refused, is
dropped and another candidate is tried; refusals are remembered for a while so that a full or
non-relaying peer is not asked again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from .. import timebase
from .addresses import PeerAddress
from .errors import TransportError
from .relay import RelayClient
from .transport import LinkEvent, TlsTransport

log = structlog.get_logger(__name__)

CHECK_SECONDS = 5.0
RETRY_REFUSED_SECONDS = 120.0


class RelayReservations:
    def __init__(self, transport: TlsTransport, client: RelayClient, wanted: int,
                 preferred: Callable[[], list[PeerAddress]]) -> None:
        self._transport = transport
        self._client = client
        self._wanted = wanted
        self._preferred = preferred
        self._renew_at: dict[str, float] = {}
        self._refused: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        transport.add_link_listener(self._on_link)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="relay-reservations")

    async def close(self) -> None:
        self._transport.remove_link_listener(self._on_link)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _on_link(self, event: LinkEvent) -> None:
        if event.kind == "down" and event.peer_id in self._client.relays:
            self._client.forget(event.peer_id)
            self._renew_at.pop(event.peer_id, None)
            log.info("relay_lost", relay=event.peer_id[:12])
        self._wake.set()

    def _candidates(self) -> list[PeerAddress]:
        now = timebase.monotonic()
        found: dict[str, PeerAddress] = {}
        for address in self._preferred():
            if address.peer_id is not None and address.circuit is None:
                found.setdefault(address.peer_id, address)
        for info in self._transport.links():
            if info.outbound and info.kind == "tcp" and info.address and info.peer_id not in found:
                with contextlib.suppress(ValueError):
                    found[info.peer_id] = PeerAddress.parse(info.address).with_peer(info.peer_id)
        recently_refused = {pid for pid, at in self._refused.items() if now - at < RETRY_REFUSED_SECONDS}
        return [a for pid, a in found.items() if pid not in set(self._client.relays) | recently_refused]

    async def _run(self) -> None:
        while True:
            now = timebase.monotonic()
            for relay_id, at in list(self._renew_at.items()):
                if at <= now and relay_id in self._client.relays:
                    await self._reserve(self._client.relays[relay_id])
            for address in self._candidates():
                if len(self._client.relays) >= self._wanted:
                    break
                await self._reserve(address)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # (not wait_for: 3.11's can swallow a cancel)
                async with asyncio.timeout(CHECK_SECONDS):
                    await self._wake.wait()

    async def _reserve(self, address: PeerAddress) -> None:
        assert address.peer_id is not None
        try:
            seconds = await self._client.reserve(address)
        except (TransportError, TimeoutError) as exc:
            self._refused[address.peer_id] = timebase.monotonic()
            self._client.forget(address.peer_id)
            self._renew_at.pop(address.peer_id, None)
            log.info("relay_reservation_failed", relay=address.peer_id[:12], error=str(exc))
            return
        self._renew_at[address.peer_id] = timebase.monotonic() + max(1.0, seconds / 2)
        log.info("relay_reserved", relay=address.peer_id[:12], seconds=seconds)
