"""Error feedback for a lossy codec: what a sender's codec did not convey this round is added to
what it sends next round, so nothing is lost for good, only late (a local-update run's worker
may decay the residual first, `feedback_decay`: then old mass fades on purpose).

    feedback = ErrorFeedback()
    to_send = feedback.prepare(pseudo_gradient)      # pseudo_gradient + residual (a new array)
    ... the all-reduce sends to_send (and overwrites it with the average) ...
    feedback.settle_codec(codec, group.part_bounds, group.chunk_elements)
    # or, if the caller computed it: feedback.settle(what_the_codec_conveyed)
    # or, if the round failed and nothing went out: feedback.abandon()

After `settle`, residual = prepared - conveyed, where conveyed is decode(encode(chunk)) of every
chunk of the prepared vector, cut as the all-reduce cuts it (each part into chunks of
`chunk_elements`): with a sparsifying codec every chunk goes through the codec, the reducer's own
part included (reducing.py). The residual is one float32 array of the vector's size; between
`prepare` and `settle` the prepared vector is held too (the all-reduce overwrites the caller's).
A vector of another size than the residual's starts from a zero residual (logged).

The classic property (tests/averaging/test_error_feedback.py): for a codec whose error on a chunk
is at most a fraction < 1 of the chunk's largest magnitude (topk), the residual stays bounded, so
the sum of what was conveyed over T rounds is the sum of the inputs up to that bounded residual.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import structlog

from .codec import Codec
from .compression import sparsifies

log = structlog.get_logger(__name__)


def chunk_ranges(part_bounds: Sequence[tuple[int, int]], chunk_elements: int) -> Iterator[tuple[int, int]]:
    """The [start, end) of every chunk, as the all-reduce cuts each part (wire.ChunkPlan)."""
    if chunk_elements <= 0:
        raise ValueError(f"chunk_elements must be positive, not {chunk_elements}")
    for start, end in part_bounds:
        for first in range(start, end, chunk_elements):
            yield first, min(first + chunk_elements, end)


def conveyed(codec: Codec, vector: np.ndarray, part_bounds: Sequence[tuple[int, int]],
             chunk_elements: int) -> np.ndarray:
    """What `codec` conveys of `vector`: decode(encode(chunk)) of every chunk (CompressionError
    on NaN/Inf). Elements outside every part are copied unchanged."""
    out = np.array(vector, dtype=np.float32, copy=True)
    for a, b in chunk_ranges(part_bounds, chunk_elements):
        codec.decode(*codec.encode(out[a:b]), b - a, out=out[a:b])
    return out


def unconveyed(codec: Codec, prepared: np.ndarray, part_bounds: Sequence[tuple[int, int]],
               chunk_elements: int, own_part: tuple[int, int]) -> np.ndarray:
    """What a round did not convey of this member's `prepared` vector (a new array): prepared
    minus what `codec` conveys of each chunk, cut as the all-reduce cut it; zero in `own_part`
    unless the codec sparsifies (a reducer keeps its own contribution exact then: reducing.py),
    and everywhere when `chunk_elements` is 0 (the vector was sent to nobody)."""
    if chunk_elements <= 0:
        return np.zeros_like(prepared)
    out = np.subtract(prepared, conveyed(codec, prepared, part_bounds, chunk_elements),
                      dtype=np.float32)
    if not sparsifies(codec):
        start, end = own_part
        out[start:end] = 0.0
    return out


class ErrorFeedback:
    """The residual of one vector (float32, kept by the sender only)."""

    def __init__(self) -> None:
        self._residual: np.ndarray | None = None
        self._prepared: np.ndarray | None = None

    @property
    def residual(self) -> np.ndarray | None:
        """The current residual (read only; None before the first round)."""
        if self._residual is None:
            return None
        view = self._residual.view()
        view.flags.writeable = False
        return view

    @property
    def pending(self) -> bool:
        """Whether a prepared vector waits for `settle` or `abandon`."""
        return self._prepared is not None

    def prepare(self, vector: np.ndarray) -> np.ndarray:
        """vector + residual, as a new float32 array to send (a pending round is abandoned)."""
        if not isinstance(vector, np.ndarray) or vector.ndim != 1:
            raise ValueError("error feedback needs a one-dimensional vector")
        if self._residual is None or self._residual.size != vector.size:
            if self._residual is not None:
                log.info("error_feedback_reset", old_size=int(self._residual.size), new_size=int(vector.size))
            self._residual = np.zeros(vector.size, np.float32)
        prepared = np.add(vector, self._residual, dtype=np.float32)
        if not np.isfinite(prepared).all():
            raise ValueError("the vector plus its residual holds NaN or Inf")
        self._prepared = prepared.copy()
        return prepared

    def settle(self, sent: np.ndarray) -> None:
        """The round went out: residual = prepared - `sent` (what the codec conveyed)."""
        if self._prepared is None or self._residual is None:
            raise RuntimeError("settle without a prepared vector")
        if not isinstance(sent, np.ndarray) or sent.shape != self._prepared.shape:
            raise ValueError(f"settle needs a vector of shape {self._prepared.shape}")
        np.subtract(self._prepared, sent, out=self._residual, dtype=np.float32)
        self._prepared = None

    def settle_codec(self, codec: Codec, part_bounds: Sequence[tuple[int, int]], chunk_elements: int) -> None:
        """`settle` with what `codec` conveys of the prepared vector, chunk by chunk as the
        all-reduce cut it (no vector-sized temporary)."""
        prepared, residual = self._prepared, self._residual
        if prepared is None or residual is None:
            raise RuntimeError("settle without a prepared vector")
        covered = 0
        for a, b in chunk_ranges(part_bounds, chunk_elements):
            if b > prepared.size:
                raise ValueError(f"chunk [{a}, {b}) is outside the vector of {prepared.size}")
            codec.decode(*codec.encode(prepared[a:b]), b - a, out=residual[a:b])
            np.subtract(prepared[a:b], residual[a:b], out=residual[a:b])
            covered += b - a
        if covered != prepared.size:
            raise ValueError(f"the parts cover {covered} of {prepared.size} elements")
        self._prepared = None

    def abandon(self) -> None:
        """The round failed before anything counted: keep the residual as it was."""
        self._prepared = None

    def reset(self) -> None:
        self._residual = None
        self._prepared = None

    # --- checkpoints --------------------------------------------------------------------------
    def state(self) -> np.ndarray:
        """A copy of the residual for a checkpoint (empty before the first round)."""
        return np.zeros(0, np.float32) if self._residual is None else self._residual.copy()

    def load(self, state: np.ndarray, size: int | None = None) -> None:
        """Restore a residual from `state`; refused (ValueError) unless it is a finite 1-D float32
        array. An empty state, or one whose size is not `size` (when given), starts from zero."""
        if not isinstance(state, np.ndarray) or state.dtype != np.float32 or state.ndim != 1:
            raise ValueError("an error feedback state is a one-dimensional float32 array")
        if not np.isfinite(state).all():
            raise ValueError("an error feedback state holds NaN or Inf")
        self._prepared = None
        if not state.size or (size is not None and state.size != size):
            if state.size:
                log.info("error_feedback_reset", old_size=int(state.size), new_size=size)
            self._residual = None
            return
        self._residual = state.copy()
