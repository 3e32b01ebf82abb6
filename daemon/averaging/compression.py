"""Per-chunk codecs for the all-reduce: "none", "fp16", "uint8", "quantile8" and "topk".

Each codec is stateless: `encode(chunk)` gives a raw payload (bytes-like; it never goes through
JSON) and a small JSON-able meta dict; `decode(payload, meta, n, out=None)` gives the n float32
values back (written into `out` when given). Error bounds (per element, |decoded - original|):

- "none":  exact (the payload is the float32 bytes themselves, no copy).
- "fp16":  values scaled by 2^-e (e = 0 unless |x| > 65504, so nothing overflows), rounded to
           the nearest float16: |err| <= max(2^-11 * max|x|, 2^(e-25)).
- "uint8": 256 uniform levels from the chunk's min to its max, nearest level:
           |err| <= (max - min) / 255 / 2, plus float32 rounding: (max - min) / 255 * 2^-14 +
           2^-21 * max(|min|, |max|).
- "quantile8": 256 levels at the chunk's quantiles (estimated from an evenly strided sample of at
           most 16384 values; the first and last levels are the exact min and max), nearest level:
           |err| <= half the largest gap between adjacent levels (+ 2^-23 * max(|min|, |max|)).
- "topk":  sparse: only the k = ceil(n / 64) values of largest magnitude are sent (zeros among
           them are left out), each in 4 bits: a sign and one of 8 uniform magnitudes from the
           smallest sent magnitude t to the largest, a; the rest decodes to 0. A dropped value has
           |x| <= t, a sent one is off by at most half a step, so
           |err| <= max(t, (a - t) / 14) (+ 2^-20 of that + 2^-23 * a). That bound is per element
           but loose by design for the dropped values: the error is most of the chunk's small
           values, which the sender carries over to its next round (error_feedback.py).
           The average of several senders' top-k chunks is not top-k sparse: a reducer answers
           with `reply_codec(topk)`, "sparse16" (every nonzero, fp16 values, or dense fp16 when
           that is smaller: the "fp16" bound), and passes its own contribution through "topk"
           too, so that every contribution is equally sparse (`sparsifies`).

Index layout of the sparse codecs: the chunk is cut into blocks of 65536 values; the payload
holds the count of sent values per block (uint32, little-endian), then each sent value's offset
within its block (uint16), in increasing order, then the values.

`error_bound(chunk)` computes that bound for a chunk. Every `encode` refuses NaN/Inf input and
every `decode` checks the payload length and the meta, and never writes a non-finite value into
`out` (it validates before writing): both raise `CompressionError`, and the caller rejects the
chunk. Everything is vectorised numpy that releases the GIL, so callers may run it in threads.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from .errors import AveragingError

Buffer = bytes | bytearray | memoryview
Meta = dict[str, Any]

_FP16_MAX = 65504.0
_F32_MAX = float(np.finfo(np.float32).max)
_LEVELS = 256
_LEVEL_BYTES = _LEVELS * 4
_SAMPLE = 16384


# Rounding to float32 cannot be finer than one subnormal step near zero: every lossy bound allows it.
SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)


class CompressionError(AveragingError, ValueError):
    """A chunk cannot be encoded (NaN/Inf) or a payload/meta cannot be decoded (a bad peer)."""


class NonFiniteError(CompressionError):
    """The chunk, or what a payload decodes to, holds NaN or Inf."""


class Codec(Protocol):
    name: str

    def max_payload_bytes(self, n: int) -> int:
        """The largest payload `encode` makes for n values (to size receive buffers)."""

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        """Payload and meta for a 1-D float32 chunk; CompressionError on NaN/Inf."""

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """The n float32 values (in `out` if given; "none" without `out` returns a view of the
        payload, no copy); CompressionError on a bad payload or meta."""

    def error_bound(self, array: np.ndarray) -> float:
        """The largest |decode(encode(array)) - array| this codec allows for this chunk."""


def _chunk(array: np.ndarray) -> np.ndarray:
    if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.ndim != 1:
        raise CompressionError("a chunk must be a one-dimensional float32 array")
    return np.ascontiguousarray(array)


def finite_range(array: np.ndarray) -> tuple[float, float]:
    """(min, max) of a non-empty float32 array; CompressionError if it holds NaN or Inf."""
    lo, hi = float(array.min()), float(array.max())  # NaN propagates through min/max
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise NonFiniteError("the chunk holds NaN or Inf values")
    return lo, hi


def _target(out: np.ndarray | None, n: int) -> np.ndarray:
    if out is None:
        return np.empty(n, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (n,):
        raise CompressionError(f"decode target must be float32 of shape ({n},)")
    return out


def _check_length(payload: Buffer, expected: int, name: str) -> memoryview:
    view = memoryview(payload).cast("B")
    if len(view) != expected:
        raise CompressionError(f"{name} payload of {len(view)} bytes, expected {expected}")
    return view


def _number(meta: Meta, key: str) -> float:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CompressionError(f"codec meta {key!r} must be a finite number")
    return float(value)


def _only_keys(meta: Meta, allowed: set[str], name: str) -> None:
    if not isinstance(meta, dict) or not set(meta) <= allowed:
        raise CompressionError(f"bad {name} meta: {str(meta)[:100]}")


class NoCompression:
    name = "none"

    def max_payload_bytes(self, n: int) -> int:
        return 4 * n

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = _chunk(array)
        if array.size:
            finite_range(array)
        return array.data.cast("B"), {}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        _only_keys(meta, set(), self.name)
        view = _check_length(payload, 4 * n, self.name)
        values = np.frombuffer(view, dtype=np.float32, count=n)
        if n:
            finite_range(values)
        if out is None:
            return values  # a view of the payload itself (writable when the payload is)
        target = _target(out, n)
        target[...] = values
        return target

    def error_bound(self, array: np.ndarray) -> float:
        return 0.0


class Float16:
    name = "fp16"

    def max_payload_bytes(self, n: int) -> int:
        return 2 * n

    def _exponent(self, amax: float) -> int:
        exponent = 0
        if amax > _FP16_MAX:
            exponent = max(0, math.ceil(math.log2(amax / _FP16_MAX)))
            while math.ldexp(amax, -exponent) > _FP16_MAX:
                exponent += 1
        return exponent

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = _chunk(array)
        if not array.size:
            return b"", {}
        lo, hi = finite_range(array)
        exponent = self._exponent(max(-lo, hi))
        if exponent:
            scaled = np.multiply(array, np.float32(math.ldexp(1.0, -exponent)))
            return scaled.astype(np.float16).data.cast("B"), {"e": exponent}
        return array.astype(np.float16).data.cast("B"), {}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        _only_keys(meta, {"e"}, self.name)
        exponent = meta.get("e", 0)
        if isinstance(exponent, bool) or not isinstance(exponent, int) or not 0 <= exponent <= 128:
            raise CompressionError("fp16 meta 'e' must be an integer in [0, 128]")
        view = _check_length(payload, 2 * n, self.name)
        target = _target(out, n)
        if not n:
            return target
        bits = np.frombuffer(view, dtype=np.uint16, count=n)
        # non-negative float16 bit patterns sort like their values: the largest magnitude's bits
        top = int(np.bitwise_and(bits, 0x7FFF).max())
        if top >= 0x7C00:
            raise NonFiniteError("fp16 payload holds NaN or Inf values")
        largest = math.ldexp(float(np.array([top], dtype=np.uint16).view(np.float16)[0]), exponent)
        if largest > _F32_MAX * (1 + 2.0**-10):
            raise CompressionError("fp16 payload overflows float32 once scaled")
        np.copyto(target, bits.view(np.float16), casting="unsafe")
        if exponent:
            with np.errstate(over="ignore"):
                np.multiply(target, np.float32(math.ldexp(1.0, exponent)), out=target)
        if largest > _F32_MAX:  # a value within float16 rounding of float32's max rounded up
            np.clip(target, -_F32_MAX, _F32_MAX, out=target)
        return target

    def error_bound(self, array: np.ndarray) -> float:
        array = _chunk(array)
        if not array.size:
            return 0.0
        lo, hi = finite_range(array)
        amax = max(-lo, hi)
        return max(amax * 2.0**-11, math.ldexp(1.0, self._exponent(amax) - 25)) + SUBNORMAL


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
    view = _check_length(payload, _LEVEL_BYTES + n, name)
    levels = np.frombuffer(view, dtype=np.float32, count=_LEVELS)
    if not np.isfinite(levels).all():
        raise NonFiniteError(f"{name} payload holds non-finite levels")
    codes = np.frombuffer(view, dtype=np.uint8, offset=_LEVEL_BYTES, count=n)
    target = _target(out, n)
    np.take(levels, codes, out=target)
    return target


class Uniform8:
    """8-bit uniform: the meta carries min and step; the decoded value is min + code * step."""

    name = "uint8"

    def max_payload_bytes(self, n: int) -> int:
        return n

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = _chunk(array)
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
        _only_keys(meta, {"lo", "sc"}, self.name)
        lo, step = _number(meta, "lo"), _number(meta, "sc")
        if step < 0 or abs(lo) > _F32_MAX or abs(lo + 255 * step) > _F32_MAX * (1 + 1e-9):
            raise CompressionError("uint8 meta describes levels outside float32")
        view = _check_length(payload, n, self.name)
        target = _target(out, n)
        codes = np.frombuffer(view, dtype=np.uint8, count=n)
        np.take(self._table(lo, step), codes, out=target)
        return target

    def error_bound(self, array: np.ndarray) -> float:
        array = _chunk(array)
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
        array = _chunk(array)
        lo, hi = finite_range(array)
        stride = max(1, array.size // _SAMPLE)
        sample = np.sort(array[::stride])
        picks = np.rint(np.linspace(0, sample.size - 1, _LEVELS)).astype(np.intp)
        levels = sample[picks].copy()
        levels[0], levels[-1] = lo, hi
        return levels

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = _chunk(array)
        if not array.size:
            return bytes(_LEVEL_BYTES), {}
        return _encode_levels(array, self.levels(array)), {}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        _only_keys(meta, set(), self.name)
        return _decode_levels(payload, n, out, self.name)

    def error_bound(self, array: np.ndarray) -> float:
        array = _chunk(array)
        if not array.size:
            return 0.0
        levels = self.levels(array).astype(np.float64)
        magnitude = max(-levels[0], levels[-1])
        return float(np.diff(levels).max(initial=0.0)) / 2 + 2.0**-23 * magnitude + SUBNORMAL


_BLOCK_VALUES = 1 << 16
_COUNT_BYTES = 4
_OFFSET_BYTES = 2


def _blocks(n: int) -> int:
    return -(-n // _BLOCK_VALUES)


def _index_bytes(n: int, k: int) -> int:
    """Bytes of the per-block counts and the k offsets of a sparse chunk of n values."""
    return _COUNT_BYTES * _blocks(n) + _OFFSET_BYTES * k


def _write_positions(positions: np.ndarray, n: int, payload: bytearray) -> None:
    """Counts per block and uint16 offsets of the sorted `positions` into the payload's start."""
    blocks = _blocks(n)
    counts = np.bincount(positions >> 16, minlength=blocks).astype("<u4")
    payload[:_COUNT_BYTES * blocks] = counts.tobytes()
    offsets = np.frombuffer(payload, dtype="<u2", count=positions.size, offset=_COUNT_BYTES * blocks)
    np.bitwise_and(positions, _BLOCK_VALUES - 1, out=offsets, casting="unsafe")


