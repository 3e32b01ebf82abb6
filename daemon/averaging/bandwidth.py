"""Bandwidth estimates from observed transfers, for the load balancer's `Member.upload/download`.

Each direction keeps an exponentially weighted moving average of observed rates (bytes / seconds),
starting from the configured guess: after k accepted samples of a constant rate x the estimate is
x + (guess − x)·2^(−k / half_life_samples). Transfers smaller than `min_bytes` or quicker than
`min_seconds` are ignored: their duration is mostly latency and set-up, not bandwidth.
"""

from __future__ import annotations

import math

__all__ = ["BandwidthEstimator"]

MIN_BYTES = 256 * 1024
MIN_SECONDS = 0.01


def _positive(name: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, not {value!r}")
    return float(value)


class BandwidthEstimator:
    """Upload and download rates of this peer (bytes/s), learned from its transfers. Pure and
    deterministic; not thread-safe."""

    def __init__(self, initial_upload: float, initial_download: float, *, half_life_samples: float = 5.0,
                 min_bytes: int = MIN_BYTES, min_seconds: float = MIN_SECONDS) -> None:
        self._upload = _positive("initial_upload", initial_upload)
        self._download = _positive("initial_download", initial_download)
        self._alpha = 1.0 - 0.5 ** (1.0 / _positive("half_life_samples", half_life_samples))
        if min_bytes < 0 or not math.isfinite(min_seconds) or min_seconds < 0:
            raise ValueError("min_bytes and min_seconds must be non-negative")
        self._min_bytes = min_bytes
        self._min_seconds = min_seconds
        self._upload_samples = 0
        self._download_samples = 0

    @property
    def upload(self) -> float:
        """Estimated upload rate in bytes/s."""
        return self._upload

    @property
    def download(self) -> float:
        """Estimated download rate in bytes/s."""
        return self._download

    @property
    def samples(self) -> int:
        """Accepted observations so far, both directions together."""
        return self._upload_samples + self._download_samples

    @property
    def upload_samples(self) -> int:
        return self._upload_samples

    @property
    def download_samples(self) -> int:
        return self._download_samples

    def observe_upload(self, size: float, seconds: float) -> bool:
        """Record that `size` bytes went out in `seconds`; True when the sample was used."""
        rate = self._rate(size, seconds)
        if rate is None:
            return False
        self._upload += self._alpha * (rate - self._upload)
        self._upload_samples += 1
        return True

    def observe_download(self, size: float, seconds: float) -> bool:
        """Record that `size` bytes came in within `seconds`; True when the sample was used."""
        rate = self._rate(size, seconds)
        if rate is None:
            return False
        self._download += self._alpha * (rate - self._download)
        self._download_samples += 1
        return True

    def _rate(self, size: float, seconds: float) -> float | None:
        if not (math.isfinite(size) and math.isfinite(seconds)) or size < 0 or seconds < 0:
            raise ValueError(f"a transfer needs a finite non-negative size and duration, not "
                             f"{size!r} bytes in {seconds!r} s")
        if size < self._min_bytes or seconds < self._min_seconds or seconds == 0 or size == 0:
            return None
        return size / seconds
