"""The sparse codecs: "topk" and "sparse16", the codec a reducer answers "topk" senders with
(compression.py's `reply_codec`). Error bounds (per element, |decoded - original|):

- "topk":  sparse: only the k = ceil(n / 64) values of largest magnitude are sent (zeros among
           them are left out), each in 4 bits: a sign and one of 8 uniform magnitudes from the
           smallest sent magnitude t to the largest, a; the rest decodes to 0. A dropped value has
           |x| <= t, a sent one is off by at most half a step, so
           |err| <= max(t, (a - t) / 14) (+ 2^-20 of that + 2^-23 * a). That bound is per element
           but loose by design for the dropped values: the error is most of the chunk's small
           values, which the sender carries over to its next round (error_feedback.py).
- "sparse16": every nonzero, fp16 values, or dense fp16 when that is smaller: the "fp16" bound.

Index layout of the sparse codecs: the chunk is cut into blocks of 65536 values; the payload
holds the count of sent values per block (uint32, little-endian), then each sent value's offset
within its block (uint16), in increasing order, then the values.
"""

from __future__ import annotations

import math

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
from .float_codecs import Float16

_SAMPLE = 16384  # values in the strided sample that sets topk's threshold

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
        array = as_chunk(array)
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
        check_meta_keys(meta, {"k", "lo", "hi"}, self.name)
        k = _count(meta, self.budget(n), self.name)
        lo = hi = 0.0
        if k or "lo" in meta or "hi" in meta:
            for key in ("lo", "hi"):
                value = meta.get(key)
                if isinstance(value, float) and not math.isfinite(value):
                    raise NonFiniteError(f"topk meta {key!r} is not finite")
            lo, hi = meta_number(meta, "lo"), meta_number(meta, "hi")
            if not 0 <= lo <= hi <= F32_MAX:
                raise CompressionError("topk meta needs 0 <= lo <= hi <= float32's largest value")
        view = check_length(payload, _index_bytes(n, k) + (k + 1) // 2, self.name)
        target = decode_target(out, n)
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
        array = as_chunk(array)
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
        array = as_chunk(array)
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
        check_meta_keys(meta, {"k", "e"}, self.name)
        if "k" not in meta:
            return self._dense.decode(payload, meta, n, out)
        k = _count(meta, n, self.name)
        if self._sparse_bytes(n, k) >= self._dense.max_payload_bytes(n):
            raise CompressionError(f"sparse16 meta 'k' of {k} is denser than the dense form")
        view = check_length(payload, self._sparse_bytes(n, k), self.name)
        target = decode_target(out, n)
        positions = _read_positions(view, n, k)
        scale = {"e": meta["e"]} if "e" in meta else {}
        values = self._dense.decode(view[_index_bytes(n, k):], scale, k)
        target.fill(0)
        target[positions] = values
        return target

    def error_bound(self, array: np.ndarray) -> float:
        return self._dense.error_bound(array)
