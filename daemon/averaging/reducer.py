"""A reducer's part, chunk by chunk: what each sender contributed, and the average. No I/O.

For every chunk the reducer tracks which senders it still waits for and how many contributions
are being added right now. A chunk is settled once it waits for nobody and adds nothing; its
average is then taken over the senders that delivered it (a sender dropped before delivering it is
simply not in it). A chunk that nobody delivered has no average (every member keeps its local
value there). Every contribution is screened as it is added (screening.py: the hard cap).

Two ways to hold the contributions:
- running sums (`keep` False): sums[chunk] += weight * values as each arrives; one part-sized
  array whatever the number of senders;
- kept (`keep` True, when the norm rule, the answers' accounts or the aggregation need them:
  screening.py, aggregation.py): each sender's chunk is kept in a row of a (senders x chunk)
  array until the chunk settles; then the norm outliers are rejected and the rest aggregated by
  the round's rule (`aggregation`: the weighted mean or the norm-clipped mean), or by centered
  clipping where this daemon opts in (`policy.robust`). A sender left out for an offence
  (`discard`) is removed from every chunk not settled yet.

The bookkeeping (`take`, `added`, `released`, `drop`, `discard`) runs on the event loop; `add`,
`average` and `row` may run in worker threads (numpy releases the GIL): they take the chunk's lock
around what they share.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import structlog

from .aggregation import MIN_CLIP_SENDERS, Aggregation, clip_scales, l2_norm, weighted_mean
from .clipping import centered_clip
from .screening import ScreeningPolicy, norm_outliers, screen
from .wire import ChunkPlan

log = structlog.get_logger(__name__)


class Contribution(NamedTuple):
    """A sender's chunk as it went into an answer."""

    sender: int
    weight: float
    values: np.ndarray  # as the reducer decoded it
    norm: float | None  # its l2_norm (None where neither the account nor the rule needs it)
    scale: float = 1.0  # s_i of the norm-clipped mean (1: not clipped)


