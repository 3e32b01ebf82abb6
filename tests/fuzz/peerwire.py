"""Strategies for what a peer sends on a link after the handshake (import as `fuzz.peerwire`).

A session is a list of byte strings: well-formed requests and streams (one message or several
frames each, on fresh stream ids), stray frames of any type, and plain garbage. Requests name real
methods, with headers ("h") made of the fields their handlers read. With `safe`, every address in a
header is a loopback one (or garbage), so that a real daemon that learns it never dials out.
"""

from __future__ import annotations

from typing import Any

from fuzz.fuzzutil import PEER_IDS, headers, ints, to_json, wire_values
from hypothesis import strategies as st

from dedloc.daemon.dht import Entry, protocol
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import ProtocolViolation
from dedloc.daemon.net.frames import F_CONT, F_MORE, PREFIX, FrameDecoder, FrameType

DHT_UNARY = ["dht.ping", "dht.find_node", "dht.find_value", "dht.store"]
DHT_FIELDS = ["client", "addresses", "target", "key", "sub_key", "expiration", "signer", "signature",
              "proof", "token"]
LINK_FIELDS = ["m", "h", "n", "d", "w", "c", "k", "e", "done"]
SAFE_ADDRESSES = st.one_of(
    st.just([]),
    st.lists(st.sampled_from(["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/9/p2p/" + PEER_IDS[0],
                              "not an address", "/ip4/127.0.0.1/tcp/99999"]), max_size=3),
    st.integers(0, 3),
)
WRITER = Identity.generate()

