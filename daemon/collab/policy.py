"""What a peer of a run does next: train, average, catch up, wait or leave. Pure: a `View` in, an
`Action` out; no I/O, no clock (the time is in the view). Trainers and aux peers, collaborative
and local runs all decide here; the engine (engine.py) carries the actions out.

The rules, one each:
- **Blocked** (paused by the volunteer, outside the training hours, the machine busy): wait.
- **Finished** (the manifest's epochs reached): a trainer lingers (waits, serving its state to
  others) while some live trainer of the run is behind, for at most `Timing.linger`; then leave.
- **At the run's head** (estimate.py: the epoch and lineage a quorum of the trainers holds):
  once the run's samples at the head reach the target and at least `min_peers` trainers are
  there, average with everyone there (a trainer that has accumulated nothing, e.g. just after a
  download, first trains one batch, so that it contributes and steps with the others instead of
  falling behind); until then train, and look again after half the time to the target
  (`next_report_delay`). What a trainer says it will have accumulated by its next look
  (`planned` in its report, no more than it trains until then) is what the others extrapolate
  it to; it trains that much before it averages (`Local.promised`), so that the round's batch
  is never short of the target because peers counted on each other's plans.
- **Behind the head, or at its epoch on another lineage** (new, restarted, back from a pause, a
  round that failed for it, the smaller side of a partition): catch up, i.e. download the state
  of a peer at the head. A state never goes back to an earlier epoch.
- **Ahead of the head** (its step is not confirmed yet, or others failed the round it stepped):
  train on (the samples count once the run confirms its epoch) and look again.
- **A round is stepped on** (`step_allowed`) only when it ran in full, at least `min_peers`
  peers sent gradients, and its trainers are a majority of the run's live trainers with a
  history (`quorum_base`: those at the head, behind or ahead) when the round began: two groups
  can then never both step, so no two states of one epoch and lineage differ; a lone fast
  trainer never runs away from a peer that is catching up; and the step is confirmed as soon as
  its members report it. A trainer whose round failed keeps its gradients and joins the next
  round of the same head, at once; but where only a part of it failed (a reducer's answer it
  refused, or one withheld from it alone), the others may have stepped: it looks at the run
  for `Timing.failed_part_wait` first, and catches up if they did (before, it went back to a
  round of the old head that nobody came to, and waited it out: 11 s on loopback). So it does
  where its round failed a second time within that wait of the first: a trainer late to a round
  the others had stepped past (they answer its joins with `RoundOver` at once) would otherwise
  try it again 2-8 times a second until their reports, due after their state round, show the
  step. Without
  such a majority at the head, a trainer waits for it. A peer banned here does not count
  toward `min_peers` or the peers a round expects (it would be refused from it), only
  toward the quorum. **Stranded**: where it lacks them only for the peers it refuses (with
  them it would average) and trainers it does not refuse stand one epoch ahead of a confirmed
  head (the most of them at one head, at least `STRANDED_DONORS`), it catches up with them
  instead: they stepped on a round of a majority whose other members did not step (a hostile
  identity's part failed them, or it just did not step), and wait for a quorum that only the
  peers left at the head can give them. Seen with 3 hostile identities among 4 honest
  trainers (`min_peers` 4): two honest trainers stepped with two of the identities, and the two
  left behind, having banned the identities, counted too few at the head to average, for good.
  Two at least, so that a state downloaded there has a witness besides its donor
  (state_check.py); a head that trainers only claim to hold is tried once (a donor that cannot
  serve it is not believed ahead for a while: estimate.py); and only for want of refused peers,
  one epoch ahead, at a confirmed head, so that two identities claiming the next epoch draw
  nobody while honest peers are merely behind or the run is starting afresh.
- **A first grid round waits for the view to settle.** A round of more peers than one group
  holds is a grid round (grid.py), whose layout every peer computes from the trainers it sees at
  the head; after the first round the cells go to that round's members, which every peer that
  came out of it knows alike, but a peer that knows no such list (the run's first round, or the
  first after a restart) lays the grid out from its own view, and views that differ by a few
  newcomers put everyone in other slices. Such a peer averages only once the trainers it sees at
  the head have not grown for `Timing.settle` seconds (newcomers still arriving: wait), and at
  most `Timing.max_settle` seconds after the run reached its target there; its cells then go
  to the round's roster (roster.py), one list drawn from the trainers settled at the head, so
  that views still growing (a trickle of newcomers outlasting `max_settle`) agree on the grid.
  A peer still settling when the round's roster is published (others have begun: its view grew
  later than theirs, or it reached the target later) stops waiting and begins too: the roster
  may well list it, and its slice would wait for it (128 peers: the slices of four such peers
  each lost 11 s, and the round failed).
  Later rounds take their roster from the trainers that stepped into the head, as read off
  the board (peers read it apart).

An aux peer follows the head like a trainer and averages (weight 0: it only reduces) each head
once, when its trainers average. At a head that is ready but has nothing for it (its part there
done, or too few trainers for a round) it looks again no sooner than a trainer's `max_chunk`
(it looked every `min_look`, reading the board 50 times a second until the trainers stepped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .estimate import GlobalProgress, Head, next_report_delay

__all__ = [
    "WEIGHT_BUDGET",
    "WEIGHT_SLACK",
    "Action",
    "Average",
    "CatchUp",
    "Leave",
    "Local",
    "RoundResult",
    "Schedule",
    "Timing",
    "Train",
    "View",
    "Wait",
    "decide",
    "majority_at",
    "needed_trainers",
    "quorum_base",
    "round_key",
    "state_round_due",
    "step_allowed",
]

Role = Literal["trainer", "aux"]
# a member of a gradient round claims at most this many target batches: an honest trainer stops
# at the target, overshooting by one of its batches (one of up to 7 targets)
WEIGHT_SLACK = 8
# what a gradient round's senders weigh at most together, in epochs' samples, shared by the
# trainers each stands for (Group.bounded_weights): one identity's claim of samples it never
# computed counts at most 16 / (n + 1) epochs beside n honest trainers
WEIGHT_BUDGET = 2 * WEIGHT_SLACK


@dataclass(frozen=True)
class Schedule:
    """What the run's manifest fixes for every peer."""

    target_batch_size: int
    min_peers: int = 1
    epochs: int | None = None
    average_state_every: int = 0


