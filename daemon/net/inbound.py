"""The memory that inbound messages take: their buffers, and the budget that bounds them.

A message is announced by its first frame (the total payload length, "n"), and its buffer is
allocated then. The bytes still to come of messages under way count with those received and not
yet consumed against the link's `max_pending_bytes`, and against the daemon's `InboundBudget` for
all its links together; past either, the link is closed (LimitExceeded). A large buffer takes
pages only as its bytes come (`inbound_buffer`). A message that stops arriving, or trickles at
under MIN_MESSAGE_RATE, ends its link (`Assembly.stalled`, checked by the link's keepalive).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any

from .. import timebase
from .errors import LimitExceeded, ProtocolViolation
from .frames import F_MORE

if TYPE_CHECKING:
    from .link import Link

MIN_MESSAGE_RATE = 1024  # bytes/s: an inbound message slower than this (past the stall timeout) ends its link
LAZY_BUFFER_BYTES = 1024 * 1024  # an inbound message this large gets pages only as its bytes come


class InboundBudget:
    """The bytes of inbound messages under way, for all the links of one daemon together: the
    per-link bound alone let a few dozen free identities each announce 256 MiB. A link checks
    what all links are owed (announced, not yet received) plus what it is announced now against
    `limit` before it allocates."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # (a dict, not a set: the same order in every simulated run, where ties are broken)
        self.links: dict[Link, None] = {}
        self.refused = 0
        # An upper bound of `due()`: its last exact sum plus every reservation since (what links
        # owe only shrinks between reservations). Summing over every link for each message
        # made a daemon with hundreds of links spend most of its time here.
        self._bound = 0

    def due(self) -> int:
        self._bound = sum(link._due() for link in self.links if not link.closed)
        return self._bound

    def admits(self, total: int) -> bool:
        """Whether `total` more bytes fit: exact only when the cheap bound says they might not."""
        if self._bound + total <= self.limit:
            self._bound += total
            return True
        if self.due() + total <= self.limit:
            self._bound += total
            return True
        return False

    def evict_hog(self, asking: Link, wanted: int) -> bool:
        """The budget is full: close the link that owes the most, if it owes more than `asking`
        would with `wanted` more (an honest peer's small message must not lose its link to an
        attacker's announced gigabytes). True if one was closed."""
        open_links = [link for link in self.links if not link.closed]
        if not open_links:
            return False
        hog = max(open_links, key=lambda link: link._due())
        if hog is asking or hog._due() <= asking._due() + wanted:
            return False
        hog._counters["inbound_budget_evictions"] = hog._counters.get("inbound_budget_evictions", 0) + 1
        hog.begin_close("LimitExceeded: owes the most of this daemon's inbound budget")
        return True


def inbound_buffer(total: int) -> memoryview:
    """A buffer for an inbound message of `total` bytes. A large one is an anonymous mapping,
    whose pages the kernel provides as the message's bytes are written into them: a peer that
    announces 256 MiB and sends a few bytes costs this machine a few pages, not 256 MiB (what it
    announced still counts in full against the link's and the daemon's budgets). A bytearray is
    zeroed, every page touched, at once."""
    if total >= LAZY_BUFFER_BYTES:
        return memoryview(mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE))  # (shared by no child)
    return memoryview(bytearray(total)) if total else memoryview(b"")


class Assembly:
    """An inbound message being received: its buffer fills frame by frame."""

    __slots__ = ("buffer", "filled", "header", "owned", "started", "total", "touched")

    def __init__(self, header: dict[str, Any], total: int, buffer: memoryview | None, owned: bool) -> None:
        self.header = header
        self.total = total
        self.buffer = buffer  # None: discard
        self.filled = 0
        self.owned = owned  # False: the application's buffer (receive_into)
        self.touched = self.started = timebase.monotonic()  # when its first, last bytes came

    def stalled(self, now: float, timeout: float) -> bool:
        """Begun and then no more bytes for `timeout`, or trickling at under MIN_MESSAGE_RATE (a
        byte now and then kept its buffer taken)."""
        return self.filled < self.total and (now - self.touched > timeout or (
            now - self.started > timeout and self.filled < (now - self.started) * MIN_MESSAGE_RATE))


def message_total(header: dict[str, Any], length: int, flags: int, limit: int) -> int:
    """The total payload length a message's first frame announces, checked (a frame of `length`
    payload bytes, `flags`; `limit`: the largest message allowed)."""
    total = header.get("n", length)
    if not isinstance(total, int) or isinstance(total, bool) or total < length:
        raise ProtocolViolation("message header has a bad total length")
    if not flags & F_MORE and total != length:
        raise ProtocolViolation("single-frame message with a total length that differs")
    if total > limit:
        raise LimitExceeded(f"peer sent a message of {total} bytes, over the limit of {limit}")
    header_field = header.get("h", {})
    if not isinstance(header_field, dict):
        raise ProtocolViolation("message header 'h' is not an object")
    return total