sids = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 9, 2**32 - 1]), st.integers(0, 2**32 - 1))
payloads = st.one_of(st.binary(max_size=64), st.integers(0, 1200).map(bytes))


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`usual` seven times in eight, else `odd` (a session that breaks at once tests little)."""
    return st.integers(0, 7).flatmap(lambda pick: odd if pick == 0 else usual)


def frame_bytes(ftype: int, flags: int, sid: int, header: bytes, payload: bytes) -> bytes:
    return PREFIX.pack(ftype, flags, sid, len(header), len(payload)) + header + payload


def aligned(parts: list[bytes], max_payload: int) -> list[bytes]:
    """`parts`, then zero bytes up to the end of the frame they stop in, if any, so that what is sent
    next starts a frame (after garbage that leaves a frame half-sent, a receiver rightly waits for
    the rest). Nothing is added after bytes that break the framing: the receiver closes there."""
    decoder = FrameDecoder(max_payload=max_payload)
    padding = b""
    try:
        decoder.feed(b"".join(parts))
        while decoder._stage or decoder._filled:  # in the middle of a frame
            pad = bytes(len(decoder.next_target()))
            padding += pad
            decoder.feed(pad)
    except ProtocolViolation:
        pass
    return [*parts, padding] if padding else parts


def _made_safe(draw: st.DrawFn, header: Any, safe: bool) -> Any:
    if not safe or not isinstance(header, dict):
        return header
    header = dict(header)
    if "addresses" in header:
        header["addresses"] = draw(SAFE_ADDRESSES)
    if "h" in header:
        header["h"] = _made_safe(draw, header["h"], safe)
    return header


@st.composite
def dht_requests(draw: st.DrawFn, safe: bool) -> tuple[dict[str, Any], bytes]:
    """The header ("h") and payload of a DHT request: a genuine store now and then, else fields."""
    if draw(st.integers(0, 3)) == 0:
        entry = Entry.create(WRITER, draw(st.sampled_from(["k", "run"])), draw(st.binary(max_size=20)),
                             2e9 + draw(st.floats(-1e9, 1e9)), draw(st.sampled_from([None, "a"])))
        message = protocol.encode_store(entry, protocol.encode_caller(draw(st.booleans()), []))
        header = dict(message.header)
        if draw(st.booleans()):
            header[draw(st.sampled_from(DHT_FIELDS))] = draw(wire_values)
        return _made_safe(draw, header, safe), bytes(message.payload)
    return _made_safe(draw, draw(headers(DHT_FIELDS)), safe), draw(payloads)


@st.composite
def message(draw: st.DrawFn, ftype: FrameType, sid: int, first: dict[str, Any],
            body: tuple[Any, bytes] | None = None, safe: bool = False) -> bytes:
    """A whole message (REQUEST, RESPONSE or DATA), usually well-formed, cut into frames."""
    inner, payload = body if body is not None else (
        draw(mostly(st.one_of(headers([*LINK_FIELDS, *DHT_FIELDS]), st.just({})), wire_values)),
        draw(payloads))
    total = draw(st.one_of(st.just(len(payload)), ints)) if draw(st.integers(0, 9)) == 0 else len(payload)
    header = _made_safe(draw, {**first, "n": total, "h": inner}, safe)
    cuts = sorted({c for c in draw(st.lists(st.integers(1, max(1, len(payload) - 1)), max_size=3))
                   if c < len(payload)})
    bounds = [0, *cuts, len(payload)]
    out = b""
    for index in range(len(bounds) - 1):
        chunk = payload[bounds[index]:bounds[index + 1]]
        more = F_MORE if index < len(bounds) - 2 else 0
        if index == 0:
            out += frame_bytes(ftype, more, sid, to_json(header), chunk)
        else:
            out += frame_bytes(ftype, F_CONT | more, sid, b"", chunk)
    return out


@st.composite
def request(draw: st.DrawFn, sid: int, methods: list[str], safe: bool) -> bytes:
    method = draw(st.sampled_from([*methods, "nope"]))
    first: dict[str, Any] = {"m": method}
    if draw(st.booleans()):
        first["d"] = draw(mostly(st.integers(1, 5000), st.one_of(ints, wire_values)))
    body = draw(dht_requests(safe)) if method.startswith("dht.") else None
    return draw(message(FrameType.REQUEST, sid, first, body, safe))


@st.composite
def stream_session(draw: st.DrawFn, sid: int, methods: list[str], safe: bool) -> bytes:
    """OPEN, then DATA messages, CREDIT, CLOSE or ABORT, in some order."""
    window = draw(mostly(st.just(8192), st.one_of(ints, wire_values)))
    out = frame_bytes(FrameType.OPEN, 0, sid, to_json(
        {"m": draw(st.sampled_from([*methods, "nope"])), "h": {}, "w": window}), b"")
    for step in draw(st.lists(st.sampled_from(["data", "data", "credit", "close", "abort"]), max_size=4)):
        if step == "data":
            out += draw(message(FrameType.DATA, sid, {}, safe=safe))
        elif step == "credit":
            credit = {"c": draw(mostly(st.integers(1, 10000), st.one_of(ints, wire_values)))}
            out += frame_bytes(FrameType.CREDIT, 0, sid, to_json(credit), b"")
        else:
            kind = FrameType.CLOSE if step == "close" else FrameType.ABORT
            header = {} if step == "close" else {"e": draw(wire_values)}
            out += frame_bytes(kind, 0, sid, to_json(header) if header else b"", b"")
    return out


@st.composite
def any_frame(draw: st.DrawFn, methods: list[str], safe: bool) -> bytes:
    """One frame, any type, flags and stream id; the header JSON is an object, usually."""
    ftype = draw(st.sampled_from([int(t) for t in FrameType]))
    flags = draw(st.sampled_from([0, 0, F_MORE, F_CONT, F_CONT | F_MORE]))
    header: dict[str, Any] = {} if flags & F_CONT else draw(headers([*LINK_FIELDS, *DHT_FIELDS]))
    if ftype in (FrameType.REQUEST, FrameType.OPEN) and draw(st.booleans()):
        header["m"] = draw(st.sampled_from(methods))
    header = _made_safe(draw, header, safe)
    return frame_bytes(ftype, flags, draw(sids), to_json(header) if header else b"", draw(payloads))


@st.composite
def sessions(draw: st.DrawFn, *, unary: list[str], streams: list[str], first_sid: int,
             safe: bool = False, max_parts: int = 6) -> list[bytes]:
    """What a peer sends after the handshake. It opens stream ids of its parity, from `first_sid`
    (1: it dialed; 2: it was dialed)."""
    parts, sid = [], first_sid
    kinds = ["request", "request", "stream"]  # half the sessions keep to the protocol's shape
    if draw(st.booleans()):
        kinds += ["frame", "bytes"]
    for _ in range(draw(st.integers(1, max_parts))):
        kind = draw(st.sampled_from(kinds))
        if kind == "request":
            parts.append(draw(request(sid, unary, safe)))
            sid += 2
        elif kind == "stream" and streams:
            parts.append(draw(stream_session(sid, streams, safe)))
            sid += 2
        elif kind == "frame":
            parts.append(draw(any_frame([*unary, *streams], safe)))
        else:
            parts.append(draw(st.binary(min_size=1, max_size=40)))
    return parts
