"""The float codecs: "none" and "fp16". Error bounds (per element, |decoded - original|):

- "none":  exact (the payload is the float32 bytes themselves, no copy).
- "fp16":  values scaled by 2^-e (e = 0 unless |x| > 65504, so nothing overflows), rounded to
           the nearest float16: |err| <= max(2^-11 * max|x|, 2^(e-25)).
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
)

_FP16_MAX = 65504.0


class NoCompression:
    name = "none"

    def max_payload_bytes(self, n: int) -> int:
        return 4 * n

    def encode(self, array: np.ndarray) -> tuple[Buffer, Meta]:
        array = as_chunk(array)
        if array.size:
            finite_range(array)
        return array.data.cast("B"), {}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        check_meta_keys(meta, set(), self.name)
        view = check_length(payload, 4 * n, self.name)
        values = np.frombuffer(view, dtype=np.float32, count=n)
        if n:
            finite_range(values)
        if out is None:
            return values  # a view of the payload itself (writable when the payload is)
        target = decode_target(out, n)
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
        array = as_chunk(array)
        if not array.size:
            return b"", {}
        lo, hi = finite_range(array)
        exponent = self._exponent(max(-lo, hi))
        if exponent:
            scaled = np.multiply(array, np.float32(math.ldexp(1.0, -exponent)))
            return scaled.astype(np.float16).data.cast("B"), {"e": exponent}
        return array.astype(np.float16).data.cast("B"), {}

    def decode(self, payload: Buffer, meta: Meta, n: int, out: np.ndarray | None = None) -> np.ndarray:
        check_meta_keys(meta, {"e"}, self.name)
        exponent = meta.get("e", 0)
        if isinstance(exponent, bool) or not isinstance(exponent, int) or not 0 <= exponent <= 128:
            raise CompressionError("fp16 meta 'e' must be an integer in [0, 128]")
        view = check_length(payload, 2 * n, self.name)
        target = decode_target(out, n)
        if not n:
            return target
        bits = np.frombuffer(view, dtype=np.uint16, count=n)
        # non-negative float16 bit patterns sort like their values: the largest magnitude's bits
        top = int(np.bitwise_and(bits, 0x7FFF).max())
        if top >= 0x7C00:
            raise NonFiniteError("fp16 payload holds NaN or Inf values")
        largest = math.ldexp(float(np.array([top], dtype=np.uint16).view(np.float16)[0]), exponent)
        if largest > F32_MAX * (1 + 2.0**-10):
            raise CompressionError("fp16 payload overflows float32 once scaled")
        np.copyto(target, bits.view(np.float16), casting="unsafe")
        if exponent:
            with np.errstate(over="ignore"):
                np.multiply(target, np.float32(math.ldexp(1.0, exponent)), out=target)
        if largest > F32_MAX:  # a value within float16 rounding of float32's max rounded up
            np.clip(target, -F32_MAX, F32_MAX, out=target)
        return target

    def error_bound(self, array: np.ndarray) -> float:
        array = as_chunk(array)
        if not array.size:
            return 0.0
        lo, hi = finite_range(array)
        amax = max(-lo, hi)
        return max(amax * 2.0**-11, math.ldexp(1.0, self._exponent(amax) - 25)) + SUBNORMAL
