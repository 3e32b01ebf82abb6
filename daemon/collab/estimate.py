"""The run as one peer sees it: its head, the samples accumulated toward the target, who is live.
Pure: no I/O, time is passed in.

`estimate_global` folds the live peers' progress reports (progress.py) into a `GlobalProgress`.

- **Liveness.** A report is dropped when expired (`expiration <= now`), older than `stale_after`
  seconds, or dated more than `stale_after` seconds in the future (a lying clock would otherwise
  stay fresh forever). Age is measured on this peer's clock from when the report was first read
  (`received`), when that is known, so that peers' clocks may be off by seconds. Per peer the
  latest report wins (by `time`, then `expiration`). `own`, the local peer's freshest state,
  replaces whatever the DHT holds for that peer and is never stale. A peer whose latest report
  is its farewell (`left`) is not live. A report of an epoch past `max_epoch` (the most this
  peer's own pace of the run makes believable, pace.py) holds no head and adds no samples
  (`beyond_pace` names its writers), but its writer still counts among the trainers with a
  history (`counted_trainers`, the quorum's base): a peer that believes nobody else must not
  see itself as the whole run and step alone. So does a report ahead of this peer's own epoch
  by a peer in `unserved`: one whose state this peer tried to download at its head lately and
  could not (refused or failed; the engine keeps the list, donors.py), listed in `unserved_ahead`.
  Identities that claim the epoch after the run's, on a lineage of their own, pass any pace; a
  third of them made the honest trainers catch up with a head none of them could serve, again
  and again, and nobody trained. Now they are tried, then passed over (for a minute, doubling
  with each failure, donors.py). A fresh peer (a newcomer) passes over only the peers in
  `contradicted`, whose state contradicted the head they reported (their own word against
  them): with every head it cannot download from set aside it would take its own empty head for
  the run's, train from scratch and, no longer fresh, count against the run's quorum (a
  newcomer whose downloads fail for its own reasons, a flaky link say, would have stalled a
  small run); but one identity that took a run at its start, reporting a far epoch before any
  peer had a pace, and sending its real state when asked, held every fresh peer in a download
  loop for ever (1 liar among 8 trainers: the run never stepped).
- **Heads.** A peer's head is its (epoch, lineage): where its state is. Live trainers at the same
  head hold the same state and average together. Fresh trainers (epoch 0, no samples at all: a
  newcomer, or a run not started) carry no evidence and are not counted, unless no other trainer
  is live.
- **The run's head** is the highest-epoch head that at least `quorum = ceil((n + 1) / 3)` of the
  `n` counted live trainers hold, and at least one per `FRESH_PER_HOLDER` fresh trainers (among
  several at one epoch: the one more hold, then the smallest lineage). So fewer than a third of
  the trainers, lying or lost, cannot move the run ahead, while a real step, which moves the
  majority of a round (policy.py), is confirmed as soon as its members report it; with one or
  two trainers, any one of them confirms (a peer coming back from a pause follows the other,
  which trained on; a run's first trainer is followed by the few that join it). A handful of
  identities claiming to be far ahead of a run that is starting does not make dozens of fresh
  peers follow them: the run starts afresh at the fresh peers' head. When no head has a quorum
  otherwise, the head most hold (then the highest epoch). With no trainer live, the same over
  the aux peers.
  `highest_epoch` is the highest epoch any live trainer reports, confirmed or not; `ahead`
  lists the heads past the run's that believed trainers hold, with their holders.
- **Samples.** Only trainers at exactly the run's head count: peers behind or on another lineage
  will catch up, peers ahead are unconfirmed. A counted trainer contributes its reported samples
  plus `samples_per_second * elapsed` (elapsed clamped to [0, stale_after]), at most what it
  said it would have accumulated by its next report (`planned`: a peer in a round, or one that
  trains only what the run still needs, is not extrapolated past that), at most the target
  and at most `SHARE_CAP` fair shares (`SHARE_CAP * target / trainers at the head`): one peer's
  claim cannot fill a swarm's batch. Aux peers never count toward samples.
- **Throughput** is the sum of the reported rates of the trainers at the head, so `eta_seconds`
  is consistent with the samples; 0 when the target is reached, None without throughput.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .progress import PeerProgress

__all__ = [
    "SHARE_CAP",
    "GlobalProgress",
    "Head",
    "estimate_global",
    "next_report_delay",
    "quorum",
]

#: No trainer counts for more than this many fair shares of the target batch.
SHARE_CAP = 8


@dataclass(frozen=True, order=True)
class Head:
    """Where a peer's state is: its epoch and lineage."""

    epoch: int
    lineage: str | None


#: A head must be held by at least one peer per this many fresh trainers (see the module docstring).
FRESH_PER_HOLDER = 10


def quorum(counted: int, fresh: int = 0) -> int:
    """How many of `counted` live trainers with a history must hold a head for it to be the
    run's, while `fresh` trainers (no history) are live too."""
    return max(1, math.ceil((counted + 1) / 3), math.ceil(fresh / FRESH_PER_HOLDER))


