"""`WaitingStreamFlood`: `avg.part` streams for rounds that never start, from many free identities,
to take every waiting slot of daemons' all-reduce services (hostile.py's `waiting_flood` attack;
docs/security.md, "`avg.part` waiting slots").

Each of its `peers` identities is a peer transport of this process (a fresh Ed25519 key, a real
TLS link to each target). Every identity keeps `per_peer` streams open to every target, each
announcing a round of a group id nobody forms, and opens another as soon as the daemon drops one
(its wait for the round ran out, it was refused, or its slot went to another sender's stream),
so that the slots a daemon frees are taken again at once. Only loopback targets: the benchmark
never sends traffic elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from connection_flood import cancel_all  # one copy of a flood's shutdown

from dedloc.daemon.averaging.wire import METHOD, StreamOpen, says_not_started
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    PeerAddress,
    StreamAborted,
    TlsTransport,
    TransportError,
    TransportLimits,
)

HOLD_SECONDS = 60.0  # the most one stream waits to be dropped (a daemon's arrival grace: 5 s)
PAUSE_SECONDS = 0.05  # before opening again (a refusal comes back at once)
CALL_TIMEOUT = 10.0


class WaitingStreamFlood:
    def __init__(self, peers: int, per_peer: int = 8) -> None:
        if peers < 1 or per_peer < 1:
            raise ValueError("a flood needs an identity and at least one stream per identity")
        self.peers = peers
        self.per_peer = per_peer
        # opened; taken_over (its slot went to another sender), refused_full (every slot held),
        # refused_per_peer, timed_out (no round came), other_aborts, failed (could not open)
        self.counters: Counter[str] = Counter()
        self._transports: list[TlsTransport] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> None:
        """Make the identities' transports (they listen on 127.0.0.1 only)."""
        loopback = PeerAddress.parse("/ip4/127.0.0.1/tcp/0")
        for _ in range(self.peers):
            self._transports.append(await TlsTransport.start(Identity.generate(), [loopback],
                                                             limits=TransportLimits()))

    def target(self, p2p_address: str) -> None:
        """Start holding `per_peer` streams from every identity to the daemon at `p2p_address`
        (/ip4/127.0.0.1/tcp/PORT/p2p/ID)."""
        address = PeerAddress.parse(p2p_address)
        if address.host != "127.0.0.1":
            raise ValueError(f"loopback targets only, not {p2p_address}")
        peer_id = address.peer_id
        if peer_id is None:
            raise ValueError(f"the target's address names no peer id: {p2p_address}")
        for transport in self._transports:
            transport.learn_addresses(peer_id, [address])
            for _ in range(self.per_peer):
                task = asyncio.create_task(self._hold(transport, peer_id), name="stream-flood")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _hold(self, transport: TlsTransport, peer_id: str) -> None:
        while not self._closed:
            header = StreamOpen(f"never-{secrets.token_hex(8)}", 0, 1.0,
                                time.time() + HOLD_SECONDS).header()
            try:
                stream = await transport.open_stream(peer_id, METHOD, header, timeout=CALL_TIMEOUT)
            except (OSError, TimeoutError, TransportError) as exc:  # (a refused handshake too)
                self.counters["failed"] += 1
                self.counters[f"failed_{type(exc).__name__}"] += 1
                await asyncio.sleep(1.0)
                continue
            self.counters["opened"] += 1
            try:
                await stream.receive(timeout=HOLD_SECONDS)
                self.counters["other_aborts"] += 1  # (a daemon never answers such a stream)
            except StreamAborted as exc:
                self.counters[_outcome(exc)] += 1
            except TimeoutError:
                self.counters["held_out"] += 1
            except (OSError, TransportError):  # (the link closed under it)
                self.counters["other_aborts"] += 1
            finally:
                with contextlib.suppress(Exception):
                    await stream.abort("flood")
            await asyncio.sleep(PAUSE_SECONDS)

    async def close(self) -> None:
        self._closed = True
        await cancel_all(self._tasks)
        for transport in self._transports:
            with contextlib.suppress(Exception):
                await transport.close()


def _outcome(exc: StreamAborted) -> str:
    text = str(exc)
    if says_not_started(exc):
        if "went to another peer" in text:
            return "taken_over"
        if "already has" in text:
            return "refused_per_peer"
        return "refused_full"
    if "no round of group" in text:
        return "timed_out"
    return "other_aborts"
