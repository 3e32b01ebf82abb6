"""Table-driven tests of the run's estimate (heads, quorum) and of the decision core (policy.py):
1 to 8 peers, pauses, restarts, failed rounds, liars and skewed clocks. Pure, milliseconds."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedloc.daemon.collab.estimate import GlobalProgress, Head, estimate_global, quorum
from dedloc.daemon.collab.lineage import initial_lineage, next_lineage
from dedloc.daemon.collab.policy import (
    Average,
    CatchUp,
    Leave,
    Local,
    RoundResult,
    Schedule,
    Timing,
    Train,
    View,
    Wait,
    decide,
    round_key,
    state_round_due,
    step_allowed,
)
from dedloc.daemon.collab.progress import PeerProgress

NOW = 1_800_000_000.0
STALE = 30.0
TARGET = 1000
L0 = initial_lineage("fingerprint")
L1 = next_lineage(L0, "group-1")
L2 = next_lineage(L1, "group-2")
OTHER = next_lineage(L0, "another-group")  # a history that diverged from L1's at epoch 1
LIE = "f" * 32


def peer(name: str, epoch: int = 1, lineage: str | None = L1, *, samples: int = 10, total: int = 100,
         sps: float = 10.0, age: float = 0.0, role: str = "trainer", left: bool = False) -> PeerProgress:
    return PeerProgress(peer_id=name, epoch=epoch, samples_accumulated=samples,
                        samples_per_second=sps, time=NOW - age, expiration=NOW - age + STALE,
                        role=role, total_samples=total, left=left,  # type: ignore[arg-type]
                        lineage=lineage)


def fresh(name: str) -> PeerProgress:
    return peer(name, 0, L0, samples=0, total=0, sps=0.0)


def run_of(reports: list[PeerProgress], own: PeerProgress | None = None,
           received: dict[str, float] | None = None, target: int = TARGET) -> GlobalProgress:
    return estimate_global(reports, target_batch_size=target, now=NOW, own=own, stale_after=STALE,
                           received=received)


def view(own: PeerProgress, others: list[PeerProgress], **kwargs: object) -> View:
    schedule = kwargs.pop("schedule", Schedule(TARGET))
    local = Local(own.role, own.epoch, own.lineage, own.samples_accumulated,  # type: ignore[arg-type]
                  own.samples_per_second)
    return View(local, run_of(others, own), schedule, NOW, **kwargs)  # type: ignore[arg-type]


# --- the run's head -------------------------------------------------------------------------------

@pytest.mark.parametrize(("counted", "needed"), [(0, 1), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2),
                                                 (6, 3), (8, 3), (64, 22), (256, 86)])
def test_quorum_is_a_third(counted: int, needed: int) -> None:
    assert quorum(counted) == needed


HEAD_TABLE = [
    # (the live trainers' heads, the run's head, confirmed)
    ("one peer", [(3, L1)], (3, L1), True),
    ("two agree", [(3, L1), (3, L1)], (3, L1), True),
    ("two: the one ahead leads (a pause)", [(21, L2), (4, L1)], (21, L2), True),
    ("three: one ahead is not enough", [(21, L2), (4, L1), (4, L1)], (4, L1), True),
    ("three: two ahead confirm", [(5, L2), (5, L2), (4, L1)], (5, L2), True),
    ("four: one liar", [(10**9, LIE), (5, L1), (5, L1), (5, L1)], (5, L1), True),
    ("eight: two colluding liars", [(10**9, LIE)] * 2 + [(5, L1)] * 6, (5, L1), True),
    ("eight: three at the new epoch confirm it", [(6, L2)] * 3 + [(5, L1)] * 5, (6, L2), True),
    ("same epoch, two lineages: more holders win", [(5, OTHER)] * 2 + [(5, L1)] * 3, (5, L1), True),
    ("same epoch, a tie: the smaller lineage", [(5, L1), (5, OTHER)], (5, min(L1, OTHER)), True),
    ("nobody has a quorum: most holders", [(1, L1), (2, L2), (2, L2), (3, LIE), (4, OTHER),
                                           (5, "e" * 32), (6, "d" * 32)], (2, L2), False),
]


@pytest.mark.parametrize(("name", "heads", "expected", "confirmed"), HEAD_TABLE,
                         ids=[row[0] for row in HEAD_TABLE])
def test_run_head(name: str, heads: list[tuple[int, str]], expected: tuple[int, str],
                  confirmed: bool) -> None:
    run = run_of([peer(f"p{i}", e, lin) for i, (e, lin) in enumerate(heads)])
    assert (run.epoch, run.lineage) == expected
    assert run.confirmed is confirmed
    assert run.donors == tuple(sorted(f"p{i}" for i, h in enumerate(heads) if h == expected))


def test_fresh_peers_are_no_evidence() -> None:
    """A flash crowd of newcomers (epoch 0, nothing done) does not outvote the trainers."""
    veterans = [peer(f"v{i}", 50, L2) for i in range(12)]
    newcomers = [fresh(f"n{i}") for i in range(100)]
    run = run_of([*veterans, *newcomers])
    assert run.head == Head(50, L2)
    assert (run.counted_trainers, run.live_trainers) == (12, 112)
    # a run that has not started: everybody is fresh, and that is the head
    assert run_of(newcomers).head == Head(0, L0)
    # one run owner with a few volunteers joining: they follow it
    assert run_of([peer("owner", 50, L2), *newcomers[:9]]).head == Head(50, L2)


def test_a_starting_run_is_not_taken_over_by_a_few_identities_claiming_to_be_ahead() -> None:
    """Sixty peers start a run; two identities claim one far head. Fresh peers are no evidence,
    but they are many: the claimed head needs one holder per ten of them, and the run starts
    afresh (the price: three veterans cannot take a crowd of a hundred newcomers along)."""
    honest = [fresh(f"h{i}") for i in range(60)]
    liars = [peer(f"l{i}", 10**9, LIE) for i in range(2)]
    run = run_of([*honest, *liars])
    assert run.head == Head(0, L0)
    assert isinstance(decide(view(honest[0], [*honest[1:], *liars])), Train)
    few = [peer(f"v{i}", 50, L2) for i in range(3)]
    assert run_of([*few, *[fresh(f"n{i}") for i in range(100)]]).head == Head(0, L0)


def test_a_run_starts_without_being_taken_over_by_colluding_liars() -> None:
    """Honest peers that trained at epoch 0 count; three liars claiming one far head do not win."""
    honest = [peer(f"h{i}", 0, L0, samples=5, total=5) for i in range(8)]
    liars = [peer(f"l{i}", 10**9, LIE) for i in range(3)]
    assert run_of([*honest, *liars]).head == Head(0, L0)


def test_samples_count_at_the_head_only() -> None:
    run = run_of([peer("a", samples=300), peer("b", samples=300),
                  peer("behind", 0, L0, samples=900), peer("other", 1, OTHER, samples=900),
                  peer("aux", 1, L1, samples=900, role="aux")])
    assert run.samples_accumulated == 600
    assert run.trainers_at_epoch == 2
    assert (run.live_trainers, run.live_aux) == (4, 1)


def test_a_peers_claim_is_capped_at_a_few_fair_shares() -> None:
    """Among 64 at the head, one peer claiming a whole batch counts for 8/64 of it."""
    honest = [peer(f"h{i}", samples=0, sps=0.0) for i in range(63)]
    run = run_of([*honest, peer("liar", samples=10**12, sps=0.0)])
    assert run.samples_accumulated == TARGET * 8 // 64
    assert not run.ready
    # two peers: each may fill the batch alone
    assert run_of([peer("a", samples=TARGET), peer("b", samples=0)]).ready


def test_clock_skew_is_measured_on_our_clock() -> None:
    """A peer whose clock is 20 s behind: its report looks 20 s old; counted from when we first
    read it, its samples are not extrapolated by the skew."""
    slow_clock = peer("slow", samples=100, sps=10.0, age=20.0)
    assert run_of([slow_clock]).samples_accumulated == 100 + 200
    assert run_of([slow_clock], received={"slow": NOW - 1.0}).samples_accumulated == 100 + 10
    # and a report read long ago and never updated is stale whatever its clock says
    assert run_of([peer("dead", age=0.0)], received={"dead": NOW - STALE - 1}).live_trainers == 0


def test_a_farewell_leaves_the_run() -> None:
    assert run_of([peer("a"), peer("b", left=True)]).live_trainers == 1


# --- decisions ------------------------------------------------------------------------------------

def test_train_until_the_target_then_average() -> None:
    own = peer("me", samples=200)
    action = decide(view(own, [peer("a", samples=300)]))
    assert isinstance(action, Train)
    assert 0 < action.seconds <= 5.0
    # what the run needs, but no more than this peer trains before it looks again (10/s)
    assert action.samples == min(TARGET - 500, math.ceil(10.0 * action.seconds))
    unknown_rate = decide(view(peer("me", samples=200, sps=0.0), [peer("a", samples=300)]))
    assert isinstance(unknown_rate, Train) and unknown_rate.samples == TARGET - 500
    ready = decide(view(peer("me", samples=500), [peer("a", samples=500), peer("x", role="aux")]))
    assert ready == Average(Head(1, L1), expected=3, trainers=2)


def test_a_peer_trains_what_it_promised_before_it_averages() -> None:
    """The others extrapolated us to what our last report planned: a round that starts on that
    estimate gets those samples from us, so the batch is never short of the target."""
    others = [peer("a", samples=TARGET)]
    me = peer("me", samples=40)
    promised = dataclasses.replace(view(me, others).local, promised=100)
    action = decide(dataclasses.replace(view(me, others), local=promised))
    assert action == Train(60, 0.5)
    kept = dataclasses.replace(promised, accumulated=100)
    assert isinstance(decide(dataclasses.replace(view(me, others), local=kept)), Average)


def test_a_peer_with_nothing_accumulated_trains_a_batch_then_joins_the_round() -> None:
    action = decide(view(peer("me", samples=0), [peer("a", samples=TARGET)]))
    assert action == Train(1, 0.02)
    action = decide(view(peer("me", samples=4), [peer("a", samples=TARGET)]))
    assert action == Average(Head(1, L1), expected=2, trainers=2)


@pytest.mark.parametrize(("case", "own", "others", "expected"), [
    ("a newcomer", fresh("me"), [peer("a", 9, L2), peer("b", 9, L2)], CatchUp(Head(9, L2), ("a", "b"))),
    ("restarted from an old checkpoint", peer("me", 4, L1),
     [peer("a", 9, L2), peer("b", 9, L2)], CatchUp(Head(9, L2), ("a", "b"))),
    ("back from a pause, two trainers", peer("me", 4, L1, samples=0), [peer("a", 21, L2)],
     CatchUp(Head(21, L2), ("a",))),
    ("its round failed, the others stepped", peer("me", 1, L1, samples=400),
     [peer("a", 2, L2), peer("b", 2, L2)], CatchUp(Head(2, L2), ("a", "b"))),
    ("the smaller side of a healed partition", peer("me", 7, OTHER),
     [peer("a", 7, L2), peer("b", 7, L2), peer("c", 7, L2), peer("d", 7, OTHER)],
     CatchUp(Head(7, L2), ("a", "b", "c"))),
], ids=lambda value: value if isinstance(value, str) else "")
def test_catch_up(case: str, own: PeerProgress, others: list[PeerProgress], expected: CatchUp) -> None:
    assert decide(view(own, others)) == expected


def test_a_peer_ahead_trains_on_and_never_goes_back() -> None:
    """Its step is not confirmed (the others still report the epoch before): it keeps training,
    and it never downloads an earlier state."""
    action = decide(view(peer("me", 6, L2, samples=0), [peer("a", 5, L1), peer("b", 5, L1)]))
    assert isinstance(action, Train)


def test_a_liar_ahead_is_no_reason_to_catch_up() -> None:
    honest = [peer(f"h{i}", samples=100) for i in range(3)]
    action = decide(view(peer("me", samples=100), [*honest, peer("liar", 10**9, LIE, samples=TARGET)]))
    assert isinstance(action, Train)


def test_a_liar_about_samples_cannot_start_the_round_of_a_swarm() -> None:
    honest = [peer(f"h{i}", samples=1, sps=0.0) for i in range(30)]
    action = decide(view(peer("me", samples=1, sps=0.0), [*honest, peer("liar", samples=10**12)]))
    assert isinstance(action, Train)


def test_aux_averages_each_head_once() -> None:
    aux = peer("me", 3, L1, samples=0, total=0, sps=0.0, role="aux")
    others = [peer("a", 3, L1, samples=600), peer("b", 3, L1, samples=600)]
    assert decide(view(aux, others)) == Average(Head(3, L1), expected=3, trainers=2)
    again = decide(view(aux, others, averaged=Head(3, L1)))
    assert isinstance(again, Wait)
    assert isinstance(decide(view(aux, [peer("a", 3, L1, samples=10)])), Wait)
    needs_two = decide(view(aux, [peer("a", 3, L1, samples=TARGET)], schedule=Schedule(TARGET, 2)))
    assert isinstance(needs_two, Wait)
    # the run is ready but the aux peer has nothing to do there (its part done, or too few
    # trainers): it looks again no sooner than a trainer would (it looked every min_look, and
    # read the board 50 times a second)
    timing = Timing()
    for waiting in (again, needs_two):
        assert isinstance(waiting, Wait) and waiting.until - NOW >= timing.max_chunk


def test_blocked_waits() -> None:
    action = decide(view(peer("me", samples=TARGET), [], blocked="paused by the volunteer"))
    assert isinstance(action, Wait)
    assert action.reason == "paused by the volunteer"


def test_finished_lingers_while_someone_is_behind_then_leaves() -> None:
    schedule = Schedule(TARGET, epochs=10)
    me = peer("me", 10, L2)
    assert decide(view(me, [peer("a", 10, L2)], schedule=schedule)) == Leave("finished")
    lingering = decide(view(me, [peer("a", 9, L1)], schedule=schedule, finished_at=NOW - 5))
    assert isinstance(lingering, Wait)
    assert lingering.reason.startswith("lingering")
    too_long = decide(view(me, [peer("a", 9, L1)], schedule=schedule, finished_at=NOW - 1000))
    assert too_long == Leave("finished")
    aux = peer("x", 10, L2, role="aux", samples=0, total=0)
    assert decide(view(aux, [peer("a", 10, L2)], schedule=schedule)) == Leave("finished")
    # the trainers stepped the last epoch and left: the aux reduced that round, it is done too
    aux = peer("x", 9, L1, role="aux", samples=0, total=0)
    assert isinstance(decide(view(aux, [], schedule=schedule)), Wait)
    assert decide(view(aux, [], schedule=schedule, averaged=Head(9, L1))) == Leave("finished")


# --- stepping on a round --------------------------------------------------------------------------

ROUND_TABLE = [
    # (trainers at the head when it began, min_peers, the round's trainers, senders, failed parts, steps)
    ("all of them", 4, 1, 4, 4, 0, True),
    ("a majority", 5, 1, 3, 3, 0, True),
    ("half is not a majority", 4, 1, 2, 2, 0, False),
    ("alone among three", 3, 1, 1, 1, 0, False),
    ("alone when alone", 1, 1, 1, 1, 0, True),
    ("a lost part", 2, 1, 2, 2, 1, False),
    ("fewer senders than min_peers", 3, 3, 3, 2, 0, False),
    ("nobody sent anything", 2, 1, 2, 0, 0, False),
    ("newcomers with weight 0 step too", 4, 1, 4, 1, 0, True),
]


@pytest.mark.parametrize(("name", "at_head", "min_peers", "trainers", "senders", "failed", "steps"),
                         ROUND_TABLE, ids=[row[0] for row in ROUND_TABLE])
def test_step_allowed(name: str, at_head: int, min_peers: int, trainers: int, senders: int,
                      failed: int, steps: bool) -> None:
    action = Average(Head(1, L1), expected=at_head, trainers=at_head)
    result = RoundResult(trainers=trainers, senders=senders, failed_parts=failed)
    assert step_allowed(result, action, Schedule(TARGET, min_peers)) is steps
    assert not step_allowed(None, action, Schedule(TARGET, min_peers))


@given(at_head=st.integers(1, 300), a=st.integers(1, 300), b=st.integers(1, 300))
def test_two_groups_of_one_head_never_both_step(at_head: int, a: int, b: int) -> None:
    """Disjoint groups of the peers at one head: at most one may step (no split brain)."""
    if a + b > at_head:
        return
    action = Average(Head(1, L1), expected=at_head, trainers=at_head)
    schedule = Schedule(TARGET)
    both = [step_allowed(RoundResult(n, n, 0), action, schedule) for n in (a, b)]
    assert not all(both)


def test_state_rounds_and_keys() -> None:
    schedule = Schedule(TARGET, average_state_every=5)
    assert state_round_due(schedule, 10, 3)
    assert not state_round_due(schedule, 11, 3)
    assert not state_round_due(schedule, 10, 1)
    assert not state_round_due(dataclasses.replace(schedule, average_state_every=0), 10, 3)
    assert round_key("grad", Head(7, L1)) == f"grad/7/{L1[:16]}"
    assert round_key("grad", Head(7, L1)) != round_key("grad", Head(7, OTHER))


# --- the whole table: one step of every peer --------------------------------------------------------

def _step_everyone(heads: dict[str, tuple[int, str]]) -> dict[str, str]:
    """What each peer decides when all see the same reports."""
    reports = {name: peer(name, e, lin) for name, (e, lin) in heads.items()}
    decisions = {}
    for name, own in reports.items():
        others = [r for n, r in reports.items() if n != name]
        decisions[name] = type(decide(view(own, others))).__name__
    return decisions


@pytest.mark.parametrize("peers", range(1, 9))
def test_with_1_to_8_peers_everyone_at_the_head_trains_and_one_behind_catches_up(peers: int) -> None:
    heads = {f"p{i}": (5, L2) for i in range(peers)}
    assert set(_step_everyone(heads).values()) == {"Train"}
    if peers >= 2:
        heads["p0"] = (4, L1)  # its round failed
        decisions = _step_everyone(heads)
        assert decisions["p0"] == "CatchUp"
        assert all(d == "Train" for n, d in decisions.items() if n != "p0")


def test_too_few_trainers_for_min_peers_wait_with_their_batch() -> None:
    action = decide(view(peer("me", samples=TARGET), [], schedule=Schedule(TARGET, min_peers=2)))
    assert isinstance(action, Wait)
    assert action.reason == "waiting for trainers: 1 of 1 at the head, 2 needed"


def test_a_trainer_banned_here_makes_no_round_worth_starting() -> None:
    """A peer this one banned (a reducer proven to forge, say) still reports itself at the
    head, and will be refused from our round: with it counted, three honest trainers of a run
    with min_peers 4 started rounds of three, failed each at once (fewer senders than min_peers)
    and started the next: about three a second (benchmarks/hostile.py, forged_account: 85
    failed rounds per peer in 16 s). Without it they wait; the quorum still counts it."""
    own = peer("me", samples=300)
    others = [peer("a", samples=300), peer("b", samples=300), peer("bad", samples=300)]
    schedule = Schedule(TARGET, min_peers=4)
    assert decide(view(own, others, schedule=schedule)) == Average(Head(1, L1), 4, 4)
    action = decide(view(own, others, schedule=schedule, refused=frozenset({"bad", "gone"})))
    assert isinstance(action, Wait)
    assert action.reason == "waiting for trainers: 3 of 4 at the head (1 more banned here), 4 needed"
    # with min_peers met, the round goes on without it, and the others it expects are those left
    assert decide(view(own, others, refused=frozenset({"bad"}))) == Average(Head(1, L1), 3, 4)
    aux = peer("x", samples=0, total=0, sps=0.0, role="aux")
    assert isinstance(decide(view(aux, others, schedule=schedule, refused=frozenset({"bad"}))),
                      Wait)


def test_a_trainer_too_few_to_average_at_the_head_follows_trainers_it_trusts_that_stand_ahead(
        ) -> None:
    """Stranded: two honest trainers stepped on a round of four with two hostile identities,
    which did not step. Seven trainers: the step (2 of 7) has no quorum, so the run's head
    stays; the two honest trainers left there banned the identities, and counted too few at
    the head to average, for good (benchmarks/hostile.py, withheld_forgery, 3 identities).
    They follow the two ahead, whose head then has its quorum."""
    own = peer("me", samples=TARGET)
    behind = [peer("b", samples=TARGET), peer("h1", samples=TARGET), peer("h2", samples=TARGET),
              peer("h3", samples=TARGET)]
    ahead = [peer("a1", 2, L2, samples=50), peer("a2", 2, L2, samples=50)]
    schedule = Schedule(TARGET, min_peers=4)
    hostile = frozenset({"h1", "h2", "h3"})
    run = run_of([*behind, *ahead], own)
    assert run.head == Head(1, L1) and run.ahead == ((Head(2, L2), ("a1", "a2")),)
    assert decide(view(own, [*behind, *ahead], schedule=schedule, refused=hostile)) \
        == CatchUp(Head(2, L2), ("a1", "a2"))
    # identities it refuses, claiming a head of their own beside it, hide nothing
    decoys = [peer("h4", 2, "0" * 32), peer("h5", 2, "0" * 32)]  # (sorts first)
    assert decide(view(own, [*behind, *decoys, *ahead], schedule=schedule,
                       refused=hostile | {"h4", "h5"})) == CatchUp(Head(2, L2), ("a1", "a2"))
    # not the ones it refuses, though: with the two ahead banned here, it waits
    action = decide(view(own, [*behind, *ahead], schedule=schedule,
                         refused=hostile | {"a1", "a2"}))
    assert isinstance(action, Wait) and action.reason.startswith("waiting for trainers: 2 of 7")
    # nor a lone trainer ahead: its state would have no witness (a run starting with fewer
    # than min_peers follows no identity claiming to be ahead)
    action = decide(view(own, [*behind, *ahead], schedule=schedule, refused=hostile | {"a2"}))
    assert isinstance(action, Wait)
    # with enough trainers at the head, it averages there as before
    assert decide(view(own, [*behind, *ahead], schedule=schedule)) == Average(Head(1, L1), 5, 7)
    # and once the step has its quorum (three hold it), the run's head moves there
    run = run_of([*behind, *ahead, peer("c", 2, L2, samples=50)], own)
    assert run.head == Head(2, L2) and run.ahead == ()


def test_two_identities_claiming_the_next_epoch_draw_no_trainer_that_only_waits_for_honest_peers(
        ) -> None:
    """Not stranded: the trainers it lacks at the head are honest ones on their way (behind,
    catching up), not peers it refuses. Two identities at the next epoch on a lineage of their
    own (fewer than the third that moves the run's head) draw nobody; nor does a head two epochs
    ahead, nor one the run's head is not confirmed against (a run starting afresh)."""
    own = peer("me", samples=TARGET)
    here = [peer(name, samples=TARGET) for name in ("a", "b", "c")]
    late = [peer("d", 0, L0), peer("e", 0, L0)]
    liars = [peer("x1", 2, LIE), peer("x2", 2, LIE)]
    schedule = Schedule(TARGET, min_peers=6)
    assert isinstance(decide(view(own, [*here, *late, *liars], schedule=schedule)), Wait)
    assert isinstance(decide(view(own, [*here, *late, *liars], schedule=schedule,
                                  refused=frozenset({"zz"}))), Wait)
    # refused peers at the head make up the shortfall, but the ones ahead are two epochs on
    banned = [peer("h1", samples=TARGET), peer("h2", samples=TARGET)]
    far = [peer("x1", 3, LIE), peer("x2", 3, LIE)]
    assert isinstance(decide(view(own, [*here, *banned, *far], schedule=schedule,
                                  refused=frozenset({"h1", "h2"}))), Wait)


def test_after_a_round_that_failed_in_part_a_trainer_looks_whether_the_others_stepped() -> None:
    """A part of the round failed here only (a reducer's answer refused or withheld): the others
    may have stepped. The trainer looks at the run for a while; once they report the step, it
    catches up; if they did not, it averages at the head again."""
    own = peer("me", samples=500)
    others = [peer("a", samples=500), peer("b", samples=500)]
    waiting = decide(view(own, others))  # (Local built with no failure: averages)
    assert isinstance(waiting, Average)
    local = Local("trainer", 1, L1, 500, 10.0, failed_part_at=NOW - 0.5)
    run = run_of(others, own)
    action = decide(View(local, run, Schedule(TARGET), NOW))
    assert isinstance(action, Wait) and "whether the others stepped" in action.reason
    assert action.until == NOW + 0.5  # (looks again within a training chunk's time)
    later = decide(View(local, run, Schedule(TARGET), NOW + 2.0))
    assert isinstance(later, Average)
    stepped = run_of([peer("a", 2, L2, samples=0), peer("b", 2, L2, samples=0)], own)
    assert isinstance(decide(View(local, stepped, Schedule(TARGET), NOW)), CatchUp)


def test_a_peer_is_not_extrapolated_past_its_plan() -> None:
    """Peers train only what the run still needs (or are in a round): extrapolating them at full
    speed would start a round short of the target."""
    fast = dataclasses.replace(peer("a", samples=100, sps=10_000.0, age=1.0), planned=150)
    assert run_of([fast]).samples_accumulated == 150
    unplanned = peer("b", samples=100, sps=10.0, age=1.0)
    assert run_of([unplanned]).samples_accumulated == 110
    assert run_of([dataclasses.replace(fast, planned=0)]).samples_accumulated == 100


def test_a_lone_fast_trainer_waits_for_a_peer_that_is_catching_up() -> None:
    """Two trainers, the other behind (downloading): a round alone would let this one run away
    from it forever, so it waits; once the other is here, they average together."""
    me = peer("me", 5, L2, samples=TARGET)
    action = decide(view(me, [peer("b", 4, L1, samples=0)]))
    assert isinstance(action, Wait)
    assert "a majority needed" in action.reason
    assert decide(view(me, [peer("b", 5, L2, samples=10)])) == Average(Head(5, L2), 2, 2)
    # a peer that paused said farewell: alone, the run goes on
    assert decide(view(me, [peer("b", 4, L1, left=True)])) == Average(Head(5, L2), 1, 1)


def test_fresh_newcomers_do_not_hold_the_round_up() -> None:
    me = peer("me", 5, L2, samples=TARGET)
    action = decide(view(me, [peer("a", 5, L2), *[fresh(f"n{i}") for i in range(10)]]))
    assert action == Average(Head(5, L2), 2, 2)


# --- a first grid round waits for the view of the head to settle ------------------------------

def _grid_view(me: PeerProgress, others: list[PeerProgress], *, knows: bool, grew: float,
               ready: float | None, group: int = 4, roster: bool = False) -> View:
    base = view(me, others)
    local = dataclasses.replace(base.local, max_group_size=group, knows_round_members=knows,
                                head_grew_at=NOW - grew, ready_at=None if ready is None else NOW - ready,
                                roster_published=roster)
    return dataclasses.replace(base, local=local)


SETTLE_TABLE = [
    # (what this peer knows, seconds since the trainers at the head grew, since the target was
    # reached, max_group_size, averages now)
    ("the round's members known: no wait", True, 0.0, 0.0, 4, True),
    ("one group holds them all: no wait", False, 0.0, 0.0, 16, True),
    ("a first grid round, newcomers still arriving: wait", False, 2.0, 5.0, 4, False),
    ("a first grid round, settled: average", False, 12.0, 20.0, 4, True),
    ("never settling: average after max_settle", False, 1.0, 31.0, 4, True),
    ("when the target was reached unknown: settle only", False, 3.0, None, 4, False),
    ("still arriving, but the round's roster is out: average", False, 2.0, 5.0, 4, True),
]


@pytest.mark.parametrize(("case", "knows", "grew", "ready", "group", "averages"), SETTLE_TABLE,
                         ids=[c[0] for c in SETTLE_TABLE])
def test_a_first_grid_round_waits_for_the_view_of_the_head_to_settle(
        case: str, knows: bool, grew: float, ready: float | None, group: int, averages: bool) -> None:
    me = peer("me", 5, L2, samples=TARGET // 4)
    others = [peer(f"p{i}", 5, L2, samples=TARGET // 4) for i in range(5)]  # 6 trainers at the head
    roster = "roster is out" in case
    for role in ("trainer", "aux"):
        own = me if role == "trainer" else peer("me", 5, L2, samples=0, role="aux")
        action = decide(_grid_view(own, others, knows=knows, grew=grew, ready=ready, group=group,
                                   roster=roster))
        if averages:
            assert isinstance(action, Average), (case, role, action)
        else:
            assert isinstance(action, Wait) and "settle" in action.reason, (case, role, action)
            assert action.settling  # (the engine watches for the round's roster meanwhile)
            assert action.until <= NOW + 0.5  # it looks again soon: the view may settle any time

