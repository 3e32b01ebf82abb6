"""The link's frame codec: pure, no I/O.

A frame on the wire is a 12-byte prefix, then `header_len` bytes of orjson header (a JSON object;
length 0 means the empty object), then `payload_len` raw payload bytes:

    offset  size  field
    0       1     type          (FrameType)
    1       1     flags         (F_MORE: more frames of this message follow;
                                 F_CONT: this frame continues a message and has no header)
    2       4     stream id     (0: the link itself; odd: opened by the dialer; even: by the listener)
    6       2     header length (at most `max_header`, <= 65535)
    8       4     payload length (at most `max_payload`)

all big-endian (`struct` format `!BBIHI`). A message (a request, a reply, one stream message) whose
payload is bigger than one chunk is sent as a first frame (header + first chunk, F_MORE) and
continuation frames (F_CONT, F_MORE on all but the last); the first frame's header says the total
payload length in "n", so the receiver can place every chunk straight into one buffer.

`FrameDecoder` is incremental and tells the reader where the next bytes must go
(`next_target()`), so that payloads are received straight into their destination buffer (the
`allocate` callback chooses it); `feed()` is the convenience form for bytes already in hand.
Anything malformed raises `ProtocolViolation`; nothing is buffered beyond one prefix, one header
and one payload.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import orjson

from .errors import ProtocolViolation

PREFIX = struct.Struct("!BBIHI")
PREFIX_SIZE = PREFIX.size
MAX_HEADER = 64 * 1024 - 1
DEFAULT_MAX_PAYLOAD = 16 * 1024 * 1024

F_MORE = 0x01
F_CONT = 0x02
_KNOWN_FLAGS = F_MORE | F_CONT
_EMPTY = memoryview(b"")


class FrameType(IntEnum):
    HELLO = 1      # handshake (only before the link is up)
    REQUEST = 2    # unary request {"m": method, "h": header, "n": total, "d": deadline ms}
    RESPONSE = 3   # unary reply {"h": header, "n": total}
    ERROR = 4      # a call or stream open failed {"k": kind, "e": message}
    CANCEL = 5     # the caller gave up on a unary call
    OPEN = 6       # open a stream {"m": method, "h": header, "w": receive window}
    ACCEPT = 7     # the stream is served {"w": receive window}
    DATA = 8       # one stream message {"h": header, "n": total}
    CLOSE = 9      # the sender's side of the stream is done
    ABORT = 10     # the stream is torn down {"e": reason}
    CREDIT = 11    # flow control: the receiver consumed {"c": bytes}
    PING = 12      # keepalive; payload echoed in PONG
    PONG = 13
    GOAWAY = 14    # no new calls on this link {"e": reason}


_TYPES = frozenset(int(t) for t in FrameType)


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    stream_id: int
    header: dict[str, Any]
    payload: bytes | bytearray | memoryview = b""
    flags: int = 0


def encode_header(header: dict[str, Any] | None) -> bytes:
    """A frame header's bytes: TypeError if it is not JSON-able (orjson stops at 255 levels of
    nesting, and a peer may send 1000), ValueError if it is over MAX_HEADER."""
    header_bytes = orjson.dumps(header) if header else b""
    if len(header_bytes) > MAX_HEADER:
        raise ValueError(f"frame header of {len(header_bytes)} bytes is over {MAX_HEADER}")
    return header_bytes


def encode_head(ftype: int, stream_id: int, header: dict[str, Any] | bytes | None, payload_len: int,
                flags: int = 0) -> bytes:
    """Prefix + header bytes of a frame whose payload (sent separately) is `payload_len` long.
    `header` may be already encoded (`encode_header`)."""
    header_bytes = header if isinstance(header, bytes) else encode_header(header)
    return PREFIX.pack(ftype, flags, stream_id, len(header_bytes), payload_len) + header_bytes


def encode(frame: Frame) -> bytes:
    """The whole frame as bytes (for small frames and tests)."""
    payload = bytes(frame.payload)
    return encode_head(frame.type, frame.stream_id, frame.header, len(payload), frame.flags) + payload


# allocate(type, flags, stream id, header, payload length) -> a writable buffer of exactly that length
Allocator = Callable[[FrameType, int, int, dict[str, Any], int], memoryview]


def _default_allocate(_t: FrameType, _f: int, _s: int, _h: dict[str, Any], length: int) -> memoryview:
    return memoryview(bytearray(length))


_PREFIX_STAGE, _HEADER_STAGE, _PAYLOAD_STAGE = 0, 1, 2


class FrameDecoder:
    """Bytes in, frames out, with hard limits. Use `next_target()`/`advance()` to receive in place
    or `feed()` for bytes in hand."""

    def __init__(self, *, max_header: int = MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 allocate: Allocator | None = None) -> None:
        if not 0 <= max_header <= MAX_HEADER:
            raise ValueError(f"max_header must be within 0..{MAX_HEADER}")
        self.max_header = max_header
        self.max_payload = max_payload
        self._allocate = allocate or _default_allocate
        self._prefix = bytearray(PREFIX_SIZE)
        self._header_buf = bytearray()
        self._stage = _PREFIX_STAGE
        self._filled = 0
        self._target: memoryview = memoryview(self._prefix)
        self._type = FrameType.PING
        self._flags = 0
        self._stream_id = 0
        self._header_len = 0
        self._payload_len = 0
        self._header: dict[str, Any] = {}

    def next_target(self) -> memoryview:
        """Where the next bytes go (never empty): write into it, then call `advance(n)`."""
        return self._target[self._filled:]

    def buffered_bytes(self) -> int:
        """How much memory this decoder holds (for the memory bound)."""
        return PREFIX_SIZE + len(self._header_buf) + (len(self._target) if self._stage == 2 else 0)

    def advance(self, count: int) -> Frame | None:
        """`count` bytes were written at the start of `next_target()`; a frame if one is complete."""
        self._filled += count
        if self._filled < len(self._target):
            return None
        if self._stage == _PREFIX_STAGE:
            return self._prefix_done()
        if self._stage == _HEADER_STAGE:
            return self._header_done()
        return self._payload_done()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        view = memoryview(data).cast("B")
        frames: list[Frame] = []
        while view:
            target = self.next_target()
            count = min(len(target), len(view))
            target[:count] = view[:count]
            view = view[count:]
            frame = self.advance(count)
            if frame is not None:
                frames.append(frame)
        return frames

    def _prefix_done(self) -> Frame | None:
        ftype, flags, stream_id, header_len, payload_len = PREFIX.unpack(self._prefix)
        if ftype not in _TYPES:
            raise ProtocolViolation(f"unknown frame type {ftype}")
        if flags & ~_KNOWN_FLAGS:
            raise ProtocolViolation(f"unknown frame flags {flags:#x}")
        if header_len > self.max_header:
            raise ProtocolViolation(f"frame header of {header_len} bytes is over the limit {self.max_header}")
        if payload_len > self.max_payload:
            raise ProtocolViolation(
                f"frame payload of {payload_len} bytes is over the limit {self.max_payload}")
        if flags & F_CONT and header_len:
            raise ProtocolViolation("a continuation frame carries a header")
        self._type = FrameType(ftype)
        self._flags = flags
        self._stream_id = stream_id
        self._header_len = header_len
        self._payload_len = payload_len
        if header_len:
            self._header_buf = bytearray(header_len)
            self._stage = _HEADER_STAGE
            self._filled = 0
            self._target = memoryview(self._header_buf)
            return None
        self._header = {}
        return self._start_payload()

    def _header_done(self) -> Frame | None:
        try:
            header = orjson.loads(self._header_buf)
        except orjson.JSONDecodeError as exc:
            raise ProtocolViolation(f"frame header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ProtocolViolation(f"frame header is a JSON {type(header).__name__}, not an object")
        self._header_buf = bytearray()
        self._header = header
        return self._start_payload()

    def _start_payload(self) -> Frame | None:
        if not self._payload_len:
            return self._emit(_EMPTY)
        target = self._allocate(self._type, self._flags, self._stream_id, self._header, self._payload_len)
        if len(target) != self._payload_len:
            raise ValueError("allocate returned a buffer of the wrong length")
        self._stage = _PAYLOAD_STAGE
        self._filled = 0
        self._target = target
        return None

    def _payload_done(self) -> Frame:
        return self._emit(self._target)

    def _emit(self, payload: memoryview) -> Frame:
        frame = Frame(self._type, self._stream_id, self._header, payload, self._flags)
        self._stage = _PREFIX_STAGE
        self._filled = 0
        self._target = memoryview(self._prefix)
        self._header = {}
        return frame
