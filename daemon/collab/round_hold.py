"""A trainer at a head that a majority of the run holds goes through its round there before it
believes a head ahead that it did not believe before. Pure: no I/O.

The run's head is the highest that a third of the trainers hold (estimate.py), so a few
identities claiming the epoch after the run's, on a lineage of their own, become the run's head
whenever the peers a trainer had passed over (their states failed it: donors.py) come back into
its estimate, or new ones join them. The trainer then leaves the round it was about to take to
download their state, which they cannot serve; the donor waits out its own round before it
answers, and the round is over when the trainer comes back to it. In the simulator's
40 %-next-liars scenario (12 trainers) one of the 7 honest trainers missed a round this way
(donors.py's stretch of avoidances made it rarer). A peer that failed us since it last
served us is never exempt: otherwise an identity could report our head, and so be seen there,
and jump to the next epoch as our round forms. What the hold does not cover: a round of ours
that fails ends it at once, so a trainer whose round failed believes everyone ahead again (and
retries the round only after it has tried them); and an identity that never failed us yet can
still use the exemption once.

Now, after a look at which this trainer's head is the run's and held by a majority of the
run's trainers (policy.py, `majority_at`: its round there may be stepped on), a peer that comes
to report a head ahead is not believed (estimate.py's `unserved`) unless the trainer saw it at
its own head at that look, or already believed it ahead, for as long as the trainer has not
tried a round at its head since (a success moves the head; a failure ends the hold).

An honest step is held up by it only where views differ. The trainers that stepped on a round
were at this head at the last look (they are believed at once, as before), and a round may be
stepped on only by a majority of the run's trainers, which are counted whether believed or not:
where peers ahead truly stepped without this trainer, those left at its head are no majority,
and the engine drops the hold and follows them. That rests on this trainer's view: where its
last read missed every trainer that stepped, and it sees more trainers at its head than the
stepping round counted (newcomers, peers back from a pause), it goes on to its own round at
the old head; should that round step too, two lineages hold the epoch, and the one more hold
wins (estimate.py), as after any partial round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .estimate import Head

__all__ = ["RoundHold"]


@dataclass
class RoundHold:
    """Who this trainer saw at its head, or believed ahead, at its last look where a majority
    held its head (module docstring), and how many round attempts it had made by then."""

    _head: Head | None = None
    _tries: int = -1
    _known: frozenset[str] = frozenset()

    def held(self, head: Head, tries: int, reporting: Iterable[str]) -> frozenset[str]:
        """Of the peers `reporting`, those not to believe ahead of `head`: the ones not known at
        the last look, while nothing was tried since; else none."""
        if self._head is None or self._head != head or self._tries != tries:
            return frozenset()
        return frozenset(reporting) - self._known

    def looked(self, head: Head, tries: int, known: Iterable[str] | None) -> None:
        """A look at `head` after `tries` round attempts; `known`: the peers at `head` and those
        believed ahead, where a majority held `head` (else None: no hold from this look)."""
        if known is None:
            self._head, self._tries, self._known = None, -1, frozenset()
        else:
            self._head, self._tries, self._known = head, tries, frozenset(known)
