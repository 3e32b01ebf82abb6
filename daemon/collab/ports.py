"""The narrow ports a run's engine (engine.py) works through, and the values that cross them.

- `ProgressBoard`: where the run's peers publish their progress and read each other's (the DHT:
  board.py; a local run's board holds only its own).
- `RoundAverager`: averaging rounds with the peers under one key (the node's averager:
  rounds.py; a local run averages alone).
- `StateSource`: downloads of a peer's state (state_sync.py).
- `Trainer`: the model: a worker process (worker_trainer.py) or, in the simulator, vectors.
Implementations are injected; the engine never reaches past these.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..averaging.report import AveragingReport
from .estimate import Head
from .progress import PeerProgress, Role

__all__ = [
    "DownloadedState",
    "ProgressBoard",
    "RoundAverager",
    "StateBuffer",
    "StateDonor",
    "StateSource",
    "Trained",
    "Trainer",
    "TrainerRefused",
]


class ProgressBoard(Protocol):
    async def publish(self, report: PeerProgress) -> bool:
        """Publish this peer's report (best effort: a failure is logged, not raised); whether
        it was stored (the engine publishes a report it could not store again at once)."""

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        """The peers' valid reports and, per peer, when (on our clock) its report was first
        read."""

    async def leave(self, report: PeerProgress) -> None:
        """Publish this peer's farewell: rounds stop expecting it at once."""


class RoundAverager(Protocol):
    @property
    def max_group_size(self) -> int:
        """The most peers one group holds (0: no limit); a round of more is a grid round."""

    async def average(self, vector: np.ndarray, key: str, *, weight: float, expected: int,
                      role: Role, compression: str = "none", aggregation: str = "mean",
                      min_trainers: int = 1,
                      peers: tuple[str, ...] = (), leaders: tuple[str, ...] = (),
                      aux: tuple[str, ...] = (), cells: tuple[str, ...] = (),
                      max_weight: float | None = None, weight_budget: float | None = None,
                      settled: tuple[str, ...] = ()) -> AveragingReport | None:
        """Average `vector` (float32, in place) with the peers averaging under the run's `key`
        (its reducers combining contributions by `aggregation`: averaging/aggregation.py),
        waiting (a while) for at least `min_trainers` trainers; `peers` are the ones expected
        (no search for them is needed; `aux`: which of them are aux peers), `leaders` those
        that may lead first, and `cells` the trainers that hold the cells of a grid round (a
        list every peer agrees on; default: `leaders`); no member may claim a weight over
        `max_weight` (what an honest peer of the round can have: the target batch), and each
        member's vector weighs at most its share of `weight_budget` by the trainers it stands for
        (Group.bounded_weights; None: as claimed). `settled`:
        the trainers this peer has seen at the head for a while (itself included when it has
        been there as long): when neither `cells` nor `leaders` are known, a grid round's cells
        go to a roster drawn from them (roster.py). The round's report, or None if no round
        could run; RoundSatOut (errors.py) for a peer a grid round has no room for."""

    def refused(self, peers: Collection[str]) -> frozenset[str]:
        """Those of `peers` this peer's averaging refuses to average with (banned here)."""

    def round_over(self, key: str) -> None:
        """This peer has moved past the round under the run's `key` (and its grid stages): it
        will not gather under it again, and tells peers that ask to join it late."""

    async def roster_published(self, key: str, trainers: Collection[str], *,
                               timeout: float) -> bool:
        """Whether a grid round of `key` has begun: one of its first writers, as this peer's
        view of the `trainers` at the head ranks them, has published a roster that agrees with
        that view (roster.py); read within `timeout` seconds (else False)."""


class StateBuffer(Protocol):
    """Where a state lives while it moves (a shared-memory segment for a worker)."""

    @property
    def array(self) -> np.ndarray: ...

    def close(self) -> None: ...


@dataclass
class DownloadedState:
    """A peer's state: `numel` float32 values in `buffer`, the worker's `meta`, and the head
    (epoch and lineage) it is at. The receiver closes the buffer."""

    buffer: StateBuffer
    numel: int
    meta: dict[str, Any]
    epoch: int
    lineage: str | None
    group: tuple[str, ...] = ()  # the members of the round that made this head (they lead next)

    def close(self) -> None:
        self.buffer.close()


class StateDonor(Protocol):
    """What serves a run's state to peers that download it (state_sync.py): a running run's
    engine, or a finished run's final state (final_state.py)."""

    phase: Any  # a PhaseCell: the server waits for it to leave a round
    progress: Any  # the run's RunProgress: `states_served` counts what was served

    @property
    def holds_state(self) -> bool:
        """Whether it can serve a state now."""

    async def export_state(self) -> DownloadedState:
        """The state it holds now, with its head; the caller closes the buffer."""


class StateSource(Protocol):
    async def download(self, donor: str, expect: Head | None = None,
                       others: int = 0) -> DownloadedState:
        """The state `donor` holds now; StateSyncError (DonorBusy when it is busy,
        DonorContradicted when it offers a state behind or beside `expect`, the head it reported).
        `others`: how many other donors we could ask instead (state_sync.py, "a flash crowd")."""

    async def witness(self, peer: str, state: DownloadedState) -> bool | None:
        """Whether `peer`, at the state's head, holds parameters that agree with the state's
        (state_check.py); None when it cannot say."""


@dataclass(frozen=True)
class Trained:
    samples: int
    loss: float
    samples_per_second: float | None


class TrainerRefused(Exception):
    """The trainer would not take a vector or state (wrong layout, NaN): nothing changed."""


class Trainer(Protocol):
    """The model of a trainer run. One call at a time (the engine and state donations share it:
    implementations serialise them)."""

    async def train(self, samples: int, seconds: float) -> Trained:
        """Accumulate gradients over about `samples` samples, for at most about `seconds`."""

    async def export_gradients(self) -> np.ndarray:
        """The mean accumulated gradients, in a vector the trainer owns (valid until the next
        call); averaging changes it in place and `step` applies it."""

    async def step(self, epoch: int) -> float | None:
        """Apply the vector of `export_gradients` as the gradients of global step `epoch`, clear
        the accumulation; the learning rate used."""

    async def zero_grad(self) -> None: ...

    async def settle_residual(self, residual: np.ndarray) -> None:
        """A local-update run with a lossy codec: replace the error-feedback residual (what the
        last exchange did not convey of the exported vector; added to the next one)."""

    async def export_state(self) -> DownloadedState:
        """The whole state (parameters, optimizer, buffers) in a new buffer the caller closes;
        epoch and lineage are left for the caller to fill in."""

    async def load_state(self, state: DownloadedState) -> None:
        """Take a state (a download or an averaged one); TrainerRefused if it does not fit."""
