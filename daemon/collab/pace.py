"""How far ahead of this peer the run can honestly be, by the pace this peer saw it move. Pure:
no I/O, time passed in (the engine passes its monotonic clock: a wall clock set back would
hold the bound down).

A progress report's epoch is its writer's word, and identities are free: a third of the
trainers reporting a far epoch would otherwise be the run's head (estimate.py), and every honest
peer would try to catch up with them. What a peer has seen itself is evidence: the epoch it
stepped into (or loaded, verified by witnesses) and when, and the durations of its last steps,
each an epoch of samples that the peers it averaged with computed. The run cannot move faster
than its recent pace (the median of this peer's last epochs), sped up by `PACE_SLACK` (a swarm
that grows, a flash crowd of newcomers, shortens epochs, but not eight-fold between two of this
peer's looks). So an epoch beyond

    anchor + 1 + floor(PACE_SLACK * (now - anchored_at) / median recent epoch)

is not believed (`EpochPace.bound`): the reports that claim one are not counted for the run's
head or its samples (estimate.py's `max_epoch`), and are counted as such; their writers still
count among the trainers a step needs a majority of (a peer that believes no one else must not
step alone). It stops far claims only: liars a third of the trainers strong at the head plus
one are believed (docs/security.md). The bound grows with the
time since this peer last stepped: a peer back from a pause or from the smaller side of a
partition follows the run, which moved at most at its pace meanwhile; a liar's far epoch stays
out, and a claim a few epochs ahead is believed only once that many epochs could have passed.

Without two consecutive steps of its own (a newcomer, a restart) a peer has no pace: no bound
(a run that starts with liars is guarded by estimate.py's rule for fresh peers only).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["PACE_EPOCHS", "PACE_SLACK", "EpochPace"]

#: How much faster than its recent pace (median epoch) the run may move between two looks.
PACE_SLACK = 8.0
#: The durations of this many of the last steps are kept; their median sets the pace.
PACE_EPOCHS = 4


class EpochPace:
    """This peer's evidence of the run's epoch and pace (see the module docstring)."""

    def __init__(self) -> None:
        self._anchor: tuple[int, float] | None = None  # (epoch held, since when)
        self._measured = False  # the anchor is a step's: the next step measures an epoch
        self._durations: deque[float] = deque(maxlen=PACE_EPOCHS)

    def stepped(self, epoch: int, at: float) -> None:
        """This peer stepped into `epoch` at `at` (a round it took part in made the step)."""
        anchor = self._anchor
        if anchor is not None and self._measured and epoch == anchor[0] + 1 and at > anchor[1]:
            self._durations.append(at - anchor[1])
        if anchor is None or epoch >= anchor[0]:
            self._anchor = (epoch, at)
            self._measured = True

    def loaded(self, epoch: int, at: float) -> None:
        """This peer loaded a state of `epoch` at `at` (checked by witnesses, or the only one
        there was): the epoch is evidence; neither the time since the last step nor that to
        the next one is an epoch's (a download lands anywhere in an epoch: just before a round,
        the next step would look like an epoch of a second)."""
        if self._anchor is None or epoch >= self._anchor[0]:
            self._anchor = (epoch, at)
            self._measured = False

    @property
    def epoch_seconds(self) -> float | None:
        """The median of the recent epochs (one epoch made short, by peers that claimed samples
        they never trained, moves it little), or None without two consecutive steps."""
        return statistics.median(self._durations) if self._durations else None

    def bound(self, now: float) -> int | None:
        """The highest epoch believable at `now`, or None without a pace."""
        pace = self.epoch_seconds
        if self._anchor is None or pace is None:
            return None
        epoch, since = self._anchor
        elapsed = max(0.0, now - since)
        ahead = PACE_SLACK * elapsed / max(pace, 1e-3)
        return epoch + 1 + (int(ahead) if math.isfinite(ahead) and ahead < 2**62 else 2**62)