def _read_positions(view: memoryview, n: int, k: int) -> np.ndarray:
    """The k strictly increasing positions (< n) that the payload's index part describes."""
    blocks = _blocks(n)
    counts = np.frombuffer(view, dtype="<u4", count=blocks)
    if int(counts.sum(dtype=np.uint64)) != k:
        raise CompressionError(f"sparse payload's block counts add up to {int(counts.sum(dtype=np.uint64))}, "
                               f"not {k}")
    offsets = np.frombuffer(view, dtype="<u2", count=k, offset=_COUNT_BYTES * blocks)
    bases = np.arange(blocks, dtype=np.int64) << 16
    positions = np.repeat(bases, counts.astype(np.int64))
    positions += offsets
    # offsets < 2^16 and strictly increasing: each position lies in its own block, none twice
    if k and int(positions[-1]) >= n:
        raise CompressionError(f"sparse payload's index {int(positions[-1])} is outside the chunk of {n}")
    if k > 1 and not (positions[1:] > positions[:-1]).all():
        raise CompressionError("sparse payload's indices are not strictly increasing")
    return positions


def _count(meta: Meta, most: int, name: str) -> int:
    k = meta.get("k")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        raise CompressionError(f"{name} meta 'k' must be an integer in [0, {most}]")
    return k


