"""Which peer a newcomer (or a peer behind) downloads the run's state from, and when it tries
again after a failure. Pure: time is passed in."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["AVOID_STRETCH", "MAX_REMEMBERED", "DonorChoice"]

MAX_REMEMBERED = 4096  # donors whose last failure is remembered
# The most an avoidance is stretched. 5 identities that could not serve the head they reported
# were passed over by 7 honest trainers at once; their avoidances ran out together, and two of
# them tried those identities again, and missed, in one round (tests/sim/test_scenarios.py)
AVOID_STRETCH = 1.5


@dataclass
class DonorChoice:
    """Which peer to download the state from: of two drawn at random among those at the run's
    epoch, the one that says it has served fewer downloads (the power of two choices: newcomers
    spread over the donors, and the most any donor serves stays near the mean, where a single
    random draw gives some donor several times the mean), skipping donors that failed in the last
    `avoid_seconds` (stretched by a factor drawn per failure from 1 to `avoid_stretch`: peers
    that began avoiding a donor at one moment do not all try it again in one round), and
    waiting `backoff` seconds (doubling per failure in a row, at most `max_backoff`) after a
    failure before trying again. A donor that has answered only "busy" for `busy_patience`
    seconds (it never served us since its first busy answer) failed us: "busy" costs nothing
    and says nothing, so an identity that answers it to everyone was asked again and again,
    about 20 times a second, and believed ahead all the while (the trainer never trained
    again); an honest donor is busy only while it serves two others or waits out a round of
    more than 20 s (state_sync.py). A donor that understates what it served
    is drawn as often as the others and wins its pairs: it serves up to twice its share.
    A donor that sheds us (it served others lately, and we told it we had other donors to ask:
    state_sync.py, "a flash crowd") is left out of the draw until the moment it named (1 to 10
    s away, `min_shed_seconds`, `max_shed_seconds`), while any other donor is left; that costs
    no backoff, and `others` says how many donors besides the one drawn we could still ask
    (none: the donor serves us). A donor that answered a plain "busy" is full for
    `full_seconds`: `others` does not count it, and a donor that shed us is asked before it,
    told we have nobody else (before, a receiver asked the full donor again and again while
    the one that had shed it sat idle). A shed counts as "busy" toward `busy_patience` (an
    identity that shed everyone would otherwise never fail); a download done starts every
    donor's patience over."""

    avoid_seconds: float = 60.0
    avoid_stretch: float = AVOID_STRETCH  # (1: none)
    backoff: float = 0.5
    max_backoff: float = 30.0
    max_avoid_seconds: float = 1800.0
    busy_patience: float = 30.0
    min_shed_seconds: float = 1.0  # (a donor's "again at once" would loop us as fast as the network)
    max_shed_seconds: float = 10.0
    full_seconds: float = 1.0  # a donor that answered plain "busy" is full for this long
    rng: random.Random = field(default_factory=random.Random)
    _failed_at: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)  # of each donor, since it last served
    _failures_in_a_row: int = 0
    _stretch: dict[str, float] = field(default_factory=dict)
    _not_before: float = 0.0
    # donors whose last failure was a state that contradicted their own report (the head they
    # reported is not the one they sent): their own word against them, not our network
    _contradicted: set[str] = field(default_factory=set)
    # of each donor that answered "busy" since it last served us: its first and last such answer
    _busy_since: dict[str, tuple[float, float]] = field(default_factory=dict)
    # donors that shed us: until when they are left out of the draw
    _shed_until: dict[str, float] = field(default_factory=dict)
    _shed_before: set[str] = field(default_factory=set)  # donors that shed us since a download
    # donors that answered a plain "busy" (serving two others, or mid-round): until when
    _full_until: dict[str, float] = field(default_factory=dict)

    def pick(self, donors: list[str], now: float,
             served: Mapping[str, int] | None = None) -> str | None:
        """A donor, or None while backing off. `served`: what each donor says it has served."""
        if now < self._not_before or not donors:
            return None
        fresh = self._fresh(donors, now)
        if not fresh:  # every donor failed lately: the one that failed longest ago
            fresh = [min(donors, key=lambda d: self._failed_at[d])]
        # first those that neither shed us nor were full lately; else those that shed us (they
        # serve us once we say we have nobody else to ask); else any
        spare = [d for d in fresh if now >= self._full_until.get(d, float("-inf"))]
        willing = [d for d in spare if now >= self._shed_until.get(d, float("-inf"))]
        fresh = willing or spare or fresh
        drawn = self.rng.sample(sorted(set(fresh)), min(2, len(set(fresh))))
        if served is None:
            return drawn[0]
        return min(drawn, key=lambda d: served.get(d, 0))  # (a tie: the first drawn)

    def _fresh(self, donors: list[str], now: float) -> list[str]:
        """The donors that did not fail us lately."""
        return [d for d in donors if now - self._failed_at.get(d, float("-inf")) >= self._avoid(d)]

    def others(self, donors: list[str], donor: str, now: float) -> int:
        """How many donors besides `donor` we could still ask now: not failed lately, neither
        shed us nor were full lately (told to the donor: one that served others lately serves
        us only if none)."""
        return len({d for d in self._fresh(donors, now)
                    if d != donor and now >= self._shed_until.get(d, float("-inf"))
                    and now >= self._full_until.get(d, float("-inf"))})

    def shed(self, donor: str, now: float, retry_after: float) -> bool:
        """`donor` sent us to another donor, and takes requests again after `retry_after`
        seconds (its word: within [`min_shed_seconds`, `max_shed_seconds`]). Whether it had
        sent us elsewhere before, since our last download: only a first shed is worth asking
        another donor at once (identities that shed us again and again are asked at the pace
        of "busy" answers, not as fast as the network goes)."""
        seconds = retry_after if retry_after >= self.min_shed_seconds else self.min_shed_seconds
        self._shed_until = _until(self._shed_until, donor, now,
                                  now + min(seconds, self.max_shed_seconds))
        again = donor in self._shed_before
        if len(self._shed_before) >= MAX_REMEMBERED:
            self._shed_before.clear()  # (identities are free: start over)
        self._shed_before.add(donor)
        return again

    def full(self, donor: str, now: float) -> None:
        """`donor` answered a plain "busy": while it is full, `others` does not count it, and
        donors that shed us are asked before it."""
        self._full_until = _until(self._full_until, donor, now, now + self.full_seconds)

    def _avoid(self, donor: str) -> float:
        """How long `donor` is avoided after its last failure: `avoid_seconds` times the stretch
        drawn at that failure, doubling with each failure since it last served us, at most
        `max_avoid_seconds` (a donor that fails again each time it is tried is tried less and
        less often)."""
        doublings = min(self._failures.get(donor, 1) - 1, 30)
        return min(self.max_avoid_seconds,
                   self.avoid_seconds * 2.0 ** doublings * self._stretch.get(donor, 1.0))

    def failed_lately(self, now: float) -> frozenset[str]:
        """The donors avoided now (estimate.py does not believe their heads ahead of ours
        meanwhile)."""
        return frozenset(d for d, at in self._failed_at.items() if now - at < self._avoid(d))

    def failed_since_served(self) -> frozenset[str]:
        """The donors that failed us since they last served us (avoided now or not)."""
        return frozenset(self._failures)

    def contradicted_lately(self, now: float) -> frozenset[str]:
        """The donors avoided now whose last failure was a state that contradicted the head they
        reported (estimate.py does not believe their heads ahead of a newcomer's either)."""
        return self.failed_lately(now) & self._contradicted

    def busy(self, donor: str, now: float) -> bool:
        """`donor` answered "busy" at `now`; True where that makes it a failure (it has answered
        only that for `busy_patience` seconds, asked at least that often): then it is avoided as
        `failed` says."""
        if donor not in self._busy_since and len(self._busy_since) >= MAX_REMEMBERED:
            self._busy_since.clear()  # (identities are free: start over rather than grow)
        since, last = self._busy_since.get(donor, (now, now))
        if now - last > self.busy_patience:  # (busy once long ago: not busy all this while)
            since = now
        self._busy_since[donor] = (since, now)
        if now - since < self.busy_patience:
            return False
        self.failed(donor, now)
        return True

    def failed(self, donor: str, now: float, *, contradicted: bool = False) -> None:
        """`donor` failed us; `now`: when the attempt ended (one that stalled for a minute is
        avoided from then on, not from when it began). `contradicted`: it sent a state that
        contradicts the head it reported."""
        if donor not in self._failed_at and len(self._failed_at) >= MAX_REMEMBERED:
            # (identities are free: forget the half that failed longest ago)
            for old in sorted(self._failed_at, key=self._failed_at.__getitem__)[:len(self._failed_at) // 2]:
                del self._failed_at[old]
                self._failures.pop(old, None)
                self._stretch.pop(old, None)
                self._contradicted.discard(old)
        if contradicted:
            self._contradicted.add(donor)
        else:
            self._contradicted.discard(donor)
        self._failed_at[donor] = now
        self._busy_since.pop(donor, None)
        self._stretch[donor] = 1.0 + (self.avoid_stretch - 1.0) * self.rng.random()
        self._failures[donor] = self._failures.get(donor, 0) + 1
        self._failures_in_a_row += 1
        self._not_before = now + self.wait(now)

    def wait(self, now: float) -> float:
        """Seconds to wait after the current run of failures."""
        if self._failures_in_a_row == 0:
            return 0.0
        # the exponent is bounded: 2 ** 1024 no longer converts to a float (OverflowError after
        # 1024 failures in a row), and the cap is reached long before
        doublings = min(self._failures_in_a_row - 1, 1000)
        return min(self.max_backoff, self.backoff * 2.0 ** doublings)

    def succeeded(self, donor: str | None = None) -> None:
        self._failures_in_a_row = 0
        self._not_before = 0.0
        if donor is not None:
            # a download done: the busy answers of this catch-up count no longer (a donor that
            # sent us elsewhere in one flash crowd and again in the next, each time within the
            # patience of the last, had been found "only busy" and failed)
            self._busy_since.clear()
            self._shed_before.clear()
            self._failed_at.pop(donor, None)
            self._failures.pop(donor, None)
            self._stretch.pop(donor, None)
            self._contradicted.discard(donor)
            self._busy_since.pop(donor, None)


def _until(table: dict[str, float], donor: str, now: float, until: float) -> dict[str, float]:
    """`table` with `donor` noted until `until`, bounded: past MAX_REMEMBERED donors, those whose
    time has passed are dropped, and if that is not enough it starts over (identities are free)."""
    if donor not in table and len(table) >= MAX_REMEMBERED:
        table = {d: t for d, t in table.items() if t > now}
        if len(table) >= MAX_REMEMBERED:
            table = {}
    table[donor] = until
    return table