@dataclass(frozen=True)
class Timing:
    """How often to look at the run, and how long to linger (seconds)."""

    min_look: float = 0.02
    max_look: float = 5.0
    max_chunk: float = 0.5  # a trainer looks at the run at least this often while training
    blocked_poll: float = 2.0
    linger: float = 120.0
    linger_poll: float = 1.0
    settle: float = 10.0  # a first grid round: the trainers seen at the head unchanged this long
    failed_part_wait: float = 2.0  # after a round that failed in part: look for the others' step
    max_settle: float = 30.0  # ... but no longer than this after the run reached its target


@dataclass(frozen=True)
class Local:
    """This peer, as it knows itself."""

    role: Role
    epoch: int
    lineage: str | None
    accumulated: int = 0
    samples_per_second: float = 0.0
    # the most this peer said it would accumulate at this head (its reports' `planned`, where
    # others extrapolate it): it trains that much before it averages (see `decide`)
    promised: int = 0
    # grid rounds (see "A first grid round waits"): the peers one group holds (0: any number),
    # whether this peer knows the members of the round that made its head, when the trainers it
    # sees at the run's head last grew, and when it saw the run reach its target there
    max_group_size: int = 0
    knows_round_members: bool = True
    head_grew_at: float | None = None
    ready_at: float | None = None
    roster_published: bool = False  # the round at the head has a roster: it has begun
    # when this peer's last round at its head failed in part (a reducer's answer refused or
    # withheld), or failed a second time within `Timing.failed_part_wait` of the first: the
    # other members may well have stepped on it
    failed_part_at: float | None = None

    @property
    def head(self) -> Head:
        return Head(self.epoch, self.lineage)


#: The fewest trainers, not refused here, at a head past the run's that a trainer too few to
#: average at the run's head follows (module docstring, "stranded").
STRANDED_DONORS = 2


@dataclass(frozen=True)
class View:
    """Everything a decision depends on. `run` is the estimate (estimate_global) at `now`, with
    this peer's own report in it; `finished_at` is when this peer reached the run's last epoch;
    `averaged` is the head of the last round an aux peer took part in with success."""

    local: Local
    run: GlobalProgress
    schedule: Schedule
    now: float
    timing: Timing = Timing()
    blocked: str | None = None
    finished_at: float | None = None
    averaged: Head | None = None
    # peers this peer's averaging refuses (banned here): a trainer at the head that will not be
    # in our round does not make one worth starting (the quorum still counts it)
    refused: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Train:
    """Train until `samples` more are accumulated or `seconds` have passed, then look again."""

    samples: int
    seconds: float


@dataclass(frozen=True)
class Average:
    """Average at `head` with the peers there: `expected` peers in all (trainers and aux);
    `trainers` is what `step_allowed` measures the group against (`quorum_base`)."""

    head: Head
    expected: int
    trainers: int


