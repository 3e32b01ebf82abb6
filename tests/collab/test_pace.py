"""The run's pace as one peer saw it, and the epochs it makes believable (collab/pace.py), with
the estimate that leaves out reports past them (collab/estimate.py's `max_epoch`). Pure."""

from __future__ import annotations

from dedloc.daemon.collab.estimate import estimate_global
from dedloc.daemon.collab.pace import PACE_SLACK, EpochPace
from dedloc.daemon.collab.policy import quorum_base
from dedloc.daemon.collab.progress import PeerProgress

NOW = 1_700_000_000.0


def report(peer_id: str, epoch: int, *, lineage: str | None = None, samples: int = 10,
           total: int = 100) -> PeerProgress:
    return PeerProgress(peer_id=peer_id, epoch=epoch, samples_accumulated=samples,
                        samples_per_second=1.0, time=NOW, expiration=NOW + 60, role="trainer",
                        total_samples=total, lineage=None if lineage is None else lineage * 32)


def paced(steps: list[tuple[int, float]]) -> EpochPace:
    pace = EpochPace()
    for epoch, at in steps:
        pace.stepped(epoch, at)
    return pace


def test_no_pace_no_bound() -> None:
    assert EpochPace().bound(NOW) is None
    one = paced([(3, NOW)])  # one step: no duration yet
    assert one.bound(NOW + 1000) is None
    loaded = EpochPace()
    loaded.loaded(40, NOW)
    assert loaded.bound(NOW + 1000) is None


def test_the_bound_is_one_epoch_ahead_then_grows_with_the_pace() -> None:
    pace = paced([(1, NOW - 200), (2, NOW - 100), (3, NOW)])  # epochs of 100 s
    assert pace.epoch_seconds == 100
    assert pace.bound(NOW) == 4  # the next step is always believable
    assert pace.bound(NOW + 99) == 4 + int(PACE_SLACK * 99 / 100)
    assert pace.bound(NOW + 1000) == 4 + int(PACE_SLACK * 10)
    assert pace.bound(NOW - 50) == 4  # (a clock that went back does not lower it)


def test_the_median_recent_epoch_sets_the_pace() -> None:
    pace = paced([(1, NOW - 130), (2, NOW - 30), (3, NOW - 20), (4, NOW)])
    assert pace.epoch_seconds == 20  # of 100, 10 and 20
    pace = paced([(e, NOW - 100 * (10 - e)) for e in range(1, 11)] + [(11, NOW + 1)])
    assert pace.epoch_seconds == 100  # one short epoch (claimed samples) moves it little
    pace = paced([(1, NOW - 30), (2, NOW - 20), (3, NOW - 10), (4, NOW), (5, NOW + 10)])
    assert pace.epoch_seconds == 10  # the last 4 only: the run sped up


def test_a_jump_or_a_download_moves_the_anchor_without_a_duration() -> None:
    pace = paced([(1, NOW - 200), (2, NOW - 100)])
    pace.loaded(9, NOW)  # caught up: the epoch is evidence, the 100 s are not one epoch
    assert pace.epoch_seconds == 100
    assert pace.bound(NOW) == 10
    pace.stepped(10, NOW + 1.5)  # the step after a download measures nothing either (the
    assert pace.epoch_seconds == 100  # download may land just before a round)
    pace.stepped(12, NOW + 2)  # (a step of more than one epoch measures nothing)
    assert pace.epoch_seconds == 100
    pace.loaded(5, NOW + 3)  # never back
    assert pace.bound(NOW + 2) == 13
    pace.stepped(13, NOW + 52)
    assert pace.epoch_seconds == 75  # of 100 and 50


def test_reports_past_the_bound_count_for_nothing() -> None:
    honest = [report(f"h{i}", 7, lineage="a") for i in range(4)]
    liars = [report(f"l{i}", 10**12, lineage="f", samples=1000) for i in range(3)]
    # 3 of 7 hold the far head: more than the quorum of a third, so it is the run's head
    free = estimate_global(honest + liars, target_batch_size=1000, now=NOW, stale_after=30)
    assert free.epoch == 10**12 and free.confirmed
    bounded = estimate_global(honest + liars, target_batch_size=1000, now=NOW, stale_after=30,
                              max_epoch=9)
    assert (bounded.epoch, bounded.lineage) == (7, "a" * 32) and bounded.confirmed
    assert bounded.beyond_pace == ("l0", "l1", "l2")
    assert bounded.highest_epoch == 7 and bounded.trainers_at_epoch == 4
    assert bounded.samples_accumulated == 40  # the liars' full batches count for nothing
    # they still count among the trainers a step needs a majority of (policy.quorum_base)
    assert bounded.counted_trainers == 7


def test_a_peer_that_believes_nobody_else_does_not_see_itself_as_the_run() -> None:
    # its pace rules out the head the others hold (a clock that jumped back, a swarm that sped
    # up past the slack): it must not take itself for the whole run and step alone
    own = report("me", 7, lineage="a")
    others = [report(f"h{i}", 30, lineage="c") for i in range(5)]
    run = estimate_global(others, target_batch_size=1000, now=NOW, stale_after=30, own=own,
                          max_epoch=9)
    assert (run.epoch, run.trainers_at_epoch) == (7, 1)
    assert run.counted_trainers == 6 and quorum_base(run) == 6  # one of six: no majority


