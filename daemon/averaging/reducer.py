"""A reducer's running sums for its part, chunk by chunk. No I/O.

For every chunk the reducer tracks which senders it still waits for, how many contributions are
being added right now, and the total weight added. A chunk is settled once it waits for nobody
and adds nothing: its average is then the weighted sum over the total weight of the senders that
delivered it (a sender dropped before delivering it is simply not in it). A chunk that nobody
delivered has no average (every member keeps its local value there).

The bookkeeping (`take`, `added`, `released`, `drop`) runs on the event loop; `add` and `average`
are the numpy work and may run in worker threads: `add` holds the chunk's lock while it sums.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from .wire import ChunkPlan


class PartReducer:
    def __init__(self, plan: ChunkPlan, senders: Iterable[int]) -> None:
        self.plan = plan
        self.sums = np.empty(plan.size, dtype=np.float32)
        expected = frozenset(senders)
        self._waiting = [set(expected) for _ in range(plan.count)]
        self._busy = [0] * plan.count
        self._weight = [0.0] * plan.count
        self._empty = [True] * plan.count  # guarded by the chunk's lock
        self._locks = [threading.Lock() for _ in range(plan.count)]
        self._settled = [False] * plan.count

    # --- bookkeeping (event loop) -------------------------------------------------------------
    def expects(self, sender: int, index: int) -> bool:
        return sender in self._waiting[index]

    def take(self, sender: int, index: int) -> None:
        """`sender`'s chunk `index` arrived and is about to be added."""
        self._waiting[index].remove(sender)
        self._busy[index] += 1

    def added(self, index: int, weight: float) -> bool:
        """The contribution taken for chunk `index` is in the sums; True if the chunk settled."""
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
    def add(self, index: int, values: np.ndarray, weight: float, scratch: np.ndarray | None) -> None:
        """sums[chunk] += weight * values; `scratch` (may be `values` itself) holds the product."""
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

    def average(self, index: int) -> np.ndarray | None:
        """The settled chunk's weighted average (in place of its sums), None if nobody delivered."""
        total = self._weight[index]
        if total <= 0:
            return None
        first, last = self.plan.relative(index)
        target = self.sums[first:last]
        np.multiply(target, np.float32(1.0 / total), out=target)
        return target
