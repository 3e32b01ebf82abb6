"""The 8-bit level codecs: "uint8" and "quantile8". Error bounds (per element,
|decoded - original|):

- "uint8": 256 uniform levels from the chunk's min to its max, nearest level:
           |err| <= (max - min) / 255 / 2, plus float32 rounding: (max - min) / 255 * 2^-14 +
           2^-21 * max(|min|, |max|).
- "quantile8": 256 levels at the chunk's quantiles (estimated from an evenly strided sample of at
           most 16384 values; the first and last levels are the exact min and max), nearest level:
           |err| <= half the largest gap between adjacent levels (+ 2^-23 * max(|min|, |max|)).
"""

from __future__ import annotations

import numpy as np

from .codec import (
    F32_MAX,
    SUBNORMAL,
    Buffer,
    CompressionError,
    Meta,
    NonFiniteError,
    as_chunk,
    check_length,
    check_meta_keys,
    decode_target,
    finite_range,
    meta_number,
)

_LEVELS = 256
_LEVEL_BYTES = _LEVELS * 4
_SAMPLE = 16384


def _encode_levels(array: np.ndarray, levels: np.ndarray) -> bytearray:
    """Payload: the 256 float32 levels, then one byte per value: the index of its nearest level."""
    n = array.size
    payload = bytearray(_LEVEL_BYTES + n)
    payload[:_LEVEL_BYTES] = levels.tobytes()
    wide = levels.astype(np.float64)
    middles = ((wide[:-1] + wide[1:]) / 2).astype(np.float32)
    codes = np.frombuffer(payload, dtype=np.uint8, offset=_LEVEL_BYTES, count=n)
    _nearest(array, middles, float(levels[0]), float(levels[-1]), codes)
    return payload


_BUCKETS = 1 << 16
_BLOCK = 1 << 15
_MAX_STEPS = 12


def _nearest(array: np.ndarray, middles: np.ndarray, lo: float, hi: float, codes: np.ndarray) -> None:
    """codes[i] = #{k: middles[k] < array[i]}, the index of the nearest level (ties go down).

    A binary search per value (np.searchsorted) mispredicts every branch: ~60 ns a value. Instead,
    cut [lo, hi] into 65536 uniform buckets; a table gives, per bucket, how many middles lie below
    the bucket before it (a safe start whatever the float rounding of the bucket index), and a few
    vectorised steps `code += x > middles[code]` finish the count. The number of steps is the most
    middles any three adjacent buckets hold; data so clustered that it exceeds _MAX_STEPS (or a
    range tiny against the magnitudes) falls back to np.searchsorted.
    """
    span = hi - lo
    scale = _BUCKETS / span if span > 0 else 0.0
    steps = _MAX_STEPS + 1
    if span > 0 and max(-lo, hi) / span < 2.0**30:
        edges = lo + (np.arange(-1, _BUCKETS + 2, dtype=np.float64) / scale)
        below = np.searchsorted(middles.astype(np.float64), edges, side="left")
        steps = int((below[3:] - below[:-3]).max())
        start = below[:_BUCKETS].astype(np.uint8)
    if steps > _MAX_STEPS:
        for first in range(0, array.size, _BLOCK):
            part = array[first:first + _BLOCK]
            codes[first:first + part.size] = np.searchsorted(middles, part)
        return
    thresholds = np.append(middles, np.float32(np.inf))
    offset = np.float64(lo)
    for first in range(0, array.size, _BLOCK):
        part = array[first:first + _BLOCK]
        index = np.subtract(part, offset, dtype=np.float64)
        np.multiply(index, scale, out=index)
        np.clip(index, 0, _BUCKETS - 1, out=index)
        code = np.take(start, index.astype(np.intp))
        for _ in range(steps):
            code += part > np.take(thresholds, code)
        codes[first:first + part.size] = code