def test_own_report_is_never_beyond_the_bound() -> None:
    own = report("me", 12, lineage="b")
    run = estimate_global([report("h0", 12, lineage="b")], target_batch_size=1000, now=NOW,
                          stale_after=30, own=own, max_epoch=8)
    assert run.beyond_pace == ("h0",)
    assert run.epoch == 12 and run.trainers_at_epoch == 1


def test_a_peer_ahead_within_the_bound_is_followed() -> None:
    # a peer whose round failed sees the others one or more epochs on: it catches up, as before
    reports = [report(f"h{i}", 9, lineage="c") for i in range(5)]
    own = report("me", 7, lineage="a")
    run = estimate_global(reports, target_batch_size=1000, now=NOW, stale_after=30, own=own,
                          max_epoch=9)
    assert run.epoch == 9 and run.beyond_pace == ()


def test_peers_ahead_whose_state_failed_us_lately_hold_no_head() -> None:
    # a third of the identities claim the epoch after ours, on a lineage of their own: within
    # any pace, and a quorum. Once our downloads from them failed (the engine's donors.py list),
    # their head is passed over, and ours is the run's; they still count in the quorum's base
    own = report("me", 7, lineage="a")
    honest = [report(f"h{i}", 7, lineage="a") for i in range(6)]
    liars = [report(f"l{i}", 8, lineage="e", samples=1000) for i in range(4)]
    free = estimate_global(honest + liars, target_batch_size=1000, now=NOW, stale_after=30,
                           own=own, max_epoch=8)
    assert (free.epoch, free.lineage) == (8, "e" * 32) and free.confirmed
    passed = estimate_global(honest + liars, target_batch_size=1000, now=NOW, stale_after=30,
                             own=own, max_epoch=8, unserved={"l0", "l1", "l2", "l3", "h5"})
    assert (passed.epoch, passed.lineage) == (7, "a" * 32) and passed.confirmed
    assert passed.unserved_ahead == ("l0", "l1", "l2", "l3")  # h5 is not ahead: believed
    assert passed.trainers_at_epoch == 7 and passed.highest_epoch == 7
    assert passed.counted_trainers == 11 and quorum_base(passed) == 11
    # one of them not (yet) tried: 1 of 11 is no quorum, ours still is the run's head
    some = estimate_global(honest + liars, target_batch_size=1000, now=NOW, stale_after=30,
                           own=own, max_epoch=8, unserved={"l0", "l1", "l2"})
    assert (some.epoch, some.lineage) == (7, "a" * 32)
    # honest peers ahead that served us are followed as before
    ahead = [report(f"n{i}", 8, lineage="c") for i in range(6)]
    followed = estimate_global([*ahead, report("x", 8, lineage="c")], target_batch_size=1000,
                               now=NOW, stale_after=30, own=own, max_epoch=8, unserved={"x"})
    assert (followed.epoch, followed.lineage) == (8, "c" * 32)
    assert followed.unserved_ahead == ("x",) and "x" not in followed.donors


def test_a_fresh_peer_passes_nobody_over() -> None:
    # a newcomer whose downloads fail (for its own reasons too: too little shared memory) would
    # otherwise take its own empty head for the run's, train from scratch and, no longer fresh,
    # count against the established trainers' quorum
    own = PeerProgress(peer_id="me", epoch=0, samples_accumulated=0, samples_per_second=1.0,
                       time=NOW, expiration=NOW + 60, role="trainer", total_samples=0)
    donors = [report(f"h{i}", 7, lineage="a") for i in range(3)]
    run = estimate_global(donors, target_batch_size=1000, now=NOW, stale_after=30, own=own,
                          unserved={"h0", "h1", "h2"})
    assert (run.epoch, run.lineage) == (7, "a" * 32) and run.unserved_ahead == ()


def test_a_fresh_peer_passes_over_a_donor_whose_state_contradicted_its_report() -> None:
    # one identity took a run at its start (every honest trainer still fresh) reporting a far
    # epoch, and sent its real state when asked: a state behind the head it reported, its own
    # word against it (`contradicted`, donors.py). The fresh peers tried it for ever and the run
    # never stepped; now they pass it over and start the run afresh among themselves
    def fresh(peer_id: str) -> PeerProgress:
        return PeerProgress(peer_id=peer_id, epoch=0, samples_accumulated=0,
                            samples_per_second=1.0, time=NOW, expiration=NOW + 60,
                            role="trainer", total_samples=0)

    own, others = fresh("me"), [fresh(f"f{i}") for i in range(6)]
    liar = report("liar", 10_000, lineage="f")
    held = estimate_global([*others, liar], target_batch_size=1000, now=NOW, stale_after=30,
                           own=own, unserved={"liar"})
    assert held.epoch == 10_000  # (a failure alone proves nothing: see the test above)
    passed = estimate_global([*others, liar], target_batch_size=1000, now=NOW, stale_after=30,
                             own=own, unserved={"liar"}, contradicted={"liar"})
    assert passed.epoch == 0 and passed.unserved_ahead == ("liar",)
    assert "liar" not in passed.donors
