"""Whether the grid round at the run's head has begun: its roster is out (roster.py).

A grid round's roster writers publish it as they begin the round, so a roster out for the round
at the head means the round has begun, whatever this peer's own estimate of the samples says
(policy.py, `Local.roster_published`). The engine reads the round's roster key through this
watch at most once every `ROSTER_POLL` seconds:
- while a first grid round's peer settles (policy.py: it stops settling and begins);
- while a peer at the head of a grid run is within `ROSTER_WATCH` seconds of the round by its
  own estimate (`due`; it trains in steps of at most `ROSTER_POLL` seconds meanwhile, so that it
  reads the key that often). Estimates of when a round is due differ from peer to peer: in a
  256-peer simulation the peers of one round took its roster over 10 to 20 s, and a grid
  round's stages wait for their members only a matchmaking window.
There a roster counts only if its writer dates it within `ROSTER_FRESH` seconds of now (a
roster stays in the DHT for minutes: one of an earlier try of the round, which failed, does not
mean that anybody is in a round now), and only until a try of this peer's own at that head fails
(`failed`): from then on the peer waits for its own estimate again, as it did before the watch
(else it would try again at once and again after each window-long failure, training nothing,
while the others train toward the target).
A roster once seen for a head counts until the head changes or such a try fails.
"""

from __future__ import annotations

from collections.abc import Collection

from .. import timebase
from .estimate import GlobalProgress, Head
from .policy import round_key
from .ports import RoundAverager

__all__ = ["ROSTER_FRESH", "ROSTER_POLL", "ROSTER_READ_TIMEOUT", "ROSTER_WATCH", "RosterWatch"]

ROSTER_POLL = 1.0  # seconds between reads of a grid round's roster key
ROSTER_WATCH = 15.0  # a peer at the head watches this many seconds before the round it expects
ROSTER_FRESH = 15.0  # ... for a roster its writer dates at most this far from now
ROSTER_READ_TIMEOUT = 1.0  # the longest one read of the key may take while training


class RosterWatch:
    """One run's watch on its grid rounds' rosters (see the module docstring)."""

    def __init__(self, averaging: RoundAverager) -> None:
        self.averaging = averaging
        self.seen: Head | None = None  # the head whose grid round's roster we saw
        self.spent: Head | None = None  # the head where a try of ours failed since
        self._read_at = -ROSTER_POLL  # (monotonic) when we last read a roster's key

    def published(self, head: Head) -> bool:
        """Whether the roster of the round at `head` was seen (and no try of ours failed)."""
        return self.seen == head and self.spent != head

    def failed(self, head: Head) -> None:
        """A round of ours at `head` failed: its roster means nothing more to this peer."""
        self.spent = head

    def due(self, run: GlobalProgress, *, at_head: bool) -> bool:
        """Whether a peer (`at_head`: at the run's head) whose estimate has the round not yet
        due watches for its roster now: a grid run's round within ROSTER_WATCH seconds."""
        expected = run.trainers_at_epoch + run.live_aux
        return (at_head and not run.ready and run.head not in (self.seen, self.spent)
                and 0 < self.averaging.max_group_size < expected
                and run.eta_seconds is not None and run.eta_seconds <= ROSTER_WATCH)

    async def look(self, head: Head, trainers: Collection[str], *, timeout: float,
                   fresh: bool = False) -> bool:
        """Whether the roster of the round at `head` is out, by what a peer seeing `trainers`
        there would take (roster.py, `Rosters.published`); with `fresh`, only one dated within
        ROSTER_FRESH seconds of now. The key is read at most once every ROSTER_POLL seconds
        (else the answer is what was seen)."""
        if self.seen == head:
            return self.published(head)
        if timebase.monotonic() < self._read_at + ROSTER_POLL:
            return False
        self._read_at = timebase.monotonic()
        at = await self.averaging.roster_published(round_key("grad", head), trainers,
                                                   timeout=timeout)
        if at is not None and (not fresh or abs(timebase.now() - at) <= ROSTER_FRESH):
            self.seen = head
        return self.published(head)