def _decode_levels(payload: Buffer, n: int, out: np.ndarray | None, name: str) -> np.ndarray:
    view = check_length(payload, _LEVEL_BYTES + n, name)
    levels = np.frombuffer(view, dtype=np.float32, count=_LEVELS)
    if not np.isfinite(levels).all():
        raise NonFiniteError(f"{name} payload holds non-finite levels")
    codes = np.frombuffer(view, dtype=np.uint8, offset=_LEVEL_BYTES, count=n)
    target = decode_target(out, n)
    np.take(levels, codes, out=target)
    return target


class Uniform8:
    """8-bit uniform: the meta carries min and step; the decoded value is min + code * step."""

    name = "uint8"

    def max_payload_bytes(self, n: int) -> int:
        return n

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = as_chunk(array)
        if not array.size:
            return b"", {"lo": 0.0, "sc": 0.0}
        lo, hi = finite_range(array)
        step = (hi - lo) / 255  # float64: finite for any two finite float32 values
        if step == 0:
            return bytes(array.size), {"lo": lo, "sc": 0.0}
        scale = 1.0 / step
        if max(-lo, hi) < 1e37 and scale < 1e37:  # float32 arithmetic cannot overflow
            work = np.multiply(array, np.float32(scale))
            np.add(work, np.float32(0.5 - lo * scale), out=work)
        else:
            work = np.multiply(array.astype(np.float64), scale)
            np.add(work, 0.5 - lo * scale, out=work)
        np.clip(work, 0, 255.5, out=work)
        codes = work.astype(np.uint8)  # truncation of code + 0.5: the nearest level
        return codes.data.cast("B"), {"lo": lo, "sc": step}

    def _table(self, lo: float, step: float) -> np.ndarray:
        return (lo + np.arange(_LEVELS, dtype=np.float64) * step).astype(np.float32)

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        check_meta_keys(meta, {"lo", "sc"}, self.name)
        lo, step = meta_number(meta, "lo"), meta_number(meta, "sc")
        if step < 0 or abs(lo) > F32_MAX or abs(lo + 255 * step) > F32_MAX * (1 + 1e-9):
            raise CompressionError("uint8 meta describes levels outside float32")
        view = check_length(payload, n, self.name)
        target = decode_target(out, n)
        codes = np.frombuffer(view, dtype=np.uint8, count=n)
        np.take(self._table(lo, step), codes, out=target)
        return target

    def error_bound(self, array: np.ndarray) -> float:
        array = as_chunk(array)
        if not array.size:
            return 0.0
        lo, hi = finite_range(array)
        step = (hi - lo) / 255
        return step / 2 * (1 + 2.0**-13) + 2.0**-21 * max(-lo, hi) + SUBNORMAL


class Quantile8:
    """8-bit quantile: the payload carries the 256 levels (the chunk's quantiles), then codes."""

    name = "quantile8"

    def max_payload_bytes(self, n: int) -> int:
        return _LEVEL_BYTES + n

    def levels(self, array: np.ndarray) -> np.ndarray:
        """The 256 sorted levels encode uses for this chunk (the bound is read off them)."""
        array = as_chunk(array)
        lo, hi = finite_range(array)
        stride = max(1, array.size // _SAMPLE)
        sample = np.sort(array[::stride])
        picks = np.rint(np.linspace(0, sample.size - 1, _LEVELS)).astype(np.intp)
        levels = sample[picks].copy()
        levels[0], levels[-1] = lo, hi
        return levels

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = as_chunk(array)
        if not array.size:
            return bytes(_LEVEL_BYTES), {}
        return _encode_levels(array, self.levels(array)), {}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        check_meta_keys(meta, set(), self.name)
        return _decode_levels(payload, n, out, self.name)

    def error_bound(self, array: np.ndarray) -> float:
        array = as_chunk(array)
        if not array.size:
            return 0.0
        levels = self.levels(array).astype(np.float64)
        magnitude = max(-levels[0], levels[-1])
        return float(np.diff(levels).max(initial=0.0)) / 2 + 2.0**-23 * magnitude + SUBNORMAL
