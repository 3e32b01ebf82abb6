"""`ConnectionFlood`: silent TCP connections that try to hold every handshake slot of daemons'
peer ports (hostile.py's `handshake_flood` attack; docs/security.md, "Handshake slots").

From each of its source addresses (127.0.0.2, 127.0.0.3, ...: every 127/8 address is this host's
loopback) it keeps `per_source` connections to every target port open without ever sending a
byte, and opens a new one as soon as the daemon drops one (its handshake timed out, it was taken
over by another source's connection, or it was refused), so that the slots the daemon frees are
taken again at once. Only loopback targets: the benchmark never sends traffic elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections import Counter
from collections.abc import Sequence

HOLD_SECONDS = 60.0  # the most one connection waits to be dropped (a daemon's handshake timeout: 10 s)
PAUSE_SECONDS = 0.05  # before connecting again (a refusal comes back at once)


def flood_sources(count: int) -> list[str]:
    """`count` loopback source addresses other than 127.0.0.1 (the honest peers' own)."""
    if not 1 <= count <= 250:
        raise ValueError(f"from 1 to 250 source addresses, not {count}")
    return [f"127.0.0.{2 + i}" for i in range(count)]


class ConnectionFlood:
    def __init__(self, sources: Sequence[str], per_source: int = 16) -> None:
        if not sources or per_source < 1:
            raise ValueError("a flood needs a source address and at least one connection per source")
        self.sources = list(sources)
        self.per_source = per_source
        # opened, dropped, held_out (never dropped), failed (could not connect), local_errors
        # (this process out of files or ports: the flood is weaker than it says)
        self.counters: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def target(self, port: int) -> None:
        """Start holding `per_source` connections from every source to 127.0.0.1:`port`."""
        for source in self.sources:
            for _ in range(self.per_source):
                task = asyncio.create_task(self._hold(source, port), name="flood")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _hold(self, source: str, port: int) -> None:
        while not self._closed:
            try:
                # (asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
                # cancellation that comes as the connection opens, and close() then waited
                # for ever on a task that went on)
                async with asyncio.timeout(10.0):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                                   local_addr=(source, 0))
            except TimeoutError:
                self.counters["failed"] += 1
                continue
            except OSError as exc:  # refused by the daemon, or out of files or ports here
                local = exc.errno in (errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL)
                self.counters["local_errors" if local else "failed"] += 1
                await asyncio.sleep(1.0)
                continue
            self.counters["opened"] += 1
            try:
                async with asyncio.timeout(HOLD_SECONDS):
                    await self._until_dropped(reader)
                self.counters["dropped"] += 1
            except TimeoutError:
                self.counters["held_out"] += 1  # never dropped: let go, open another
            finally:
                writer.close()
            await asyncio.sleep(PAUSE_SECONDS)

    async def _until_dropped(self, reader: asyncio.StreamReader) -> None:
        """Until the daemon closes or resets the connection. A TLS server says nothing before
        the client's hello, so whatever it does send is counted (`unexpected_bytes`)."""
        with contextlib.suppress(OSError):  # (a reset, ConnectionError among them, is a drop)
            while chunk := await reader.read(4096):
                self.counters["unexpected_bytes"] += len(chunk)

    async def close(self) -> None:
        self._closed = True
        await cancel_all(self._tasks)


async def cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel a flood's tasks and wait for them (bounded: a task that went on anyway ends at its
    next turn of the loop)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=30.0)