class PartReducer:
    def __init__(self, plan: ChunkPlan, senders: Iterable[int], *,
                 policy: ScreeningPolicy | None = None, own: int | None = None,
                 aggregation: Aggregation = "mean") -> None:
        self.plan = plan
        self.policy = policy or ScreeningPolicy()
        self.own = own  # the reducer's own sender index: never rejected by the norm rule
        self.senders = sorted(frozenset(senders))
        # the round's rule (aggregation.py); this daemon's centered clipping overrides it
        self.aggregation: Aggregation = aggregation
        self.keep = self.policy.keeps(len(self.senders)) or (
            aggregation == "norm_clip" and len(self.senders) >= MIN_CLIP_SENDERS)
        self._row = {sender: row for row, sender in enumerate(self.senders)}
        # running sums, averaged in place; when kept, the averages only (the payloads sent back)
        self.sums = np.empty(plan.size, dtype=np.float32)
        self._waiting = [set(self.senders) for _ in range(plan.count)]
        self._busy = [0] * plan.count
        self._weight = [0.0] * plan.count
        self._empty = [True] * plan.count  # guarded by the chunk's lock
        self._locks = [threading.Lock() for _ in range(plan.count)]
        self._settled = [False] * plan.count
        # kept contributions: the chunk's rows, and per sender its (weight, norm); chunk's lock
        self._rows: list[np.ndarray | None] = [None] * plan.count
        self._kept: list[dict[int, tuple[float, float]]] = [{} for _ in range(plan.count)]
        self._discarded: set[int] = set()

    # --- bookkeeping (event loop) -------------------------------------------------------------
    def expects(self, sender: int, index: int) -> bool:
        return sender in self._waiting[index]

    def take(self, sender: int, index: int) -> None:
        """`sender`'s chunk `index` arrived and is about to be added."""
        self._waiting[index].remove(sender)
        self._busy[index] += 1

    def added(self, index: int, weight: float) -> bool:
        """The contribution taken for chunk `index` is in; True if the chunk settled."""
        self._busy[index] -= 1
        self._weight[index] += weight
        return self._settle(index)

    def released(self, index: int) -> bool:
        """The contribution taken for chunk `index` was not added after all (a bad chunk)."""
        self._busy[index] -= 1
        return self._settle(index)

    def drop(self, sender: int) -> list[int]:
        """Leave `sender` out of every chunk it has not delivered; the chunks that settled."""
        settled = []
        for index, waiting in enumerate(self._waiting):
            if sender in waiting:
                waiting.discard(sender)
                if self._settle(index):
                    settled.append(index)
        return settled

    def discard(self, sender: int) -> None:
        """Leave `sender` out of the chunks it delivered that have not settled yet too (kept
        contributions only: a running sum cannot give a contribution back)."""
        self._discarded.add(sender)
        for index, kept in enumerate(self._kept):
            if not self._settled[index] and sender in kept:
                with self._locks[index]:
                    kept.pop(sender, None)

    def pending(self, sender: int) -> bool:
        """Whether some chunk still waits for `sender`."""
        return any(sender in waiting for waiting in self._waiting)

    def weight(self, index: int) -> float:
        return self._weight[index]

    def _settle(self, index: int) -> bool:
        if self._settled[index] or self._waiting[index] or self._busy[index]:
            return False
        self._settled[index] = True
        return True

    # --- numpy (any thread) -------------------------------------------------------------------
    def row(self, index: int, sender: int) -> np.ndarray | None:
        """Where to decode `sender`'s chunk `index` straight into (kept mode), else None."""
        if not self.keep:
            return None
        first, last = self.plan.relative(index)
        with self._locks[index]:
            rows = self._rows[index]
            if rows is None:
                rows = self._rows[index] = np.empty((len(self.senders), last - first), np.float32)
        return rows[self._row[sender]]

    def add(self, index: int, sender: int, values: np.ndarray, weight: float,
            scratch: np.ndarray | None = None) -> None:
        """Screen `sender`'s chunk `index` (ContributionRejected if it breaks the hard cap), then
        add it: kept (copied into its row unless it was decoded there) or into the running sums
        (`scratch`, which may be `values` itself, holds the weighted product)."""
        norm = screen(values, self.policy)
        if self.keep:
            target = self.row(index, sender)
            assert target is not None
            if target.ctypes.data != values.ctypes.data:  # not decoded into its row already
                np.copyto(target, values)
            with self._locks[index]:
                if sender not in self._discarded:
                    self._kept[index][sender] = (weight, norm)
            return
        first, last = self.plan.relative(index)
        if scratch is None:
            product = np.multiply(values, np.float32(weight))
        else:
            product = scratch[:last - first]
            np.multiply(values, np.float32(weight), out=product)
        target = self.sums[first:last]
        with self._locks[index]:
            if self._empty[index]:
                np.copyto(target, product)
                self._empty[index] = False
            else:
                np.add(target, product, out=target)

    def average(self, index: int) -> tuple[np.ndarray | None, dict[int, str], list[Contribution]]:
        """The settled chunk's average (a view of `sums`; None if no contribution is left), the
        senders rejected now by the norm rule, with why, and (kept mode) the contributions that
        went into it, for the answer's account (accounts.py) and the counters."""
        first, last = self.plan.relative(index)
        out = self.sums[first:last]
        if not self.keep:
            total = self._weight[index]
            if total <= 0:
                return None, {}, []
            np.multiply(out, np.float32(1.0 / total), out=out)
            return out, {}, []
        with self._locks[index]:
            kept = {s: v for s, v in self._kept[index].items() if s not in self._discarded}
            rows = self._rows[index]
            self._kept[index] = {}
            self._rows[index] = None  # freed once averaged
        rejected = norm_outliers({s: norm for s, (_, norm) in kept.items()}, self.policy.max_norm_ratio,
                                 protected=self.own)
        accepted = [s for s in self.senders if s in kept and s not in rejected]
        if not accepted or rows is None:
            return None, rejected, []
        weights = [kept[s][0] for s in accepted]
        chosen = [rows[self._row[s]] for s in accepted]
        if self.policy.robust == "centered_clip":
            matrix = rows if len(accepted) == len(self.senders) else rows[[self._row[s] for s in accepted]]
            centered_clip(matrix, weights, self.policy.clip_radius, self.policy.clip_iterations, out)
            return out, rejected, [Contribution(s, w, row, None)
                                   for s, w, row in zip(accepted, weights, chosen, strict=True)]
        clipping = self.aggregation == "norm_clip"
        norms = [l2_norm(row) for row in chosen] if clipping or self.policy.check_answers else None
        scales = clip_scales(weights, norms) if clipping and norms is not None \
            else (1.0,) * len(chosen)
        weighted_mean(chosen, weights, out, scales)
        used = [Contribution(*fields) for fields in zip(
            accepted, weights, chosen, norms or [None] * len(chosen), scales, strict=True)]
        if norms is not None and any(scale < 1.0 for scale in scales):
            log.debug("contributions_clipped", chunk=index,
                      clipped={str(c.sender): round(c.scale, 6) for c in used if c.scale < 1.0},
                      norms=[round(n, 6) for n in norms])
        return out, rejected, used