@dataclass(frozen=True)
class CatchUp:
    """Download the state of one of `donors`, which hold `head`."""

    head: Head
    donors: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Do nothing until `until` (or until something happens); `reason` is for the status."""

    until: float
    reason: str
    # settling before a first grid round: the engine watches for the round's roster meanwhile,
    # and looks again as soon as one is published (`Local.roster_published`)
    settling: bool = False


@dataclass(frozen=True)
class Leave:
    reason: str


Action = Train | Average | CatchUp | Wait | Leave


def decide(view: View) -> Action:
    """The next action (rules in the module docstring)."""
    local, run, schedule, timing, now = view.local, view.run, view.schedule, view.timing, view.now
    if view.blocked is not None:
        return Wait(now + timing.blocked_poll, view.blocked)
    # an aux peer is done once the run is, or once it reduced the round of the last epoch
    where = local.epoch if local.role == "trainer" \
        else max(run.epoch, -1 if view.averaged is None else view.averaged.epoch + 1)
    if schedule.epochs is not None and where >= schedule.epochs:
        return _finished(view)
    look = next_report_delay(run, local.samples_per_second, min_delay=timing.min_look,
                             max_delay=timing.max_look)
    here = _here(run, view.refused)
    if local.role == "aux":
        if run.ready and here >= schedule.min_peers and view.averaged != run.head:
            settling = _settling(view, run.trainers_at_epoch + run.live_aux)  # (as the grid lays out)
            if settling is not None:
                return settling
            return Average(run.head, here + run.live_aux, run.trainers_at_epoch)
        if run.ready:  # its part at this head done, or too few trainers for one: the next comes
            # with the trainers' step or a trainer's arrival, no sooner than a look of theirs
            # (at the run's ready time the look is min_look: it read the board 50 times a second)
            look = max(look, timing.max_chunk)
        return Wait(now + look, "following the run")
    if local.head == run.head:
        if run.ready and local.accumulated < local.promised:
            # the others counted on what we said we would have: keep the word, or the round's
            # batch falls short of the target
            return Train(local.promised - local.accumulated, timing.max_chunk)
        if run.ready and local.accumulated == 0:  # one batch first: every trainer contributes
            return Train(1, timing.min_look)
        if run.ready and local.failed_part_at is not None \
                and now < local.failed_part_at + timing.failed_part_wait:
            return Wait(min(now + timing.max_chunk, local.failed_part_at + timing.failed_part_wait),
                        "our round failed in part, or again at once: looking whether the others "
                        "stepped on it")
        if run.ready:
            base = quorum_base(run)
            if majority_at(run, local.head, schedule, view.refused):
                settling = _settling(view, run.trainers_at_epoch + run.live_aux)  # (as the grid lays out)
                if settling is not None:
                    return settling
                return Average(run.head, here + run.live_aux, base)
            # too few here for a round that may be stepped on, for want of the peers we refuse:
            # follow trainers we do not refuse that stepped ahead (module docstring, "stranded")
            stranded = _stranded(view, base)
            if stranded is not None:
                return stranded
            # else wait for them (a batch is enough; before, a peer banned here but at the head
            # made the others start rounds it was refused from, failing each at once: about
            # three a second)
            refused = run.trainers_at_epoch - here
            who = f"{here} of {base} at the head" + (f" ({refused} more banned here)" if refused
                                                    else "")
            return Wait(now + timing.max_chunk,
                        f"waiting for trainers: {who}, {schedule.min_peers} needed"
                        if here < schedule.min_peers else
                        f"waiting for trainers: {who}, a majority needed")
        wanted = min(schedule.target_batch_size - local.accumulated, run.remaining)
        return Train(_chunk(local, wanted, look), look)
    if local.epoch <= run.epoch:  # behind, or at the head's epoch on another lineage
        if run.donors:
            return CatchUp(run.head, run.donors)
        # the head is only the aux peers' word: nobody to download from
        return Wait(now + look, "waiting for a trainer at the run's head")
    # ahead: our step is not confirmed yet; what we accumulate counts once it is
    return Train(_chunk(local, schedule.target_batch_size - local.accumulated, look), look)


def _here(run: GlobalProgress, refused: frozenset[str]) -> int:
    """The trainers at the run's head that this peer's averaging does not refuse."""
    return run.trainers_at_epoch - len(refused.intersection(run.donors))


def majority_at(run: GlobalProgress, head: Head, schedule: Schedule,
                refused: frozenset[str] = frozenset()) -> bool:
    """Whether a trainer at `head` has a round there that may be stepped on, once the run reaches
    its target: `head` is the run's, and the trainers there that it does not refuse are enough
    (`min_peers`) and a majority of the run's (`quorum_base`)."""
    if head != run.head:
        return False
    here = _here(run, refused)
    return here >= schedule.min_peers and 2 * here > quorum_base(run)


