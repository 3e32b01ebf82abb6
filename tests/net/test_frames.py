"""The frame codec: round trips, limits and arbitrary input (hypothesis)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc.daemon.net import ProtocolViolation
from dedloc.daemon.net.frames import (
    F_CONT,
    F_MORE,
    PREFIX,
    PREFIX_SIZE,
    Frame,
    FrameDecoder,
    FrameType,
    encode,
    encode_head,
)

MAX_HEADER = 1024
MAX_PAYLOAD = 4096

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                      max_size=4),
    max_leaves=10,
)
headers = st.dictionaries(st.text(max_size=10), json_values, max_size=5)
frames = st.builds(
    Frame,
    st.sampled_from(list(FrameType)),
    st.integers(0, 2**32 - 1),
    headers,
    st.binary(max_size=MAX_PAYLOAD),
    st.sampled_from([0, F_MORE]),
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[last:point])
        last = point
    return pieces


@given(st.lists(frames, max_size=5), st.lists(st.integers(0, 10**6), max_size=20))
@settings(max_examples=200, deadline=None)
def test_round_trip_in_any_chunking(sent: list[Frame], cuts: list[int]) -> None:
    data = b"".join(encode(frame) for frame in sent)
    decoder = FrameDecoder(max_header=65535, max_payload=MAX_PAYLOAD)
    received: list[Frame] = []
    for piece in chunked(data, cuts):
        received.extend(decoder.feed(piece))
    assert [(f.type, f.stream_id, f.header, bytes(f.payload), f.flags) for f in received] == \
           [(f.type, f.stream_id, f.header, bytes(f.payload), f.flags) for f in sent]


@given(st.binary(max_size=3000), st.lists(st.integers(0, 10**6), max_size=20))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_give_frames_or_violation(data: bytes, cuts: list[int]) -> None:
    decoder = FrameDecoder(max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    bound = PREFIX_SIZE + MAX_HEADER + MAX_PAYLOAD
    try:
        for piece in chunked(data, cuts):
            for frame in decoder.feed(piece):
                assert isinstance(frame.header, dict)
                assert len(frame.payload) <= MAX_PAYLOAD
            assert decoder.buffered_bytes() <= bound
    except ProtocolViolation:
        pass


@given(st.sampled_from(list(FrameType)), st.binary(min_size=1, max_size=200))
@settings(max_examples=200, deadline=None)
def test_prefix_with_random_header_bytes(ftype: FrameType, header: bytes) -> None:
    """A valid prefix followed by arbitrary header bytes: frame (if a JSON object) or violation."""
    data = PREFIX.pack(ftype, 0, 1, len(header), 0) + header
    try:
        (frame,) = FrameDecoder().feed(data)
    except ProtocolViolation:
        return
    assert isinstance(frame.header, dict)


@pytest.mark.parametrize(("data", "why"), [
    (PREFIX.pack(99, 0, 0, 0, 0), "unknown frame type"),
    (PREFIX.pack(FrameType.DATA, 0x80, 0, 0, 0), "unknown frame flags"),
    (PREFIX.pack(FrameType.DATA, 0, 0, MAX_HEADER + 1, 0), "header of"),
    (PREFIX.pack(FrameType.DATA, 0, 0, 0, MAX_PAYLOAD + 1), "payload of"),
    (PREFIX.pack(FrameType.DATA, F_CONT, 0, 2, 0) + b"{}", "continuation frame carries a header"),
    (PREFIX.pack(FrameType.DATA, 0, 0, 2, 0) + b"[]", "not an object"),
    (PREFIX.pack(FrameType.DATA, 0, 0, 3, 0) + b"{x}", "not JSON"),
    (PREFIX.pack(FrameType.DATA, 0, 0, 1, 0) + b"\xff", "not JSON"),
])
def test_malformed_prefixes_are_violations(data: bytes, why: str) -> None:
    decoder = FrameDecoder(max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    with pytest.raises(ProtocolViolation, match=why):
        decoder.feed(data)


def test_oversize_payload_is_refused_before_any_allocation() -> None:
    allocated: list[int] = []

    def allocate(*args: object) -> memoryview:
        allocated.append(1)
        return memoryview(bytearray(int(args[-1])))  # type: ignore[call-overload]

    decoder = FrameDecoder(max_payload=10, allocate=allocate)
    with pytest.raises(ProtocolViolation):
        decoder.feed(struct.pack("!BBIHI", FrameType.DATA, 0, 1, 0, 2**32 - 1))
    assert allocated == []


def test_payload_lands_in_the_allocated_buffer() -> None:
    destination = bytearray(10)

    def allocate(ftype: FrameType, flags: int, sid: int, header: dict[str, object],
                 length: int) -> memoryview:
        assert (ftype, sid, header, length) == (FrameType.DATA, 7, {"n": 5}, 5)
        return memoryview(destination)[2:7]

    decoder = FrameDecoder(allocate=allocate)
    data = encode_head(FrameType.DATA, 7, {"n": 5}, 5) + b"abcde"
    # receive in place: write into next_target() the way a socket's recv_into would
    frames = []
    for byte in data:
        target = decoder.next_target()
        target[0] = byte
        frame = decoder.advance(1)
        if frame is not None:
            frames.append(frame)
    assert len(frames) == 1
    assert destination == b"\0\0abcde\0\0\0"