@dataclass(frozen=True)
class GlobalProgress:
    """The run's progress as one peer estimates it at `now` (see the module's rules).
    `contributions` maps every live peer to its `total_samples`, for status displays, and
    `live_peers` describes each live peer (role, epoch, throughput, samples, since when it takes
    part, when it last reported), for the dashboard's tables."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    live_trainers: int
    live_aux: int
    samples_per_second: float
    eta_seconds: float | None
    ready: bool
    now: float
    contributions: dict[str, int] = field(default_factory=dict)
    trainers_at_epoch: int = 0  # live trainers at exactly the run's head: the ones that average now
    step_overhead: float | None = None  # the worst `step_overhead` reported at the run's head
    live_peers: list[dict[str, Any]] = field(default_factory=list)
    highest_epoch: int = 0  # the highest epoch a live trainer reports (confirmed or not)
    lineage: str | None = None  # the run's head is (epoch, lineage)
    counted_trainers: int = 0  # live trainers that count toward the quorum (not fresh)
    quorum: int = 1
    confirmed: bool = True  # the head has a quorum (else: the best there is)
    donors: tuple[str, ...] = ()  # live trainers at the head, other than `own`
    beyond_pace: tuple[str, ...] = ()  # live peers whose epoch is past `max_epoch`: no head
    unserved_ahead: tuple[str, ...] = ()  # `unserved` peers reporting an epoch ahead of ours: no head
    # the heads past the run's that live trainers hold (believed: not beyond pace, not unserved;
    # unconfirmed), each with its holders other than `own`, lowest epoch first (policy.py: where
    # a trainer that cannot average at the run's head may go instead)
    ahead: tuple[tuple[Head, tuple[str, ...]], ...] = ()

    @property
    def head(self) -> Head:
        return Head(self.epoch, self.lineage)

    @property
    def remaining(self) -> int:
        return max(0, self.target_batch_size - self.samples_accumulated)


def _newer(a: PeerProgress, b: PeerProgress) -> bool:
    return (a.time, a.expiration) > (b.time, b.expiration)


def _choose_head(holders: Mapping[Head, int], counted: int, fresh: int) -> tuple[Head, bool]:
    """The run's head among `holders` (head -> live peers there): see the module docstring."""
    needed = quorum(counted, fresh)
    confirmed = [h for h, n in holders.items() if n >= needed]
    if confirmed:
        return min(confirmed, key=lambda h: (-h.epoch, -holders[h], h.lineage or "")), True
    return min(holders, key=lambda h: (-holders[h], -h.epoch, h.lineage or "")), False


