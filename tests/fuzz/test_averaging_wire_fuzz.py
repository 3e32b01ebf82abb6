"""Fuzzing the all-reduce's header decoding (daemon/averaging/wire.py; only its decoders).

Properties: a stream-open header gives a StreamOpen whose fields are sane, or PeerFault; a chunk
header gives the meta of exactly the expected chunk, or PeerFault.
"""

from __future__ import annotations

import math
from typing import Any

from fuzz.fuzzutil import fuzz_settings, headers, ints, wire_json, wire_values
from hypothesis import given
from hypothesis import strategies as st

from dedloc.daemon.averaging.wire import PeerFault, StreamOpen, parse_chunk

open_headers = st.one_of(
    headers(["g", "i", "w", "d"]),
    st.fixed_dictionaries({"g": st.text(min_size=1, max_size=8), "i": st.integers(0, 8),
                           "w": st.floats(0.001, 100), "d": st.floats(0, 2e9)}),
)


@given(open_headers)
@fuzz_settings()
def test_stream_open_parses_or_is_a_fault(header: dict[str, Any]) -> None:
    try:
        opened = StreamOpen.parse(wire_json(header))
    except PeerFault as exc:
        assert str(exc)
        return
    assert isinstance(opened.group_id, str) and 0 < len(opened.group_id) <= 200
    assert isinstance(opened.sender, int) and not isinstance(opened.sender, bool) and opened.sender >= 0
    assert math.isfinite(opened.weight) and opened.weight > 0 and math.isfinite(opened.deadline)
    assert StreamOpen.parse(wire_json(opened.header())) == opened


@given(st.one_of(headers(["c", "m"]), st.fixed_dictionaries({"c": st.integers(-2, 10)}, optional={
           "m": st.one_of(st.dictionaries(st.text(max_size=4), wire_values, max_size=3), wire_values)})),
       st.integers(0, 10), st.one_of(st.integers(0, 12), ints))
@fuzz_settings()
def test_chunk_header_is_the_expected_chunk_or_a_fault(header: dict[str, Any], expected: int,
                                                       count: int) -> None:
    header = wire_json(header)
    try:
        meta = parse_chunk(header, expected, count)
    except PeerFault as exc:
        assert str(exc)
        return
    assert header["c"] == expected and not isinstance(header["c"], bool)
    assert isinstance(meta, dict)
