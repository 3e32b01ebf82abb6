"""What a per-chunk codec of the all-reduce is (compression.py names them), and the checks every
codec makes.

Each codec is stateless: `encode(chunk)` gives a raw payload (bytes-like; it never goes through
JSON) and a small JSON-able meta dict; `decode(payload, meta, n, out=None)` gives the n float32
values back (written into `out` when given); `error_bound(chunk)` computes the codec's bound on
|decoded - original| per element for a chunk (each codec's module states its bound).

Every `encode` refuses NaN/Inf input and every `decode` checks the payload length and the meta,
and never writes a non-finite value into `out` (it validates before writing): both raise
`CompressionError`, and the caller rejects the chunk. Everything is vectorised numpy that releases
the GIL, so callers may run it in threads.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from .errors import AveragingError

Buffer = bytes | bytearray | memoryview
Meta = dict[str, Any]

F32_MAX = float(np.finfo(np.float32).max)

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


def as_chunk(array: np.ndarray) -> np.ndarray:
    """The chunk as a contiguous array; CompressionError unless it is one-dimensional float32."""
    if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.ndim != 1:
        raise CompressionError("a chunk must be a one-dimensional float32 array")
    return np.ascontiguousarray(array)


def finite_range(array: np.ndarray) -> tuple[float, float]:
    """(min, max) of a non-empty float32 array; CompressionError if it holds NaN or Inf."""
    lo, hi = float(array.min()), float(array.max())  # NaN propagates through min/max
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise NonFiniteError("the chunk holds NaN or Inf values")
    return lo, hi


def decode_target(out: np.ndarray | None, n: int) -> np.ndarray:
    """Where a decode writes its n values: `out` (checked) or a new array."""
    if out is None:
        return np.empty(n, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (n,):
        raise CompressionError(f"decode target must be float32 of shape ({n},)")
    return out


def check_length(payload: Buffer, expected: int, name: str) -> memoryview:
    """The payload as bytes; CompressionError unless it is `expected` bytes long."""
    view = memoryview(payload).cast("B")
    if len(view) != expected:
        raise CompressionError(f"{name} payload of {len(view)} bytes, expected {expected}")
    return view


def meta_number(meta: Meta, key: str) -> float:
    """meta[key] as a float; CompressionError unless it is a finite number."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CompressionError(f"codec meta {key!r} must be a finite number")
    return float(value)


def check_meta_keys(meta: Meta, allowed: set[str], name: str) -> None:
    """CompressionError unless the meta is a dict with no key outside `allowed`."""
    if not isinstance(meta, dict) or not set(meta) <= allowed:
        raise CompressionError(f"bad {name} meta: {str(meta)[:100]}")