def _stranded(view: View, base: int) -> CatchUp | None:
    """Where a trainer too few to average at the run's head, for want of the peers it refuses,
    goes instead: the head one epoch past the run's that the most trainers it does not refuse
    hold, at least `STRANDED_DONORS` of them (module docstring, "stranded")."""
    run, schedule = view.run, view.schedule
    if not view.refused or not run.confirmed or run.trainers_at_epoch < schedule.min_peers \
            or 2 * run.trainers_at_epoch <= base:
        return None  # (the peers it refuses are not what it lacks: a round here waits for others)
    options = [(head, tuple(d for d in holders if d not in view.refused))
               for head, holders in run.ahead if head.epoch == run.epoch + 1]
    options = [(head, donors) for head, donors in options if len(donors) >= STRANDED_DONORS]
    if not options:
        return None
    head, donors = min(options, key=lambda o: (-len(o[1]), o[0].lineage or ""))
    return CatchUp(head, donors)


def _settling(view: View, expected: int) -> Wait | None:
    """Wait before a first grid round while the view of the head still grows (module docstring)."""
    local, timing, now = view.local, view.timing, view.now
    if local.knows_round_members or not 0 < local.max_group_size < expected \
            or local.head_grew_at is None or local.roster_published:
        return None
    until = local.head_grew_at + timing.settle
    if local.ready_at is not None:
        until = min(until, local.ready_at + timing.max_settle)
    if now >= until:
        return None
    return Wait(min(until, now + timing.max_chunk),
                f"waiting for the trainers at the head to settle before a grid round of {expected}",
                settling=True)


def _chunk(local: Local, wanted: int, look: float) -> int:
    """What to train before the next look: `wanted`, but no more than this peer trains in
    `look` seconds (what it trains is what it promises, `Local.promised`)."""
    if local.samples_per_second > 0 and math.isfinite(local.samples_per_second):
        wanted = min(wanted, math.ceil(local.samples_per_second * look))
    return max(1, wanted)


def quorum_base(run: GlobalProgress) -> int:
    """The trainers a round must have more than half of to be stepped on: every live trainer
    with a history (those behind or ahead too: a lone fast trainer must not run away from a peer
    that is catching up), and at least those at the head."""
    return max(run.counted_trainers, run.trainers_at_epoch)


def _finished(view: View) -> Action:
    local, run, timing, now = view.local, view.run, view.timing, view.now
    if local.role == "trainer":
        behind = any(p["role"] == "trainer" and p["epoch"] < local.epoch for p in run.live_peers)
        since = view.finished_at if view.finished_at is not None else now
        if behind and now - since < timing.linger:
            return Wait(min(now + timing.linger_poll, since + timing.linger),
                        "lingering: serving the final state to peers behind")
    return Leave("finished")


@dataclass(frozen=True)
class RoundResult:
    """What a round did, as the averager reported it."""

    trainers: int  # group members that step on this round (trainers, whether they sent or not)
    senders: int  # members that sent a vector (weight > 0)
    failed_parts: int  # parts of the vector that were not averaged


def needed_trainers(action: Average, schedule: Schedule) -> int:
    """The fewest trainers a round of `action` may be stepped on with (`step_allowed`)."""
    return max(1, schedule.min_peers, action.trainers // 2 + 1)


def step_allowed(result: RoundResult | None, action: Average, schedule: Schedule) -> bool:
    """Whether the members of a round may step on it (see the module docstring)."""
    if result is None or result.failed_parts:
        return False
    return result.senders >= max(1, schedule.min_peers) and 2 * result.trainers > action.trainers


def state_round_due(schedule: Schedule, epoch: int, trainers: int) -> bool:
    """After the step to `epoch`: also average the state (parameters and optimizer) with the
    round's trainers, which folds float drift between devices back in."""
    every = schedule.average_state_every
    return every > 0 and epoch % every == 0 and trainers > 1


def round_key(kind: Literal["grad", "state"], head: Head) -> str:
    """The averaging key of a round at `head`: only peers of one epoch and lineage meet."""
    return f"{kind}/{head.epoch}/{(head.lineage or 'none')[:16]}"
