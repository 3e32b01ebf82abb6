"""Helpers shared by the transport tests (import as `net.netutil`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from dedloc.daemon.net import LinkLimits, PeerAddress, TransportLimits

LOOPBACK = PeerAddress.parse("/ip4/127.0.0.1/tcp/0")
FAST = TransportLimits(handshake_timeout=1.0, link=LinkLimits(ping_interval=2.0))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll a condition (state, not time: the deadline only bounds a broken test)."""
    async with asyncio.timeout(timeout):
        for _ in itertools.count():
            if predicate():
                return
            await asyncio.sleep(0.01)