class TopK:
    """Top-k sparsification with 4-bit values (sign + 3-bit magnitude between the smallest and
    the largest magnitude sent); the meta carries k and those two magnitudes ("lo", "hi")."""

    name = "topk"
    density = 64  # one value in 64 is sent (at least one per non-empty chunk)
    _MAGNITUDES = 8

    def budget(self, n: int) -> int:
        """The most values a chunk of n sends: ceil(n / density)."""
        return -(-n // self.density)

    def max_payload_bytes(self, n: int) -> int:
        k = self.budget(n)
        return _index_bytes(n, k) + (k + 1) // 2

    def _picked(self, array: np.ndarray) -> np.ndarray:
        """The sorted positions of the k largest magnitudes, zeros left out.

        A partition of the whole chunk costs ~16 ns a value; instead a strided sample gives a
        threshold that about 2k values pass, and only those are partitioned. When fewer than k
        pass (a sample that misjudged the chunk), the whole chunk is partitioned: the result is
        the exact top k either way, since k values at or above the threshold put the k-th
        largest there too."""
        n, k = array.size, self.budget(array.size)
        magnitudes = np.abs(array)
        if k >= n:
            picked = np.arange(n)
        else:
            candidates = None
            if n > 4 * _SAMPLE:
                sample = magnitudes[::n // _SAMPLE]
                rank = max(0, sample.size - 1 - 2 * (sample.size * k // n) - 8)
                threshold = np.partition(sample, rank)[rank]
                candidates = np.flatnonzero(magnitudes >= threshold)
                if candidates.size < k:
                    candidates = None
            if candidates is None:
                picked = np.argpartition(magnitudes, n - k)[n - k:]
            else:
                chosen = np.argpartition(magnitudes[candidates], candidates.size - k)[candidates.size - k:]
                picked = candidates[chosen]
        picked = picked[magnitudes[picked] > 0]
        picked.sort()
        return picked

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = _chunk(array)
        n = array.size
        if not n:
            return b"", {"k": 0}
        finite_range(array)
        picked = self._picked(array)
        k = picked.size
        payload = bytearray(_index_bytes(n, k) + (k + 1) // 2)
        if not k:
            return payload, {"k": 0}
        _write_positions(picked, n, payload)
        values = array[picked]
        magnitudes = np.abs(values).astype(np.float64)
        lo, hi = float(magnitudes.min()), float(magnitudes.max())
        step = (hi - lo) / (self._MAGNITUDES - 1)
        codes = np.zeros(k + (k & 1), dtype=np.uint8)
        if step > 0:
            levels = np.floor((magnitudes - lo) / step + 0.5)
            np.clip(levels, 0, self._MAGNITUDES - 1, out=levels)
            codes[:k] = levels
        codes[:k] |= (values < 0).view(np.uint8) << 3
        packed = np.frombuffer(payload, dtype=np.uint8, offset=_index_bytes(n, k))
        np.bitwise_or(codes[0::2], codes[1::2] << 4, out=packed)
        return payload, {"k": k, "lo": lo, "hi": hi}

    def _table(self, lo: float, hi: float) -> np.ndarray:
        """The 16 values a 4-bit code stands for: codes 0-7 positive, 8-15 negative."""
        magnitudes = lo + np.arange(self._MAGNITUDES, dtype=np.float64) * ((hi - lo) / (self._MAGNITUDES - 1))
        magnitudes[-1] = hi
        np.minimum(magnitudes, hi, out=magnitudes)
        return np.concatenate([magnitudes, -magnitudes]).astype(np.float32)

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        _only_keys(meta, {"k", "lo", "hi"}, self.name)
        k = _count(meta, self.budget(n), self.name)
        lo = hi = 0.0
        if k or "lo" in meta or "hi" in meta:
            for key in ("lo", "hi"):
                value = meta.get(key)
                if isinstance(value, float) and not math.isfinite(value):
                    raise NonFiniteError(f"topk meta {key!r} is not finite")
            lo, hi = _number(meta, "lo"), _number(meta, "hi")
            if not 0 <= lo <= hi <= _F32_MAX:
                raise CompressionError("topk meta needs 0 <= lo <= hi <= float32's largest value")
        view = _check_length(payload, _index_bytes(n, k) + (k + 1) // 2, self.name)
        target = _target(out, n)
        positions = _read_positions(view, n, k)
        packed = np.frombuffer(view, dtype=np.uint8, offset=_index_bytes(n, k))
        if k & 1 and packed[-1] >> 4:
            raise CompressionError("topk payload's padding nibble is not zero")
        codes = np.empty(2 * packed.size, dtype=np.uint8)
        np.bitwise_and(packed, 0x0F, out=codes[0::2])
        np.right_shift(packed, 4, out=codes[1::2])
        values = np.take(self._table(lo, hi), codes[:k])
        target.fill(0)
        target[positions] = values
        return target

    def error_bound(self, array: np.ndarray) -> float:
        array = _chunk(array)
        n = array.size
        if not n:
            return 0.0
        lo, hi = finite_range(array)
        largest = max(-lo, hi)
        k = self.budget(n)
        threshold = float(np.partition(np.abs(array), n - k)[n - k]) if k < n else 0.0
        worst = max(threshold, (largest - threshold) / (2 * (self._MAGNITUDES - 1)))
        return worst * (1 + 2.0**-20) + 2.0**-23 * largest + SUBNORMAL


class SparseFloat16:
    """What a reducer answers "topk" senders with: every nonzero of the average (uint16 offsets
    in blocks, fp16 values scaled as "fp16" does, meta {"k": count, "e": exponent}), or the
    dense "fp16" payload (meta without "k") when that is smaller. Error: the "fp16" bound."""

    name = "sparse16"
    _dense = Float16()

    def _sparse_bytes(self, n: int, k: int) -> int:
        return _index_bytes(n, k) + 2 * k

    def max_payload_bytes(self, n: int) -> int:
        return self._dense.max_payload_bytes(n)  # sparse only when it is smaller

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = _chunk(array)
        n = array.size
        if not n:
            return b"", {}
        finite_range(array)
        positions = np.flatnonzero(array)
        k = positions.size
        if self._sparse_bytes(n, k) >= self._dense.max_payload_bytes(n):
            return self._dense.encode(array)
        values, meta = self._dense.encode(array[positions])
        payload = bytearray(self._sparse_bytes(n, k))
        _write_positions(positions, n, payload)
        payload[_index_bytes(n, k):] = values
        return payload, {"k": k, **meta}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        _only_keys(meta, {"k", "e"}, self.name)
        if "k" not in meta:
            return self._dense.decode(payload, meta, n, out)
        k = _count(meta, n, self.name)
        if self._sparse_bytes(n, k) >= self._dense.max_payload_bytes(n):
            raise CompressionError(f"sparse16 meta 'k' of {k} is denser than the dense form")
        view = _check_length(payload, self._sparse_bytes(n, k), self.name)
        target = _target(out, n)
        positions = _read_positions(view, n, k)
        scale = {"e": meta["e"]} if "e" in meta else {}
        values = self._dense.decode(view[_index_bytes(n, k):], scale, k)
        target.fill(0)
        target[positions] = values
        return target

    def error_bound(self, array: np.ndarray) -> float:
        return self._dense.error_bound(array)


CODECS: dict[str, Codec] = {codec.name: codec for codec in (NoCompression(), Float16(), Uniform8(),
                                                            Quantile8(), TopK())}
# the codecs reducers answer with where it is not the senders' own (not a choice of its own)
_REPLIES: dict[str, Codec] = {"topk": SparseFloat16()}


def reply_codec(codec: Codec) -> Codec:
    """The codec a reducer encodes its averages with for senders that use `codec`."""
    return _REPLIES.get(codec.name, codec)


def sparsifies(codec: Codec) -> bool:
    """Whether a reducer passes its own contribution through `codec` too: a sparsifying codec
    sends only part of each chunk, and one exact contribution would make the average (and the
    answer) dense and weigh that one member's small values above everyone else's."""
    return codec.name in _REPLIES


def get_codec(name: str) -> Codec:
    """The codec called `name`; CompressionError naming the known ones otherwise."""
    codec = CODECS.get(name)
    if codec is None:
        raise CompressionError(f"unknown compression {name!r} (known: {', '.join(CODECS)})")
    return codec