def estimate_global(reports: Iterable[PeerProgress], *, target_batch_size: int, now: float,
                    own: PeerProgress | None = None, stale_after: float,
                    received: Mapping[str, float] | None = None,
                    max_epoch: int | None = None,
                    unserved: Collection[str] = (),
                    contradicted: Collection[str] = ()) -> GlobalProgress:
    """Fold the peers' reports into the run's progress at `now` (rules in the module docstring).
    `received` maps a peer id to when (on our clock) its report was first read; `max_epoch`:
    the highest epoch this peer believes (pace.py), None: any; `unserved`: peers whose state at
    their head this peer could not download lately (not believed ahead of `own`);
    `contradicted`: those of them that sent a state contradicting the head they reported (not
    believed ahead of `own` even while `own` is fresh)."""
    if isinstance(target_batch_size, bool) or not isinstance(target_batch_size, int) \
            or target_batch_size < 1:
        raise ValueError(f"target_batch_size must be a positive integer, got {target_batch_size!r}")
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")
    if not stale_after > 0 or not math.isfinite(stale_after):
        raise ValueError(f"stale_after must be positive and finite, got {stale_after!r}")
    received = received or {}

    def age(report: PeerProgress) -> float:
        seen = received.get(report.peer_id)
        return now - (seen if seen is not None else report.time)

    latest: dict[str, PeerProgress] = {}
    for report in reports:
        if own is not None and report.peer_id == own.peer_id:
            continue
        if report.expiration <= now or abs(now - report.time) > stale_after \
                or age(report) > stale_after:
            continue
        held = latest.get(report.peer_id)
        if held is None or _newer(report, held):
            latest[report.peer_id] = report
    if own is not None:
        latest[own.peer_id] = own
    latest = {peer_id: r for peer_id, r in latest.items() if not r.left}
    beyond: tuple[str, ...] = ()
    if max_epoch is not None:
        beyond = tuple(sorted(peer_id for peer_id, r in latest.items()
                              if r.epoch > max_epoch and r is not own))
    ahead_unserved: tuple[str, ...] = ()
    if own is not None:
        passed_over = set(contradicted if own.fresh else unserved)
        ahead_unserved = tuple(sorted(peer_id for peer_id in passed_over & set(latest)
                                      if latest[peer_id].epoch > own.epoch
                                      and peer_id not in beyond))
    unbelieved = {*beyond, *ahead_unserved}

    trainers = [r for r in latest.values() if r.role == "trainer"]
    aux = [r for r in latest.values() if r.role == "aux"]
    # who counts toward the quorum: trainers with a history; else (a run not started) any
    # trainer; else the aux peers
    fresh = [r for r in trainers if r.fresh]
    history = [r for r in trainers if not r.fresh]
    base, waiting = (history, len(fresh)) if history else (trainers or aux, 0)
    holders: dict[Head, int] = {}
    for r in base:
        if r.peer_id in unbelieved:  # (still counted in `base`: see the module docstring)
            continue
        head = Head(r.epoch, r.lineage)
        holders[head] = holders.get(head, 0) + 1
    if holders:
        head, confirmed = _choose_head(holders, len(base), waiting)
    else:  # (every peer with a history is disbelieved: fresh peers start the run afresh)
        head, confirmed = Head(0, None), not (history and fresh)
    if history and fresh and not confirmed:
        # no head with a history is held widely enough against the number of fresh peers (a run
        # starting while a few identities claim to be far ahead): the run starts afresh
        starts: dict[Head, int] = {}
        for r in fresh:
            starts[Head(r.epoch, r.lineage)] = starts.get(Head(r.epoch, r.lineage), 0) + 1
        head = min(starts, key=lambda h: (-starts[h], h.lineage or ""))
    counted_trainers = len(history) if history else len(trainers)

    at_head = [r for r in trainers
               if Head(r.epoch, r.lineage) == head and r.peer_id not in unbelieved]
    cap = min(float(target_batch_size), SHARE_CAP * target_batch_size / max(1, len(at_head)))
    samples = 0.0
    rate = 0.0
    for report in at_head:
        elapsed = min(max(age(report) if report is not own else 0.0, 0.0), stale_after)
        estimate = report.samples_accumulated + report.samples_per_second * elapsed
        if report.planned is not None:
            estimate = min(estimate, max(report.planned, report.samples_accumulated))
        samples += min(estimate, cap)
        rate += report.samples_per_second
    overheads = [r.step_overhead for r in at_head if r.step_overhead is not None]
    accumulated = math.floor(samples)
    remaining = max(0, target_batch_size - accumulated)
    if remaining == 0:
        eta: float | None = 0.0
    elif rate > 0:
        eta = remaining / rate
    else:
        eta = None
    own_id = None if own is None else own.peer_id
    above: dict[Head, list[str]] = {}
    for r in base:
        if r.epoch > head.epoch and r.role == "trainer" and r.peer_id not in unbelieved \
                and r.peer_id != own_id:
            above.setdefault(Head(r.epoch, r.lineage), []).append(r.peer_id)
    return GlobalProgress(
        epoch=head.epoch,
        lineage=head.lineage,
        samples_accumulated=accumulated,
        target_batch_size=target_batch_size,
        live_trainers=len(trainers),
        live_aux=len(aux),
        samples_per_second=rate,
        eta_seconds=eta,
        ready=accumulated >= target_batch_size,
        now=now,
        contributions={peer_id: r.total_samples for peer_id, r in sorted(latest.items())},
        trainers_at_epoch=len(at_head),
        highest_epoch=max((r.epoch for r in trainers if r.peer_id not in unbelieved),
                          default=head.epoch),
        step_overhead=max(overheads) if overheads else None,
        counted_trainers=counted_trainers,
        quorum=quorum(len(base), waiting),
        confirmed=confirmed,
        donors=tuple(sorted(r.peer_id for r in at_head if r.peer_id != own_id)),
        beyond_pace=beyond,
        unserved_ahead=ahead_unserved,
        ahead=tuple((h, tuple(sorted(above[h])))
                    for h in sorted(above, key=lambda h: (h.epoch, h.lineage or ""))),
        live_peers=[{"peer_id": peer_id, "role": r.role, "epoch": r.epoch, "lineage": r.lineage,
                     "samples_per_second": r.samples_per_second, "total_samples": r.total_samples,
                     "started_at": r.started_at, "reported_at": r.time, "stepped": r.stepped}
                    for peer_id, r in sorted(latest.items())],
    )


#: `next_report_delay` waits this fraction of the estimated time to the target.
REPORT_FRACTION = 0.5


def next_report_delay(global_progress: GlobalProgress, own_samples_per_second: float, *,
                      min_delay: float, max_delay: float) -> float:
    """Seconds until this peer should publish its progress and re-read the run's again.

    Rule: `REPORT_FRACTION` (one half) of the estimated time to the target, clamped to
    [min_delay, max_delay]. The rate is the larger of the run's and this peer's own throughput
    (this peer's may not be counted yet, e.g. while it resynchronises). Halving the remaining time
    at each read converges on the target geometrically, so the round starts at most about
    `min_delay` after the target is reached, while a run far from its target is read rarely.
    Ready: `min_delay`. No throughput at all: `max_delay`.
    """
    if not 0 <= min_delay <= max_delay or not math.isfinite(max_delay):
        raise ValueError(f"need 0 <= min_delay <= max_delay < inf, got {min_delay!r}, {max_delay!r}")
    if global_progress.ready:
        return min_delay
    rate = max(global_progress.samples_per_second, own_samples_per_second)
    if not rate > 0 or not math.isfinite(rate):  # NaN and inf too
        return max_delay
    eta = global_progress.remaining / rate
    return min(max(REPORT_FRACTION * eta, min_delay), max_delay)
