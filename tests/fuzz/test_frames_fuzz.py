"""Fuzzing the peer wire below the link: the frame decoder and the handshake's hello parsing.

Properties: any byte string, cut anywhere, gives well-formed frames or a ProtocolViolation (never
another exception, never more buffered than one prefix, header and payload); a hello is a verified
PeerHello or a HandshakeError; the hello reader stops at the end of the hello.
"""

from __future__ import annotations

from typing import Any

import pytest
from fuzz.fuzzutil import PEER_IDS, fuzz_settings, headers, to_json, wire_values
from hypothesis import example, given
from hypothesis import strategies as st

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import HandshakeError, PeerIdMismatchError, ProtocolViolation
from dedloc.daemon.net.frames import (
    F_CONT,
    F_MORE,
    PREFIX,
    PREFIX_SIZE,
    Frame,
    FrameDecoder,
    FrameType,
)
from dedloc.daemon.net.handshake import HELLO_MAX_HEADER, _read_hello
from dedloc.daemon.net.tls import (
    client_hello,
    server_hello,
    verify_client_hello,
    verify_server_hello,
)

MAX_HEADER = 2048
MAX_PAYLOAD = 512

frame_types = st.one_of(st.sampled_from([int(t) for t in FrameType]), st.integers(0, 255))
frame_flags = st.one_of(st.sampled_from([0, F_MORE, F_CONT, F_MORE | F_CONT]), st.integers(0, 255))
header_bytes = st.one_of(
    st.just(b""),
    wire_values.map(to_json),  # any JSON: objects, arrays, scalars, deep nesting
    headers(["m", "h", "n", "d", "w", "c", "k", "e"]).map(to_json),
    st.binary(max_size=64),  # not JSON at all
    st.sampled_from([b"{", b'{"a":1}}', b"\xff\xfe", b'"\\ud800"', b"[" * 1100 + b"]" * 1100,
                     b'{"n": 1e999}', b'{"n": 18446744073709551616}', b"NaN", b"{} {}"]),
)


@st.composite
def raw_frames(draw: st.DrawFn) -> bytes:
    """A frame whose prefix fields are each plausible or not, and whose lengths may lie."""
    header = draw(header_bytes)
    payload = draw(st.binary(max_size=MAX_PAYLOAD + 16))
    header_len = draw(st.one_of(st.just(len(header)), st.integers(0, 65535)))
    payload_len = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1)))
    stream_id = draw(st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)))
    prefix = PREFIX.pack(draw(frame_types), draw(frame_flags), stream_id, header_len, payload_len)
    return prefix + header + payload


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    out, last = [], 0
    for point in [*points, len(data)]:
        out.append(data[last:point])
        last = point
    return out


def check_frame(frame: Frame) -> None:
    assert isinstance(frame.type, FrameType)
    assert isinstance(frame.header, dict)
    assert not frame.flags & ~(F_MORE | F_CONT)
    assert not (frame.flags & F_CONT and frame.header)
    assert 0 <= frame.stream_id < 2**32
    assert len(frame.payload) <= MAX_PAYLOAD


@given(st.lists(st.one_of(raw_frames(), st.binary(max_size=40)), max_size=6),
       st.lists(st.integers(0, 10**5), max_size=12))
@fuzz_settings()
def test_decoder_gives_frames_or_a_violation(parts: list[bytes], cuts: list[int]) -> None:
    decoder = FrameDecoder(max_header=MAX_HEADER, max_payload=MAX_PAYLOAD)
    bound = PREFIX_SIZE + MAX_HEADER + MAX_PAYLOAD
    try:
        for piece in pieces(b"".join(parts), cuts):
            for frame in decoder.feed(piece):
                check_frame(frame)
            assert decoder.buffered_bytes() <= bound
            assert len(decoder.next_target()) > 0
    except ProtocolViolation as exc:
        assert str(exc)  # says what was wrong


