"""The per-chunk codecs: exact round trip for "none", errors within the documented bound for the
lossy ones (random and adversarial inputs), NaN/Inf refused, bad payloads and meta refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dedloc.daemon.averaging.codec import CompressionError
from dedloc.daemon.averaging.compression import CODECS, get_codec, reply_codec, sparsifies

LOSSY = ["fp16", "uint8", "quantile8"]
F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def roundtrip(name: str, array: np.ndarray) -> np.ndarray:
    codec = get_codec(name)
    payload, meta = codec.encode(array)
    assert len(payload) <= codec.max_payload_bytes(array.size)
    return codec.decode(bytes(payload), meta, array.size)


def worst_error(array: np.ndarray, decoded: np.ndarray) -> float:
    return float(np.abs(decoded.astype(np.float64) - array.astype(np.float64)).max(initial=0.0))


def samples() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.standard_normal(100_000).astype(np.float32),
        rng.uniform(-1e-3, 5e-3, 4097).astype(np.float32),
        rng.standard_cauchy(30_000).astype(np.float32),  # heavy tails: quantile levels crowd
        (rng.standard_normal(5000) * 1e-3 + 1e4).astype(np.float32),  # range tiny against values
        np.full(1000, 3.25, np.float32),
        np.array([7.0], np.float32),
        np.array([-3e38, 3e38, 0.0, 1e-45], np.float32),
        (rng.standard_normal(2000) * 1e35).astype(np.float32),  # beyond float16: scaled
        np.concatenate([np.zeros(9999, np.float32), [1e6]]).astype(np.float32),
    ]


@pytest.mark.parametrize("index", range(len(samples())))
def test_none_is_exact(index: int) -> None:
    array = samples()[index]
    assert np.array_equal(roundtrip("none", array), array)
    assert get_codec("none").error_bound(array) == 0.0


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("index", range(len(samples())))
def test_lossy_error_within_bound(name: str, index: int) -> None:
    array = samples()[index]
    decoded = roundtrip(name, array)
    assert decoded.dtype == np.float32 and decoded.shape == array.shape
    assert np.isfinite(decoded).all()
    assert worst_error(array, decoded) <= get_codec(name).error_bound(array)


@pytest.mark.parametrize("name", LOSSY)
@settings(max_examples=150, deadline=None)
@given(array=hnp.arrays(np.float32, st.integers(1, 600), elements=F32))
def test_lossy_bound_holds_for_any_finite_chunk(name: str, array: np.ndarray) -> None:
    decoded = roundtrip(name, array)
    assert worst_error(array, decoded) <= get_codec(name).error_bound(array)


@settings(max_examples=100, deadline=None)
@given(array=hnp.arrays(np.float32, st.integers(1, 600), elements=F32))
def test_none_roundtrip_for_any_finite_chunk(array: np.ndarray) -> None:
    assert np.array_equal(roundtrip("none", array), array)


@pytest.mark.parametrize("name", ["uint8", "quantile8"])
def test_constant_chunks_are_exact(name: str) -> None:
    for value in (0.0, -1.5, 1e30, 1e-40):
        array = np.full(333, value, np.float32)
        assert np.array_equal(roundtrip(name, array), array)


def test_documented_bounds() -> None:
    rng = np.random.default_rng(3)
    array = rng.uniform(-2, 6, 10_000).astype(np.float32)
    lo, hi = float(array.min()), float(array.max())
    assert get_codec("uint8").error_bound(array) == pytest.approx((hi - lo) / 255 / 2, rel=1e-3)
    assert get_codec("fp16").error_bound(array) == pytest.approx(max(-lo, hi) * 2**-11)
    quantile = CODECS["quantile8"]
    levels = quantile.levels(array)  # type: ignore[attr-defined]
    assert levels.shape == (256,) and levels[0] == lo and levels[-1] == hi
    assert np.all(np.diff(levels) >= 0)
    assert quantile.error_bound(array) == pytest.approx(float(np.diff(levels.astype(np.float64)).max()) / 2,
                                                        rel=1e-4)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(name: str, bad: float) -> None:
    array = np.arange(50, dtype=np.float32)
    array[17] = bad
    with pytest.raises(CompressionError, match="NaN or Inf"):
        get_codec(name).encode(array)


@pytest.mark.parametrize("name", list(CODECS))
def test_wrong_payload_length_is_refused(name: str) -> None:
    codec = get_codec(name)
    payload, meta = codec.encode(np.linspace(-1, 1, 100, dtype=np.float32))
    for wrong in (bytes(payload)[:-1], bytes(payload) + b"\0", b""):
        with pytest.raises(CompressionError, match="payload"):
            codec.decode(wrong, meta, 100)


@pytest.mark.parametrize(("name", "meta"), [
    ("none", {"x": 1}),
    ("none", []),
    ("fp16", {"e": -1}),
    ("fp16", {"e": 1.5}),
    ("fp16", {"e": True}),
    ("fp16", {"e": 500}),
    ("uint8", {}),
    ("uint8", {"lo": "0", "sc": 1.0}),
    ("uint8", {"lo": 0.0, "sc": -1.0}),
    ("uint8", {"lo": 0.0, "sc": float("nan")}),
    ("uint8", {"lo": 3e38, "sc": 1e37}),
    ("quantile8", {"lo": 1}),
])
def test_bad_meta_is_refused_and_nothing_is_written(name: str, meta: object) -> None:
    codec = get_codec(name)
    payload, _ = codec.encode(np.linspace(-1, 1, 64, dtype=np.float32))
    out = np.full(64, 9.0, np.float32)
    with pytest.raises(CompressionError):
        codec.decode(payload, meta, 64, out=out)  # type: ignore[arg-type]
    assert (out == 9.0).all()


def test_non_finite_payloads_are_refused_before_writing() -> None:
    out = np.full(4, 9.0, np.float32)
    with pytest.raises(CompressionError, match="NaN or Inf"):
        get_codec("none").decode(np.array([1, np.nan, 2, 3], np.float32).tobytes(), {}, 4, out=out)
    with pytest.raises(CompressionError, match="NaN or Inf"):
        get_codec("fp16").decode(np.array([1, np.inf, 2, 3], np.float16).tobytes(), {}, 4, out=out)
    with pytest.raises(CompressionError, match="overflows"):
        get_codec("fp16").decode(np.array([1, 60000, 2, 3], np.float16).tobytes(), {"e": 120}, 4, out=out)
    levels = np.zeros(256, np.float32)
    levels[5] = np.nan
    with pytest.raises(CompressionError, match="non-finite levels"):
        get_codec("quantile8").decode(levels.tobytes() + bytes(4), {}, 4, out=out)
    assert (out == 9.0).all()


def test_decode_into_a_destination_slice() -> None:
    vector = np.zeros(300, np.float32)
    chunk = np.linspace(-5, 5, 100, dtype=np.float32)
    for name in CODECS:
        codec = get_codec(name)
        payload, meta = codec.encode(chunk)
        result = codec.decode(payload, meta, 100, out=vector[100:200])
        assert result.base is vector or result is vector[100:200] or np.shares_memory(result, vector)
        assert worst_error(chunk, vector[100:200]) <= codec.error_bound(chunk)
    with pytest.raises(CompressionError, match="target"):
        get_codec("fp16").decode(*get_codec("fp16").encode(chunk), 100, out=vector[:99])


def test_unknown_codec_and_bad_chunks() -> None:
    with pytest.raises(CompressionError, match="unknown compression 'zip'"):
        get_codec("zip")
    with pytest.raises(CompressionError, match="float32"):
        get_codec("uint8").encode(np.zeros(4, np.float64))
    with pytest.raises(CompressionError, match="float32"):
        get_codec("uint8").encode(np.zeros((2, 2), np.float32))


# --- sparse codecs: topk and its reply codec sparse16 ------------------------------------------------
TOPK = get_codec("topk")
SPARSE16 = reply_codec(TOPK)


def sparse_payload(n: int, positions: list[int], codes: list[int]) -> bytes:
    """A hand-made topk payload: per-block counts, uint16 offsets, packed 4-bit codes."""
    blocks = -(-n // 65536)
    counts = np.bincount(np.array(positions, dtype=np.int64) >> 16, minlength=blocks).astype("<u4")
    offsets = (np.array(positions, dtype=np.int64) & 0xFFFF).astype("<u2")
    nibbles = list(codes) + [0] * (len(codes) & 1)
    packed = bytes(a | b << 4 for a, b in zip(nibbles[0::2], nibbles[1::2], strict=True))
    return counts.tobytes() + offsets.tobytes() + packed


@pytest.mark.parametrize("index", range(len(samples())))
def test_topk_keeps_the_largest_magnitudes_within_bound(index: int) -> None:
    array = samples()[index]
    decoded = roundtrip("topk", array)
    n, k = array.size, TOPK.budget(array.size)  # type: ignore[attr-defined]
    assert np.isfinite(decoded).all() and decoded.dtype == np.float32
    sent = np.flatnonzero(decoded)
    assert sent.size <= k
    assert np.all(np.sign(decoded[sent]) == np.sign(array[sent]))
    if sent.size:  # nothing dropped is larger than what was sent
        dropped = np.setdiff1d(np.arange(n), sent)
        assert np.abs(array[dropped]).max(initial=0.0) <= np.abs(array[sent]).min()
    assert worst_error(array, decoded) <= TOPK.error_bound(array)


@settings(max_examples=150, deadline=None)
@given(array=hnp.arrays(np.float32, st.integers(1, 3000), elements=F32))
def test_topk_and_sparse16_bounds_hold_for_any_finite_chunk(array: np.ndarray) -> None:
    decoded = roundtrip("topk", array)
    assert worst_error(array, decoded) <= TOPK.error_bound(array)
    payload, meta = SPARSE16.encode(decoded)
    assert len(payload) <= SPARSE16.max_payload_bytes(array.size)
    back = SPARSE16.decode(bytes(payload), meta, array.size)
    assert worst_error(decoded, back) <= SPARSE16.error_bound(decoded)
    assert np.count_nonzero(back) <= np.count_nonzero(decoded)


def test_topk_payload_size_and_documented_bound() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 64, 65, 65536, 65537, 1 << 20):
        array = rng.standard_normal(n).astype(np.float32)
        payload, meta = TOPK.encode(array)
        k = -(-n // 64)
        assert meta["k"] == k and len(payload) == TOPK.max_payload_bytes(n)
        assert len(payload) == 4 * -(-n // 65536) + 2 * k + (k + 1) // 2
    array = rng.standard_normal(100_000).astype(np.float32)
    magnitudes = np.sort(np.abs(array))[::-1]
    t, a = float(magnitudes[TOPK.budget(array.size) - 1]), float(magnitudes[0])  # type: ignore[attr-defined]
    assert TOPK.error_bound(array) == pytest.approx(max(t, (a - t) / 14), rel=1e-5)
    assert len(TOPK.encode(array)[0]) / array.size < 0.04  # bytes per value


def test_topk_leaves_zeros_out_and_sparse16_is_exact_on_its_nonzeros() -> None:
    array = np.zeros(5000, np.float32)
    assert TOPK.encode(array)[1] == {"k": 0} and not roundtrip("topk", array).any()
    array[[3, 4000]] = [2.5, -1.0]
    payload, meta = TOPK.encode(array)
    assert meta["k"] == 2 and np.array_equal(TOPK.decode(payload, meta, 5000), array)  # the two levels
    payload, meta = SPARSE16.encode(array)
    assert meta["k"] == 2 and len(payload) == 4 + 2 * 2 + 2 * 2
    assert np.array_equal(SPARSE16.decode(payload, meta, 5000), array)
    dense = np.linspace(-1, 1, 5000, dtype=np.float32)  # sparse would be larger: dense fp16
    payload, meta = SPARSE16.encode(dense)
    assert "k" not in meta and len(payload) == 2 * 5000


@pytest.mark.parametrize(("positions", "codes", "match"), [
    ([5, 5], [1, 2], "strictly increasing"),  # duplicate
    ([9, 5], [1, 2], "strictly increasing"),  # unsorted
    ([5, 100], [1, 2], "outside the chunk"),  # past the end
])
def test_topk_bad_indices_are_refused_and_nothing_is_written(positions: list[int], codes: list[int],
                                                            match: str) -> None:
    out = np.full(100, 9.0, np.float32)
    meta = {"k": 2, "lo": 1.0, "hi": 2.0}
    with pytest.raises(CompressionError, match=match):
        TOPK.decode(sparse_payload(100, positions, codes), meta, 100, out=out)
    assert (out == 9.0).all()


def test_topk_bad_counts_and_padding_are_refused() -> None:
    n = 70_000  # two blocks
    good = sparse_payload(n, [10, 65540], [1, 8])  # +level 1, -level 0
    meta = {"k": 2, "lo": 1.0, "hi": 2.0}
    assert TOPK.decode(good, meta, n)[[10, 65540]].tolist() == [pytest.approx(1 + 1 / 7), -1.0]
    moved = np.frombuffer(good[:8], "<u4").copy()
    moved[:] = [2, 0]  # both offsets claimed by block 0: same bytes, other positions
    with pytest.raises(CompressionError, match="strictly increasing"):  # 10 then 4 in block 0
        TOPK.decode(moved.tobytes() + good[8:], meta, n)
    lying = np.array([1, 2], "<u4").tobytes()  # counts add up to 3, not k
    with pytest.raises(CompressionError, match="add up"):
        TOPK.decode(lying + good[8:], meta, n)
    huge = np.array([2**32 - 1, 3], "<u4").tobytes()  # counts that wrap uint32
    with pytest.raises(CompressionError, match="add up"):
        TOPK.decode(huge + good[8:], meta, n)
    odd = sparse_payload(100, [7], [3])
    bad_padding = odd[:-1] + bytes([odd[-1] | 0x50])
    with pytest.raises(CompressionError, match="padding"):
        TOPK.decode(bad_padding, {"k": 1, "lo": 1.0, "hi": 1.0}, 100)


@pytest.mark.parametrize("meta", [
    {},  # no k
    {"k": -1}, {"k": 1.0}, {"k": True}, {"k": "2"},
    {"k": 3},  # more than the budget of 100 values (2)
    {"k": 10**12},  # a huge count
    {"k": 2},  # no magnitudes
    {"k": 2, "lo": 1.0},
    {"k": 2, "lo": 1.0, "hi": float("nan")},
    {"k": 2, "lo": float("-inf"), "hi": 2.0},
    {"k": 2, "lo": None, "hi": 2.0},  # what JSON makes of NaN
    {"k": 2, "lo": -1.0, "hi": 2.0},
    {"k": 2, "lo": 3.0, "hi": 2.0},
    {"k": 2, "lo": 1.0, "hi": 1e39},
    {"k": 2, "lo": 1.0, "hi": 2.0, "x": 0},
    [],
])
def test_topk_bad_meta_is_refused_and_nothing_is_written(meta: object) -> None:
    payload = sparse_payload(100, [5, 50], [1, 2])
    out = np.full(100, 9.0, np.float32)
    with pytest.raises(CompressionError):
        TOPK.decode(payload, meta, 100, out=out)  # type: ignore[arg-type]
    assert (out == 9.0).all()


def test_topk_wrong_lengths_are_refused() -> None:
    payload, meta = TOPK.encode(np.linspace(-1, 1, 1000, dtype=np.float32))
    for wrong in (bytes(payload)[:-1], bytes(payload) + b"\0", b""):
        with pytest.raises(CompressionError, match="payload"):
            TOPK.decode(wrong, meta, 1000)
    with pytest.raises(CompressionError, match="payload"):  # a k that the payload does not hold
        TOPK.decode(payload, {**meta, "k": meta["k"] - 1}, 1000)


def sparse16_payload(offsets: list[int], values: list[float]) -> bytes:
    """A hand-made sparse16 payload of a chunk of at most 65536 values."""
    return (np.array([len(offsets)], "<u4").tobytes() + np.array(offsets, "<u2").tobytes()
            + np.array(values, np.float16).tobytes())


@pytest.mark.parametrize(("payload", "meta", "match"), [
    (sparse16_payload([9, 3], [1, 2]), {"k": 2}, "strictly increasing"),
    (sparse16_payload([3, 3], [1, 2]), {"k": 2}, "strictly increasing"),
    (sparse16_payload([3, 100], [1, 2]), {"k": 2}, "outside"),
    (sparse16_payload([3, 9], [1, np.inf]), {"k": 2}, "NaN or Inf"),
    (sparse16_payload([3, 9], [1, 2]), {"k": 2, "e": 200}, "'e'"),
    (bytes(200), {"k": 60}, "denser"),
    (bytes(200), {"k": -1}, "'k'"),
    (bytes(200), {"k": 2, "z": 1}, "meta"),
    (bytes(199), {}, "payload"),
])
def test_sparse16_bad_payloads_are_refused_and_nothing_is_written(payload: bytes, meta: dict[str, object],
                                                                 match: str) -> None:
    out = np.full(100, 9.0, np.float32)
    with pytest.raises(CompressionError, match=match):
        SPARSE16.decode(payload, meta, 100, out=out)
    assert (out == 9.0).all()


def test_sparse_codecs_are_not_choices_of_their_own() -> None:
    assert "topk" in CODECS and "sparse16" not in CODECS
    assert sparsifies(TOPK) and not any(sparsifies(get_codec(name)) for name in ("none", *LOSSY))
    assert all(reply_codec(get_codec(name)) is get_codec(name) for name in ("none", *LOSSY))


def big_chunks() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    n = 1 << 20
    fooling = rng.standard_normal(2 * n).astype(np.float32)
    fooling[:: 2 * n // 16384] = 100.0  # the sample sees only huge values: fewer than k pass
    hidden = rng.standard_normal(n).astype(np.float32) * 1e-3
    hidden[1:: n // 16384] = 50.0  # the largest values all sit between the sampled ones
    return [rng.standard_normal(n).astype(np.float32), rng.standard_cauchy(300_000).astype(np.float32),
            np.concatenate([np.zeros(900_000), rng.standard_normal(100_000)]).astype(np.float32),
            np.sort(rng.standard_normal(500_000)).astype(np.float32), np.ones(200_000, np.float32),
            np.concatenate([np.zeros(199_990), np.ones(10)]).astype(np.float32), fooling, hidden]


@pytest.mark.parametrize("index", range(len(big_chunks())))
def test_topk_sends_exactly_the_largest_magnitudes_of_big_chunks(index: int) -> None:
    array = big_chunks()[index]
    n, k = array.size, TOPK.budget(array.size)  # type: ignore[attr-defined]
    decoded = roundtrip("topk", array)
    sent = np.flatnonzero(decoded)
    assert sent.size == min(k, np.count_nonzero(array))
    kth = np.partition(np.abs(array), n - k)[n - k]
    assert np.abs(array[sent]).min() >= kth
    assert worst_error(array, decoded) <= TOPK.error_bound(array)
