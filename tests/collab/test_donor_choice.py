"""Pure tests of `DonorChoice`: which peer a trainer that is behind downloads the state from."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dedloc.daemon.collab.donors import AVOID_STRETCH, MAX_REMEMBERED, DonorChoice

DONORS = ["donor-a", "donor-b", "donor-c"]


def choice(seed: int = 1, **kwargs: float) -> DonorChoice:
    """A donor choice whose avoidances are not stretched (exact times), unless asked."""
    return DonorChoice(rng=random.Random(seed), **{"avoid_stretch": 1.0, **kwargs})


def test_empty_list_gives_none() -> None:
    assert choice().pick([], now=0.0) is None


def test_a_single_donor_is_picked() -> None:
    assert choice().pick(["only"], now=0.0) == "only"


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_picks_spread_over_the_donors(seed: int) -> None:
    donors = choice(seed)
    counts = Counter(donors.pick(DONORS, now=float(i)) for i in range(300))
    assert set(counts) == set(DONORS)
    for donor in DONORS:
        assert 70 <= counts[donor] <= 130, counts  # a fair share of 100 each


def _most_over_mean(served: Counter[str]) -> float:
    """What the simulator reports: the most one donor served over the mean of those that did."""
    return max(served.values()) / (sum(served.values()) / len(served))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_less_loaded_of_two_donors_serves(seed: int) -> None:
    # 256 donors, 360 downloads (a 256-peer simulation's): a random donor per download gave some
    # donor 3.2 times the mean of those that served (the bound users were promised: 3)
    donors = [f"donor-{i:03d}" for i in range(256)]
    served: Counter[str] = Counter()
    random_served: Counter[str] = Counter()
    chooser, random_chooser = choice(seed), choice(seed)
    for i in range(360):
        served[chooser.pick(donors, float(i), served)] += 1  # type: ignore[index]
        random_served[random_chooser.pick(donors, float(i))] += 1  # type: ignore[index]
    assert _most_over_mean(served) <= 2.5 and max(served.values()) <= 4, served.most_common(3)
    assert _most_over_mean(random_served) > 3  # (what one random draw gave with these seeds)


def test_a_donor_that_says_it_served_nothing_serves_at_most_about_twice_its_share() -> None:
    donors = [f"donor-{i:02d}" for i in range(20)]
    chooser = choice(3)
    served: Counter[str] = Counter()
    for i in range(4000):
        said = {**served, "donor-00": 0}  # it never says it served
        served[chooser.pick(donors, float(i), said)] += 1  # type: ignore[index]
    assert served["donor-00"] <= 2.3 * 4000 / 20, served["donor-00"]


def test_pick_does_not_depend_on_the_order_of_the_list() -> None:
    one, other = choice(7), choice(7)
    for i in range(50):
        assert one.pick(DONORS, float(i)) == other.pick(list(reversed(DONORS)), float(i))


def test_a_donor_that_failed_recently_is_skipped() -> None:
    donors = choice(avoid_seconds=60.0, backoff=0.5)
    donors.failed("donor-a", now=100.0)
    picks = {donors.pick(DONORS, now=101.0 + i * 0.1) for i in range(200)}
    assert picks == {"donor-b", "donor-c"}


def test_a_failed_donor_is_tried_again_after_avoid_seconds() -> None:
    donors = choice(avoid_seconds=60.0, backoff=0.5)
    donors.failed("donor-a", now=100.0)
    assert donors.pick(["donor-a", "donor-b"], now=159.9) == "donor-b"
    picks = Counter(donors.pick(["donor-a", "donor-b"], now=160.0) for _ in range(200))
    assert picks["donor-a"] > 0 and picks["donor-b"] > 0


def test_peers_that_began_avoiding_a_donor_together_try_it_again_at_different_times() -> None:
    # each draws its stretch: 7 trainers that passed over the same identities at one moment
    # no longer all try them again in one round
    ends = []
    for seed in range(7):
        donors = DonorChoice(avoid_seconds=60.0, rng=random.Random(seed))
        donors.failed("liar", now=100.0)
        ends.append(min(t / 10 for t in range(1000, 2000)
                        if "liar" not in donors.failed_lately(t / 10)))
    assert all(160.0 <= end <= 100.0 + 60.0 * AVOID_STRETCH for end in ends)
    assert len(set(ends)) == len(ends)


def test_waits_the_backoff_after_a_failure() -> None:
    donors = choice(backoff=2.0, max_backoff=30.0)
    donors.failed("donor-a", now=100.0)
    assert donors.wait(100.0) == 2.0
    assert donors.pick(DONORS, now=100.0) is None
    assert donors.pick(DONORS, now=101.99) is None
    assert donors.pick(DONORS, now=102.0) in {"donor-b", "donor-c"}


def test_backoff_doubles_and_is_capped() -> None:
    donors = choice(backoff=0.5, max_backoff=30.0)
    assert donors.wait(0.0) == 0.0  # no failure yet: no wait
    waits = []
    now = 0.0
    for _ in range(10):
        donors.failed("donor-a", now)
        waits.append(donors.wait(now))
        assert donors.pick(DONORS, now) is None
        now += waits[-1]
        assert donors.pick(DONORS, now) is not None
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_backoff_survives_very_many_failures_in_a_row() -> None:
    # A peer that cannot download for hours must keep retrying at the cap, not crash
    # (2 ** 1024 does not convert to a float).
    donors = choice(backoff=0.5, max_backoff=30.0)
    for i in range(3000):
        donors.failed(DONORS[i % 3], now=float(i))
    assert donors.wait(3000.0) == 30.0
    assert donors.pick(DONORS, now=2999.0 + 30.0) is not None


def test_succeeded_resets_the_backoff() -> None:
    donors = choice(backoff=1.0, max_backoff=30.0)
    for i in range(5):
        donors.failed("donor-a", now=float(i))
    assert donors.pick(DONORS, now=5.0) is None
    donors.succeeded()
    assert donors.wait(5.0) == 0.0
    assert donors.pick(DONORS, now=5.0) is not None
    donors.failed("donor-b", now=6.0)
    assert donors.wait(6.0) == 1.0  # the doubling starts over


def test_when_every_donor_failed_recently_the_oldest_failure_is_picked() -> None:
    donors = choice(avoid_seconds=60.0, backoff=0.1, max_backoff=0.1)
    donors.failed("donor-b", now=100.0)
    donors.failed("donor-c", now=101.0)
    donors.failed("donor-a", now=102.0)
    for i in range(20):
        assert donors.pick(DONORS, now=103.0 + i) == "donor-b"
    # only among the donors offered
    assert donors.pick(["donor-a", "donor-c"], now=110.0) == "donor-c"


def test_a_donor_not_failed_is_preferred_over_failed_ones() -> None:
    donors = choice(avoid_seconds=60.0, backoff=0.1, max_backoff=0.1)
    donors.failed("donor-a", now=100.0)
    donors.failed("donor-b", now=100.0)
    assert {donors.pick([*DONORS, "new"], now=101.0 + i) for i in range(30)} == {"donor-c", "new"}


def test_failures_of_donors_no_longer_listed_do_not_matter() -> None:
    donors = choice(avoid_seconds=60.0, backoff=0.1, max_backoff=0.1)
    donors.failed("gone", now=100.0)
    assert donors.pick(["donor-a"], now=101.0) == "donor-a"


def test_donors_that_failed_lately_are_listed_for_avoid_seconds() -> None:
    choice = DonorChoice(avoid_seconds=60.0, avoid_stretch=1.0)
    choice.failed("a", 100.0)
    choice.failed("b", 130.0)
    assert choice.failed_lately(150.0) == {"a", "b"}
    assert choice.failed_lately(165.0) == {"b"}
    assert choice.failed_lately(200.0) == frozenset()


def test_failures_are_remembered_for_a_bounded_number_of_donors() -> None:
    from dedloc.daemon.collab.donors import MAX_REMEMBERED
    choice = DonorChoice(avoid_seconds=1e9)
    for i in range(3 * MAX_REMEMBERED):  # identities are free
        choice.failed(f"d{i}", float(i))
    lately = choice.failed_lately(3.0 * MAX_REMEMBERED)
    assert len(lately) <= MAX_REMEMBERED
    assert f"d{3 * MAX_REMEMBERED - 1}" in lately and "d0" not in lately  # the newest kept


def test_a_donor_that_fails_each_time_it_is_tried_is_avoided_longer_and_longer() -> None:
    # a liar claiming the head after ours that never serves it (or stalls every attempt) must
    # not be tried every minute: each failure since it last served doubles its avoidance
    choice = DonorChoice(avoid_seconds=60.0, max_avoid_seconds=600.0, avoid_stretch=1.0)
    choice.failed("liar", 100.0)  # (stamped when the attempt ended, by the caller)
    assert "liar" in choice.failed_lately(159.0) and "liar" not in choice.failed_lately(160.0)
    choice.failed("liar", 200.0)
    assert "liar" in choice.failed_lately(319.0) and "liar" not in choice.failed_lately(320.0)
    for at in (400.0, 500.0, 600.0, 700.0):
        choice.failed("liar", at)
    assert "liar" in choice.failed_lately(700.0 + 599.0)  # capped at max_avoid_seconds
    assert "liar" not in choice.failed_lately(700.0 + 600.0)
    assert choice.pick(["liar", "honest"], 800.0) == "honest"
    # a donor that serves us again starts afresh
    choice.succeeded("liar")
    assert "liar" not in choice.failed_lately(800.0)
    choice.failed("liar", 900.0)
    assert "liar" not in choice.failed_lately(960.0)


def test_a_donor_that_answers_only_busy_for_its_patience_failed() -> None:
    donors = choice(busy_patience=30.0)
    assert not donors.busy("donor-a", now=0.0)
    assert not donors.busy("donor-a", now=29.0)  # busy for a while: no failure yet
    assert donors.failed_lately(29.0) == frozenset()
    assert donors.busy("donor-a", now=30.0)  # busy for 30 s: a failure, avoided as one
    assert donors.failed_lately(30.0) == {"donor-a"}
    assert not donors.busy("donor-a", now=31.0)  # (its patience starts over)


def test_a_donor_that_served_us_starts_its_patience_over() -> None:
    donors = choice(busy_patience=30.0)
    donors.busy("donor-a", now=0.0)
    donors.succeeded("donor-a")
    assert not donors.busy("donor-a", now=40.0)
    assert not donors.busy("donor-a", now=69.0)
    assert donors.busy("donor-a", now=70.0)


def test_a_donor_busy_once_long_ago_is_not_busy_all_this_while() -> None:
    donors = choice(busy_patience=30.0)
    donors.busy("donor-a", now=0.0)  # (we downloaded from another donor then)
    assert not donors.busy("donor-a", now=500.0)  # the next epoch: its patience starts anew
    assert not donors.busy("donor-a", now=520.0)
    assert donors.busy("donor-a", now=530.0)


def test_busy_answers_are_remembered_for_a_bounded_number_of_donors() -> None:
    from dedloc.daemon.collab.donors import MAX_REMEMBERED

    donors = choice()
    for i in range(3 * MAX_REMEMBERED):
        donors.busy(f"identity-{i}", now=float(i))
    assert len(donors._busy_since) <= MAX_REMEMBERED


def test_a_donor_that_shed_us_is_left_out_until_the_time_it_named() -> None:
    chooser = choice(0)
    donors = ["a", "b", "c"]
    assert chooser.others(donors, "a", 0.0) == 2
    chooser.shed("a", 0.0, 3.0)
    assert chooser.others(donors, "b", 1.0) == 1  # (c: a shed us)
    assert {chooser.pick(donors, 1.0) for _ in range(50)} == {"b", "c"}
    assert chooser.wait(1.0) == 0.0  # no failure: no backoff
    assert chooser.pick(donors, 3.0) is not None and chooser.others(donors, "b", 3.0) == 2


def test_when_every_donor_shed_us_one_is_asked_saying_there_are_no_others() -> None:
    chooser = choice(0)
    donors = ["a", "b"]
    chooser.shed("a", 0.0, 5.0)
    chooser.shed("b", 0.0, 5.0)
    picked = chooser.pick(donors, 1.0)
    assert picked in donors
    assert chooser.others(donors, picked, 1.0) == 0  # (it serves us then: state_sync.py)


@pytest.mark.parametrize("retry_after", [float("nan"), -1.0, 0.0, 0.001, 1e308, float("inf")])
def test_a_donors_shed_time_is_bounded(retry_after: float) -> None:
    # (0: a hostile donor that wins its pairs would be asked again as fast as the network goes)
    chooser = choice(0, min_shed_seconds=1.0, max_shed_seconds=10.0)
    chooser.shed("a", 0.0, retry_after)
    assert chooser.others(["a", "b"], "b", 0.999) == 0  # out of the draw for min_shed_seconds
    assert {chooser.pick(["a", "b"], 0.999, {"a": 0, "b": 5}) for _ in range(20)} == {"b"}
    assert chooser.others(["a", "b"], "b", 10.0) == 1  # back in the draw by max_shed_seconds


def test_a_donor_that_shed_us_is_asked_before_a_full_one_saying_there_are_no_others() -> None:
    # A served two lately and shed us (it has a free slot); B answered a plain busy (it serves
    # two at once). We asked B again and again while A sat idle: now A is asked, told we have
    # nobody else, and serves us
    chooser = choice(0)
    chooser.shed("A", 0.0, 10.0)
    assert not chooser.busy("B", 0.1)
    chooser.full("B", 0.1)
    assert {chooser.pick(["A", "B"], 0.6) for _ in range(20)} == {"A"}
    assert chooser.others(["A", "B"], "A", 0.6) == 0
    # once B is no longer full, it is the one with room again
    assert chooser.pick(["A", "B"], 1.2) == "B" and chooser.others(["A", "B"], "B", 1.2) == 0


def test_a_download_done_starts_every_donors_busy_patience_over() -> None:
    # A sheds us in three flash crowds 25 s apart and B serves us each time: A's answers were
    # one long "only busy" streak, and it failed; now each download starts the patience over
    chooser = choice(0)
    for t in (0.0, 25.0, 50.0):
        assert not chooser.busy("A", t)
        chooser.shed("A", t, 10.0)
        chooser.succeeded("B")
    assert "A" not in chooser.failed_lately(50.0)


def test_shed_donors_are_remembered_for_a_bounded_number_of_donors() -> None:
    chooser = choice(0)
    for i in range(3 * MAX_REMEMBERED):
        chooser.shed(f"d{i}", 0.0, 5.0)
    assert len(chooser._shed_until) <= MAX_REMEMBERED


def test_only_a_donors_first_shed_since_a_download_is_worth_asking_another_at_once() -> None:
    chooser = choice(0)
    assert chooser.shed("A", 0.0, 5.0) is False  # first: ask another at once
    assert chooser.shed("A", 6.0, 5.0) is True  # again: at the pace of "busy" answers
    assert chooser.shed("B", 6.0, 5.0) is False
    chooser.succeeded("B")
    assert chooser.shed("A", 60.0, 5.0) is False  # a download since: first again