@given(st.lists(raw_frames(), min_size=1, max_size=4), st.integers(1, 64))
@fuzz_settings(scale=0.5)
def test_in_place_receiving_writes_only_where_told(parts: list[bytes], step: int) -> None:
    """The link's way of reading: next_target()/advance() with an allocator, a few bytes a time."""
    handed: list[int] = []

    def allocate(ftype: FrameType, flags: int, sid: int, header: dict[str, Any], length: int) -> memoryview:
        assert 0 < length <= MAX_PAYLOAD and isinstance(header, dict)
        handed.append(length)
        return memoryview(bytearray(length))

    decoder = FrameDecoder(max_header=MAX_HEADER, max_payload=MAX_PAYLOAD, allocate=allocate)
    data = memoryview(b"".join(parts))
    try:
        while data:
            target = decoder.next_target()
            count = min(len(target), len(data), step)
            target[:count] = data[:count]
            data = data[count:]
            frame = decoder.advance(count)
            if frame is not None:
                check_frame(frame)
                if frame.payload:
                    assert len(frame.payload) == handed[-1]
    except ProtocolViolation:
        pass


# --- the handshake -------------------------------------------------------------------------------

IDENTITY = Identity.generate()
CERT_HASH = bytes(range(32))
hello_keys = ["v", "id", "sig", "nonce", "addrs"]


@st.composite
def hellos(draw: st.DrawFn, *, server: bool) -> dict[str, Any]:
    """A real hello with some fields replaced, dropped or added, or a made-up one."""
    nonce = bytes(32)
    real = (server_hello(IDENTITY, CERT_HASH, nonce, []) if server
            else client_hello(IDENTITY, CERT_HASH, nonce, []))
    if draw(st.booleans()):
        return draw(headers(hello_keys))
    changed = dict(real)
    for key in draw(st.lists(st.sampled_from([*hello_keys, "x"]), max_size=3)):
        if draw(st.booleans()):
            changed[key] = draw(wire_values)
        else:
            changed.pop(key, None)
    return changed


@given(hellos(server=False))
@fuzz_settings()
def test_client_hello_is_verified_or_refused(hello: dict[str, Any]) -> None:
    try:
        peer = verify_client_hello(hello, CERT_HASH, bytes(32))
    except HandshakeError as exc:
        assert str(exc)
        return
    assert peer.peer_id == IDENTITY.peer_id  # only the real signature passes


@given(hellos(server=True), st.sampled_from([None, IDENTITY.peer_id, PEER_IDS[0]]))
@fuzz_settings()
def test_server_hello_is_verified_or_refused(hello: dict[str, Any], expected: str | None) -> None:
    try:
        peer, nonce = verify_server_hello(hello, CERT_HASH, expected)
    except (HandshakeError, PeerIdMismatchError) as exc:
        assert str(exc)
        return
    assert peer.peer_id == IDENTITY.peer_id and len(nonce) == 32
    assert expected in (None, IDENTITY.peer_id)


class BytesIO:
    """A pipe that hands out `data` in the given chunk sizes, then the end of the stream."""

    kind = "fuzz"

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data = memoryview(data)
        self.chunk = chunk

    async def recv_into(self, buffer: memoryview) -> int:
        count = min(len(buffer), len(self.data), self.chunk)
        buffer[:count] = self.data[:count]
        self.data = self.data[count:]
        return count


@given(st.one_of(raw_frames(), headers(hello_keys).map(to_json).map(
           lambda h: PREFIX.pack(FrameType.HELLO, 0, 0, len(h), 0) + h)),
       st.binary(max_size=32), st.integers(1, 100))
@fuzz_settings()
@example(PREFIX.pack(FrameType.HELLO, 0, 0, 0, 0) + b"\x00", b"", 1)
async def test_hello_reader_reads_one_hello_or_refuses(hello: bytes, after: bytes, chunk: int) -> None:
    io = BytesIO(hello + after, chunk)
    try:
        header = await _read_hello(io)  # type: ignore[arg-type]
    except HandshakeError as exc:
        assert str(exc)
        return
    assert isinstance(header, dict)
    header_len = PREFIX.unpack(hello[:PREFIX_SIZE])[3]
    assert header_len <= HELLO_MAX_HEADER
    assert bytes(io.data) == (hello + after)[PREFIX_SIZE + header_len:]  # left for the link


@pytest.mark.parametrize("header", [b"[" * 1023 + b"]" * 1023, b'{"v": 1e999}', b"\xff"])
async def test_hello_reader_regressions(header: bytes) -> None:
    frame = PREFIX.pack(FrameType.HELLO, 0, 0, len(header), 0) + header
    with pytest.raises(HandshakeError):
        await _read_hello(BytesIO(frame, 7))  # type: ignore[arg-type]
