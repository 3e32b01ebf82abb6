"""A link's reading side: frames from its socket, their payloads received in place.

The frame decoder says where the next bytes must go (frames.py); a read for a payload of
_DIRECT_MIN bytes or more goes straight into the message's buffer (or the application's, with
`receive_into`), smaller reads go through a stage that starts small (a link that only carries
calls stays small) and grows while reads fill it (bulk traffic).

Bandwidth caps (ratelimit.py, optional): each read books on the daemon's download bucket and the
next read waits for it.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import TransportClosed
from .frames import Frame, FrameDecoder
from .pipes import Pipe
from .ratelimit import Bandwidth
from .sockio import SocketIO

_STAGE_BYTES = 256 * 1024  # the read stage grows to this when reads fill it (bulk traffic)
_STAGE_START = 16 * 1024  # ... from this: a link that only carries calls stays small
_DIRECT_MIN = 64 * 1024


async def read_frames(io: SocketIO | Pipe, decoder: FrameDecoder, bandwidth: Bandwidth | None,
                      heard: Callable[[int], None], on_frame: Callable[[Frame], None]) -> None:
    """Read `io` until the peer closes it (TransportClosed), handing each frame to `on_frame`;
    `heard(count)` after each read of `count` bytes."""
    view = memoryview(bytearray(_STAGE_START))
    start = end = 0
    owed = 0  # bytes of the last read, booked on the download cap before the next read
    while True:
        target = decoder.next_target()
        if end > start:
            count = min(len(target), end - start)
            target[:count] = view[start:start + count]
            start += count
        else:
            read_limit: int | None = None
            if bandwidth is not None and bandwidth.down.rate > 0:
                await bandwidth.pay_down(owed)
                read_limit = bandwidth.quantum("down")
            if len(target) >= _DIRECT_MIN:
                count = owed = await io.recv_into(target[:read_limit])
                if not count:
                    raise TransportClosed("the peer closed the connection")
                heard(count)
            else:
                start, end = 0, await io.recv_into(view[:read_limit])
                if not end:
                    raise TransportClosed("the peer closed the connection")
                if end == len(view) < _STAGE_BYTES:  # full: more is coming, read bigger
                    grown = memoryview(bytearray(min(2 * len(view), _STAGE_BYTES)))
                    grown[:end] = view[:end]
                    view = grown
                owed = end
                heard(end)
                continue
        frame = decoder.advance(count)
        if frame is not None:
            on_frame(frame)
