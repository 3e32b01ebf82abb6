"""What one peer has done in a run (`RunProgress`, checkpointed with the model) and the phase its
engine is in (`PhaseCell`, awaitable): shared by the engine and its parts (round_taking.py,
catching_up.py) and read by `run.status`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["IN_ROUND", "Phase", "PhaseCell", "RunProgress"]

Phase = Literal["idle", "training", "syncing", "averaging", "stepping", "averaging_state",
                "downloading_state", "checkpointing", "paused", "lingering", "waiting"]
#: While in these phases the state is about to change: a donor serves it after the round.
IN_ROUND: tuple[Phase, ...] = ("averaging", "stepping", "averaging_state")


@dataclass
class RunProgress:
    """What this peer has done in the run (checkpointed with the model)."""

    epoch: int = 0
    lineage: str | None = None
    samples: int = 0
    accumulated: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    samples_per_second: float | None = None
    epoch_losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    rounds: int = 0
    failed_rounds: int = 0
    rounds_sat_out: int = 0  # grid rounds with no slice for this peer (helpers beyond the room)
    state_rounds: int = 0
    failed_state_rounds: int = 0
    state_downloads: int = 0
    failed_state_downloads: int = 0
    refuted_states: int = 0  # downloaded states that witnesses at their head contradicted
    unverified_states: int = 0  # loaded with no witness able to say (none at the head)
    unanswered_states: int = 0  # not loaded: witnesses at the head could not say (asked again)
    reports_beyond_pace: int = 0  # peers seen claiming an epoch our pace of the run rules out
    reports_unserved: int = 0  # peers passed over: ahead of us, and their state failed us lately
    states_served: int = 0  # downloads of our state that we served to others (published)
    restarts: int = 0
    lr: float | None = None  # the learning rate of the last step


class PhaseCell:
    """A phase that can be awaited: `wait_until(predicate)` returns once it holds."""

    def __init__(self, value: Phase = "idle") -> None:
        self.value: Phase = value
        self._changed = asyncio.Event()

    def set(self, value: Phase) -> None:
        if value != self.value:
            self.value = value
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[Phase], bool], timeout: float) -> bool:
        """True once `predicate(phase)` holds, False if it did not within `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate(self.value):
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True
