"""Memory for inbound messages under way. A peer's first frame announces a message and the
receiver allocates it: the bound used to be per link only (256 MiB each, and identities are
free), and a message left half-sent held its buffer for as long as the peer answered pings.
Now all the links of a daemon share one budget (`InboundBudget`, TransportLimits.max_inbound_bytes)
and a message that stops arriving part-way closes its link after `message_stall_timeout`. A large
message's buffer takes memory only as its bytes arrive (`inbound_buffer`). Links over in-memory
pipes, on virtual time."""

from __future__ import annotations

import asyncio
import os

import pytest
from fuzz.fuzzutil import to_json
from fuzz.peerwire import frame_bytes
from fuzz.test_link_fuzz import PEER_IDS, FuzzPipe

from dedloc.daemon.net import LinkLimits
from dedloc.daemon.net.frames import F_MORE, FrameType
from dedloc.daemon.net.inbound import LAZY_BUFFER_BYTES, InboundBudget, inbound_buffer
from dedloc.daemon.net.link import Dispatcher, Link

pytestmark = pytest.mark.virtual_time
MESSAGE = 16384
LIMITS = LinkLimits(max_payload=4096, chunk_bytes=1024, max_message_bytes=MESSAGE,
                    max_pending_bytes=4 * MESSAGE, ping_interval=10.0, ping_timeout=7200.0,
                    message_stall_timeout=60.0)


def _link(pipe: FuzzPipe, counters: dict[str, int], budget: InboundBudget | None,
          peer: int = 1) -> Link:
    link = Link(pipe, peer_id=PEER_IDS[peer], peer_addresses=(), outbound=True, address=None,
                limits=LIMITS, dispatcher=Dispatcher(), on_closed=lambda _: None, counters=counters,
                budget=budget)
    link.start()
    return link


def _announce(sid: int) -> bytes:
    """The first frame of a request announcing MESSAGE bytes, carrying one of them."""
    return frame_bytes(FrameType.REQUEST, F_MORE, sid, to_json({"m": "echo", "n": MESSAGE, "h": {}}),
                       b"x")


async def test_links_share_one_budget_for_messages_under_way() -> None:
    budget = InboundBudget(limit=3 * MESSAGE)  # less than one link alone may be owed (4)
    counters: dict[str, int] = {}
    pipes = [FuzzPipe() for _ in range(4)]
    links = [_link(pipe, counters, budget, peer=i % 2 + 1) for i, pipe in enumerate(pipes)]
    for pipe in pipes[:3]:  # three identities, one big message each: within the budget
        pipe.feed(_announce(2))
    await asyncio.sleep(0.1)
    assert not any(link.closed for link in links[:3])
    assert 3 * (MESSAGE - 1) <= budget.due() <= 3 * MESSAGE
    pipes[3].feed(_announce(2))  # a fourth: past what the daemon takes in all
    await asyncio.wait_for(links[3].wait_closed(), timeout=600)
    assert links[3].close_reason.startswith("LimitExceeded")
    assert budget.refused == 1
    await links[0].close()  # a closed link's debts go with it
    assert 2 * (MESSAGE - 1) <= budget.due() <= 2 * MESSAGE
    for link in links[1:3]:
        await link.close()


async def test_a_message_left_half_sent_closes_its_link() -> None:
    counters: dict[str, int] = {}
    pipe = FuzzPipe()
    link = _link(pipe, counters, None)
    pipe.feed(_announce(2))  # 1 byte of 16384, then silence (the link's pings are answered)
    await asyncio.wait_for(link.wait_closed(), timeout=LIMITS.message_stall_timeout + 600)
    assert "stalled" in link.close_reason, link.close_reason
    assert counters["messages_stalled"] == 1


async def test_the_link_that_owes_the_most_makes_way_for_a_small_honest_message() -> None:
    budget = InboundBudget(limit=3 * MESSAGE)
    counters: dict[str, int] = {}
    hog_pipe, honest_pipe = FuzzPipe(), FuzzPipe()
    hog = _link(hog_pipe, counters, budget, peer=1)
    honest = _link(honest_pipe, counters, budget, peer=2)
    hog_pipe.feed(b"".join(_announce(sid) for sid in (2, 4, 6)))  # the whole budget, never sent
    await asyncio.sleep(0.1)
    assert not hog.closed and budget.due() >= 3 * (MESSAGE - 1)
    small = frame_bytes(FrameType.REQUEST, F_MORE, 2, to_json({"m": "echo", "n": 100, "h": {}}), b"x")
    honest_pipe.feed(small)  # an honest peer's small message: the hog goes, not the honest link
    await asyncio.wait_for(hog.wait_closed(), timeout=600)
    assert not honest.closed
    assert counters["inbound_budget_evictions"] == 1
    await honest.close()


async def test_pings_do_not_cost_a_link_a_large_scratch_buffer() -> None:
    # a daemon of hundreds of links: every link's first ping allocated 64 KiB to discard 8 bytes
    pipe = FuzzPipe()
    link = _link(pipe, {}, None)
    pipe.feed(frame_bytes(FrameType.PING, 0, 0, b"", b"12345678"))
    await asyncio.sleep(0.1)
    assert not link.closed
    assert len(link._scratch) <= 64
    await link.close()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_an_announced_message_costs_memory_only_as_its_bytes_come() -> None:
    # a peer's first frame announces 256 MiB and carries one byte: the receiver used to zero a
    # 256 MiB bytearray at once (identities are free: a few of them took a machine's memory)
    big = 256 * 1024 * 1024
    limits = LinkLimits(max_payload=4096, chunk_bytes=1024, max_message_bytes=big,
                        max_pending_bytes=big, ping_interval=10.0, ping_timeout=7200.0,
                        message_stall_timeout=60.0)
    pipe = FuzzPipe()
    link = Link(pipe, peer_id=PEER_IDS[1], peer_addresses=(), outbound=True, address=None,
                limits=limits, dispatcher=Dispatcher(), on_closed=lambda _: None, counters={})
    link.start()
    before = _resident_bytes()
    pipe.feed(frame_bytes(FrameType.REQUEST, F_MORE, 2, to_json({"m": "echo", "n": big, "h": {}}),
                          b"x" * 4096))
    await asyncio.sleep(0.1)
    assert not link.closed
    assert link._due() == big  # it still counts in full against the budgets
    grown = _resident_bytes() - before
    assert grown < 64 * 1024 * 1024, f"the receiver took {grown >> 20} MiB for 4 KiB received"
    await link.close()


def test_a_lazy_buffer_holds_what_is_written_into_it() -> None:
    small, large = inbound_buffer(100), inbound_buffer(LAZY_BUFFER_BYTES + 5)
    assert len(small) == 100 and len(large) == LAZY_BUFFER_BYTES + 5
    pattern = bytes(range(256)) * 8
    for buffer in (small, large):
        buffer[: min(len(buffer), len(pattern))] = pattern[: len(buffer)]
        assert bytes(buffer[:100]) == pattern[:100]
        assert not any(bytes(buffer[len(pattern):]))  # the rest reads as zeros, like a bytearray
    assert len(inbound_buffer(0)) == 0
