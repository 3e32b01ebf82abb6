"""The per-chunk codecs: exact round trip for "none", errors within the documented bound for the
lossy ones (random and adversarial inputs), NaN/Inf refused, bad payloads and meta refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dedloc.daemon.averaging.compression import CODECS, CompressionError, get_codec

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
