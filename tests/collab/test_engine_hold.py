"""A trainer at a head a majority holds tries its round there before it believes a new head ahead
(round_hold.py), and believes at once the peers it saw at its own head step.

The engine runs on the simulator's virtual clock with in-memory ports: a board of 6 other
trainers at the trainer's head (epoch 2) that reach the target after a dozen seconds, and a
script of other reports that appear 3 s in. What is checked is the order of what the engine
does: its round at its head, or a download of the state ahead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest
from collab.scripted_run import (
    APPEAR_AT,
    GONE_AT,
    HONEST,
    LIARS,
    OURS,
    THEIRS,
    RecordingAverager,
    RefusingStates,
    run_engine,
)

from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.catching_up import BUSY_WAIT_SECONDS
from dedloc.daemon.collab.errors import DonorBusy
from dedloc.daemon.collab.estimate import Head
from dedloc.daemon.collab.ports import DownloadedState
from dedloc.daemon.collab.round_hold import RoundHold


def test_a_new_head_ahead_waits_until_the_round_at_our_head_was_tried() -> None:
    # 5 identities of 12 report (3, THEIRS) from 3 s in: a third, so the run's head for an
    # estimate that believes them. The trainer's own head is held by 7 of 12, a majority: it
    # averages there first (the round fails here), and only then tries their state
    averager, states, _, started = run_engine(HONEST, LIARS)
    assert averager.rounds, "it left its head before its round there"
    (began, key), *_ = averager.rounds
    assert key.startswith("grad/2/")
    assert len(states.downloads) == 1
    downloaded_at, donor, expect = states.downloads[0]
    assert donor in LIARS and expect == Head(3, THEIRS)
    assert averager.events == ["round", "download"]  # (both at one virtual instant)
    assert states.engine is not None  # its header contradicted the report: passed over as such
    assert states.engine.progress.failed_state_downloads == 1
    assert donor in states.engine.donors.contradicted_lately(downloaded_at)  # (virtual clock)
    assert began > started + APPEAR_AT + 5.0  # (it had seen them for seconds before the round)


def test_peers_seen_at_our_head_that_report_a_step_are_followed_at_once() -> None:
    # 5 of 11 trainers at the head report stepping to (3, THEIRS) 3 s in, long before the run's
    # target (no round of ours could have been stepped on): the trainer saw them at its own head,
    # so it believes them at once (a step is confirmed by the first third that report it)
    everyone = HONEST + LIARS
    averager, states, _, started = run_engine(everyone, LIARS)
    assert averager.events == ["download"]
    downloaded_at, donor, expect = states.downloads[0]
    assert donor in LIARS and expect == Head(3, THEIRS)
    assert downloaded_at < started + APPEAR_AT + 5.0  # (the next look: at most max_look)


def test_peers_that_failed_us_are_held_even_where_they_reported_our_head() -> None:
    # as above, but those 5 failed a download of ours before (no longer avoided): they could
    # report our head only to pass for steppers and jump ahead as our round forms; they are held
    averager, _, _, started = run_engine(HONEST + LIARS, LIARS, failed_before=LIARS)
    assert averager.events == ["round", "download"]
    (began, key), *_ = averager.rounds
    assert key.startswith("grad/2/") and began > started + APPEAR_AT + 5.0


def test_a_hold_ends_when_the_trainers_at_our_head_are_no_longer_a_majority() -> None:
    # as above, but 4 of the 6 other trainers at the head leave 6 s in: 3 of 8 are no majority,
    # no round of ours could be stepped on, and the trainer follows the head ahead at once
    averager, states, _, started = run_engine(HONEST, LIARS, gone=HONEST[:4])
    assert averager.events == ["download"]
    downloaded_at, donor, expect = states.downloads[0]
    assert donor in LIARS and expect == Head(3, THEIRS)
    assert started + GONE_AT <= downloaded_at < started + GONE_AT + 5.0


def test_the_hold_keeps_who_was_known_and_ends_with_a_try_or_a_lost_majority() -> None:
    hold, head = RoundHold(), Head(2, OURS)
    assert hold.held(head, 0, ["a", "b"]) == frozenset()  # nothing looked at yet
    hold.looked(head, 0, {"a"})
    assert hold.held(head, 0, ["a", "b", "c"]) == {"b", "c"}
    assert hold.held(Head(3, OURS), 0, ["b"]) == frozenset()  # another head
    assert hold.held(head, 1, ["b"]) == frozenset()  # a round was tried since
    hold.looked(head, 0, {"a"})  # (the engine keeps the held peers out of what it knew)
    assert hold.held(head, 0, ["b"]) == {"b"}
    hold.looked(head, 0, None)  # a look without a majority at our head
    assert hold.held(head, 0, ["b"]) == frozenset()


@pytest.mark.parametrize(("shed", "retry_after"), [(False, 10.0), (True, 10.0), (True, 0.0)])
def test_identities_that_answer_busy_to_every_download_are_passed_over_in_the_end(
        shed: bool, retry_after: float) -> None:
    # the 5 identities of the first test answer every download "busy" (no header, no failure):
    # the trainer asked them again and again, ~20 times a second, believed them ahead all the
    # while and never trained again. Now one that has answered only "busy" for 30 s failed
    # (donors.py), and the trainer goes back to its rounds. `shed`: they say they served others
    # lately, which sends a trainer with other donors to ask to another at once (no backoff):
    # once it has none left it says so, and their "busy" then counts as any other; one that
    # says "again at once" (0 s) is left out of the draw for a second all the same
    class BusyStates(RefusingStates):
        async def download(self, donor: str, expect: Head | None = None,
                           others: int = 0) -> DownloadedState:
            self.downloads.append((asyncio.get_running_loop().time(), donor, expect))
            self.events.append("download")
            await asyncio.sleep(0.05)
            raise DonorBusy(f"{donor} is busy", shed=shed and others > 0, retry_after=retry_after)

    class SlowAverager(RecordingAverager):  # (a failed round that takes no time loops at once)
        async def average(self, vector: np.ndarray, key: str,
                          **options: object) -> AveragingReport | None:
            await asyncio.sleep(5.0)
            return await super().average(vector, key, **options)

    averager, states, engine, _ = run_engine(HONEST, LIARS, averager=SlowAverager(),
                                             states=BusyStates(), stop_after=200.0)
    first_try = states.downloads[0][0]
    # about one try each half second, for the 30 s of the first identity's patience; then one
    # or two each time an avoidance runs out (an identity busy that long fails at once)
    # (identities that shed send it to the next at once: one try each per shed window on top
    # of those, and a patience that starts over after each avoidance)
    assert len(states.downloads) <= 2 * 30 / BUSY_WAIT_SECONDS * (2 if shed else 1)
    for window in range(0, 200, 10):  # never more often than the busy tries and one shed each
        tries = [t for t, _, _ in states.downloads if first_try + window <= t < first_try + window + 10]
        assert len(tries) <= 10 / BUSY_WAIT_SECONDS + len(LIARS) + 2
    assert engine.progress.failed_state_downloads >= 2
    rounds_after = [at for at, _ in averager.rounds if at > first_try]
    assert rounds_after and rounds_after[0] < first_try + 40.0  # back to its rounds
    assert len(rounds_after) >= 10


def test_a_donor_that_sheds_us_sends_us_to_another_at_once() -> None:
    # a flash crowd (state_sync.py): the first donor asked served others lately and, told we
    # have others to ask, sends us elsewhere; the next is asked at once (no backoff, no busy
    # wait), saying how many are left, and the one that shed us is not drawn again meanwhile
    @dataclass
    class SheddingStates(RefusingStates):
        asked: list[tuple[str, int]] = field(default_factory=list)

        async def download(self, donor: str, expect: Head | None = None,
                           others: int = 0) -> DownloadedState:
            self.asked.append((donor, others))
            if len(self.asked) == 1:
                self.downloads.append((asyncio.get_running_loop().time(), donor, expect))
                raise DonorBusy(f"{donor} served two lately", shed=others > 0, retry_after=10.0)
            return await super().download(donor, expect, others)

    states = SheddingStates()
    _, _, engine, _ = run_engine(HONEST + LIARS, LIARS, states=states)
    (first, first_others), (second, second_others) = states.asked
    assert first != second and {first, second} <= set(LIARS)
    assert (first_others, second_others) == (len(LIARS) - 1, len(LIARS) - 2)
    assert states.downloads[1][0] - states.downloads[0][0] < BUSY_WAIT_SECONDS
    assert engine.progress.failed_state_downloads == 1  # (the second's contradiction only)
