"""A peer that sends and never reads. Its PINGs (64 bytes at most) each queue a PONG: the queue of
control frames grew without bound while the writer waited on a socket the peer did not drain.
Now the control queue is bounded (`max_control_bytes`: past it the link closes), and a write the
peer takes nothing of for `write_stall_timeout` closes the link. Over an in-memory pipe, on
virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from fuzz.peerwire import frame_bytes
from fuzz.test_link_fuzz import PEER_IDS, FuzzPipe

from dedloc.daemon.net import LinkLimits
from dedloc.daemon.net.frames import FrameType
from dedloc.daemon.net.link import Dispatcher, Link

pytestmark = pytest.mark.virtual_time
LIMITS = LinkLimits(max_payload=65536, chunk_bytes=1024, ping_interval=3600.0, ping_timeout=7200.0,
                    max_control_bytes=256 * 1024, write_stall_timeout=60.0)


class UnreadPipe(FuzzPipe):
    """A peer that never reads: every write waits for ever."""

    async def send_all(self, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
        await asyncio.Event().wait()


def _link(pipe: FuzzPipe, counters: dict[str, int]) -> Link:
    link = Link(pipe, peer_id=PEER_IDS[1], peer_addresses=(), outbound=True, address=None,
                limits=LIMITS, dispatcher=Dispatcher(), on_closed=lambda _: None, counters=counters)
    link.start()
    return link


def _ping(payload: bytes) -> bytes:
    return frame_bytes(FrameType.PING, 0, 0, b"", payload)


async def test_a_peer_that_never_reads_is_cut_off_by_the_control_queue() -> None:
    pipe, counters = UnreadPipe(), {}
    link = _link(pipe, counters)
    for _ in range(5000):  # 5000 PONGs of 64 bytes and their heads: past 256 KiB
        pipe.feed(_ping(b"y" * 64))
    await asyncio.wait_for(link.wait_closed(), timeout=600)  # (virtual time: a safety net)
    assert counters.get("control_queue_overflows") == 1


async def test_a_write_the_peer_never_takes_ends_the_link() -> None:
    pipe, counters = UnreadPipe(), {}
    link = _link(pipe, counters)
    pipe.feed(_ping(b"z" * 8))  # one PONG to write, which the peer never takes
    await asyncio.wait_for(link.wait_closed(), timeout=LIMITS.write_stall_timeout + 600)
    assert counters.get("write_stalls") == 1
