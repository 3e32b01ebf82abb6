"""Grid rounds: a run with more peers than one group may hold still averages as one.

A round of `n` trainers, more than `averaging.max_group_size` (G) with the aux peers, runs as a
Moshpit-style grid average (Ryabinin et al., "Moshpit SGD", NeurIPS 2021): the trainers are laid
out on a `d`-dimensional grid of side `M` (the least `d` with `M = ceil(n ** (1/d))` small enough
that a group of M and its aux peers fits in G), each trainer at the cell given by its rank in an
order by a hash of the round's key and its peer id (rank i fills the cell whose digits in base M
are i's, stage 0's digit the most significant). The round has `d` stages; in stage `s` each
trainer averages with the trainers that share all its coordinates but the s-th (a row, then a
column, ...), weighted by the weight each brings. After stage `s` a trainer holds the weighted
mean of its *block* (the trainers that share its coordinates s+1 ...), and their total weight is
the weight it brings to the next stage; after the last stage that is the exact weighted mean of
all n trainers, the same on every trainer, also on a partly filled grid: where a slice's cell
is empty but its block is not (the partial end of the grid), another trainer of that block, which
holds the same mean, stands in for it (`GridLayout.duties`: it joins that slice's round too with
a copy of its vector and keeps only its own slice's result). Filling stage 0's digit first keeps
the stand-ins spread: no trainer stands in more than once or twice.

Every peer that sees the same trainers at the run's head (the progress board) computes the same
grid, so stages need no search for peers: each is a direct round (matchmaking.py) under a key
that names the stage and the slice. A peer whose view differs (a trainer that joined a moment
ago) lands in a smaller slice for one round; nothing else breaks. Aux peers hold no cell: in
each stage an aux peer reduces for one slice, chosen by a hash, and the trainers of that slice
expect it.

What a stage reports (`AveragingReport.represented`, `weight`) is what the next stage sends;
the round's report (`grid_report`) says how many trainers the final average stands for (its
`trainers` and `senders`, which the step rule measures against the run's trainers), names the
round after its key (`grid/<key>`, the same for every member: the lineage after the step is
then the same on every trainer of the round), and lists as its members every peer the grid was
laid out for (each one's slices met all of them, directly or through the others: the state
round that may follow lays out the same grid from them). The cells go to the members of the
round that made the run's head (every peer out of it knows the same list); trainers new to the
head help like aux peers, unless those members are too few to seat them (then every trainer gets
a cell) or a roster that holds most trainers keeps the cells (then the others sit the round
out), and aux peers that do not fit beside the cells sit it out too (`GridRounds.layout`).
Pure layout functions here; `GridRounds` runs the stages through
one-group rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import structlog

from ..averaging.errors import AveragingError
from ..averaging.report import AveragingReport, merge_ranges
from .errors import RoundSatOut
from .progress import Role

log = structlog.get_logger(__name__)

__all__ = ["GridLayout", "GridRounds", "Stage", "grid_layout", "grid_report"]

MAX_STAGES = 4
# A helper (a trainer without a cell) brings its weight in stage 0; in the later stages its
# slice's cells carry that weight, yet it needs the round's mean back. A member of weight 0 sends
# nothing, and the all-reduce returns the averages only to those that send: such a helper kept
# its block's mean in every part but the one it reduced (48 trainers in groups of 16: the 4
# helpers of the first round stepped 2e-3 to 5.9e-3 from the others, on the same lineage). So it
# sends with this share of its block's weight: far below float32's resolution (2**-24), so the
# mean is the cells' to the last bit but for an ulp, and every member gets the same bytes.
LISTENING_SHARE = 2.0 ** -40


@dataclass(frozen=True)
class Stage:
    """One stage of a grid round for one peer: the key suffix naming its slice and the peers
    (trainers and aux) it averages with there, itself included."""

    label: str
    peers: tuple[str, ...]


@dataclass(frozen=True)
class GridLayout:
    """Where each trainer of a grid round sits (`cells`), and who else takes part (`helpers`:
    aux peers, and trainers that hold no cell: newcomers to the head)."""

    side: int
    dimensions: int
    cells: dict[str, tuple[int, ...]]  # trainer -> its coordinates
    helpers: tuple[str, ...] = ()
    # the helpers that train (newcomers to the head): they bring their weight in stage 0 only
    # (after it, their slice's real members carry it) and are placed before the aux peers
    training_helpers: tuple[str, ...] = ()
    max_group_size: int = 0  # a slice with its helpers holds at most this many (0: no bound)
    # helpers placed before all others, in one order (a roster's list, the same on every peer:
    # grid_layout), those this peer does not see included: they take their room, so that the
    # others land alike on every peer, but no stage expects them
    listed_helpers: tuple[str, ...] = ()
    _slice_cache: dict[int, dict[str, tuple[str, ...]]] = field(
        default_factory=dict, compare=False, repr=False)
    _helper_cache: dict[tuple[str, int], dict[str, str]] = field(
        default_factory=dict, compare=False, repr=False)

    def stages(self, peer: str, key: str = "") -> list[Stage | None]:
        """The stages `peer` (a trainer with a cell, or one of the helpers) takes part in: None
        for a stage where a helper found no slice with room (it sits that stage out)."""
        out: list[Stage | None] = []
        for s in range(self.dimensions):
            slices = self._slices(s)
            if peer in self.cells:
                label: str | None = _label(self.cells[peer], s)
            else:
                label = self._placed(key, s).get(peer)
            out.append(None if label is None
                       else Stage(f"m{s}/{label}", self._with_helpers(slices[label], label, key, s)))
        return out

    def duties(self, peer: str, key: str = "") -> list[list[Stage]]:
        """For each stage, the slices other than its own where trainer `peer` stands in for an
        empty cell of a partly filled grid (most trainers: none)."""
        out: list[list[Stage]] = []
        for s in range(self.dimensions):
            slices = self._slices(s)
            own = _label(self.cells[peer], s) if peer in self.cells else None
            out.append([Stage(f"m{s}/{label}", self._with_helpers(members, label, key, s))
                        for label, members in slices.items()
                        if label != own and peer in members])
        return out

    def _with_helpers(self, members: tuple[str, ...], label: str, key: str, s: int) -> tuple[str, ...]:
        placed = self._placed(key, s)
        return tuple(sorted({*members, *(h for h, at in placed.items() if at == label)}))

    def _placed(self, key: str, s: int) -> dict[str, str]:
        """Stage `s`'s helpers -> their slice: the one a hash picks, or the next with room (a
        slice holds at most `max_group_size` peers); the listed helpers first, then the
        training helpers, each in an order by hash, then the aux peers. A helper no slice has
        room for is left out of the stage."""
        cached = self._helper_cache.get((key, s))
        if cached is not None:
            return cached
        slices = self._slices(s)
        labels = sorted(slices)
        room = {label: (self.max_group_size - len(members)) if self.max_group_size > 0 else len(self.helpers)
                for label, members in slices.items()}
        training, listed = set(self.training_helpers), set(self.listed_helpers)

        def order(helper: str) -> tuple[bool, bool, bytes]:
            return (helper not in listed, helper not in listed and helper not in training,
                    hashlib.sha256(f"{key}\0order\0{helper}\0{s}".encode()).digest())

        placed: dict[str, str] = {}
        for helper in sorted({*self.helpers, *self.listed_helpers}, key=order):
            first = _hash_index(key, f"helper\0{helper}\0{s}", len(labels))
            for step in range(len(labels)):
                label = labels[(first + step) % len(labels)]
                if room[label] > 0:
                    room[label] -= 1
                    placed[helper] = label
                    break
        unseen = set(self.listed_helpers) - set(self.helpers)
        placed = {helper: label for helper, label in placed.items() if helper not in unseen}
        self._helper_cache[(key, s)] = placed
        return placed

    def _slices(self, s: int) -> dict[str, tuple[str, ...]]:
        """Stage `s`'s slices: label -> its trainers, one per block of the stage before: the
        trainer at the slice's cell of that block, or a stand-in from the block where the cell
        is empty (only slices that hold a trainer's own cell run)."""
        cached = self._slice_cache.get(s)
        if cached is not None:
            return cached
        by_cell = {cell: trainer for trainer, cell in self.cells.items()}
        blocks: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # (digit s, digits > s) -> cells
        for cell in sorted(by_cell):
            blocks.setdefault(cell[s:], []).append(cell)
        own_labels = sorted({_label(cell, s) for cell in by_cell})
        slices: dict[str, tuple[str, ...]] = {}
        for position, label in enumerate(own_labels):
            digits = [None if part == "x" else int(part) for part in label.split(".")]
            members = []
            for v in range(self.side):
                cell = tuple(v if i == s else d for i, d in enumerate(digits))
                trainer = by_cell.get(cell)  # type: ignore[arg-type]
                if trainer is None:
                    block = blocks.get(cell[s:])  # type: ignore[arg-type]
                    if not block:
                        continue
                    trainer = by_cell[block[position % len(block)]]
                members.append(trainer)
            slices[label] = tuple(members)
        self._slice_cache[s] = slices
        return slices

    def max_represents(self, stage: int) -> int:
        """The most trainers one member's vector can stand for in `stage` (a member's claim
        counts for no more: a peer claiming thousands cannot make a slice a majority): what
        the slices of the stages before can hold, at most every trainer of the grid."""
        return min((self.side + len(self.helpers)) ** stage, len(self.cells) + len(self.helpers))


def grid_layout(key: str, trainers: Sequence[str], max_group_size: int,
                helpers: Sequence[str] = (), training_helpers: Sequence[str] = (),
                listed: tuple[Sequence[str], int] | None = None) -> GridLayout | None:
    """The grid of a round of `trainers` (each given a cell) and `helpers` under `key` (of which
    `training_helpers` train), or None when they fit in one group (or no grid of at most
    MAX_STAGES stages fits). The fewest stages whose slices have room for twice the helpers'
    mean (they land by a hash); else, given `listed`, the fewest in which every listed
    helper finds a slice in every stage (the others may sit stages out): where the cells fill
    the slices nearly to `max_group_size`, the first rule seats no helper, and newcomers to
    the head sat every round out (8 cells and 4 newcomers in groups of 4: 90 failed rounds in
    5 epochs, a third of the live trainers left out of a round). `listed`: the helpers that
    train (ids) and the number of other helpers to lay the grid out for, agreed by every peer
    of the round (a roster's, roster.py), where the `helpers` each peer sees are its own view:
    the stages follow the list, and the listed ids are placed first, in one order, those this
    peer does not see included (they take their room but no stage expects them), so views
    that differ by a newcomer lay out one grid and place the listed ones alike; the others a
    peer sees go where room is left. (Without an agreed list the second rule is not tried: a
    view with one helper more would lay out more stages, and the round would fail; a rule
    without slack seats them only by one order on all peers.)"""
    base = sorted(set(trainers))
    extra = sorted(set(helpers) - set(base))
    training = tuple(sorted(set(training_helpers) & set(extra)))
    first = tuple(sorted(set(listed[0]) - set(base))) if listed is not None else ()
    n = len(base)
    helping, training_count = (len(extra), len(training)) if listed is None \
        else (len(first) + listed[1], len(first))
    if n + helping <= max_group_size or n < 2:
        return None
    ranked = sorted(base, key=lambda p: hashlib.sha256(f"{key}\0grid\0{p}".encode()).digest())

    def laid_out(dimensions: int, side: int) -> GridLayout:
        cells = {p: tuple((i // side ** (dimensions - 1 - s)) % side for s in range(dimensions))
                 for i, p in enumerate(ranked)}
        return GridLayout(side, dimensions, cells, tuple(extra), training, max_group_size,
                          first)

    sides = {d: _root_ceil(n, d) for d in range(2, MAX_STAGES + 1)}
    for dimensions, side in sides.items():
        slices = math.ceil(n / side)  # slices per stage, about
        if side >= 2 and side + math.ceil(2 * helping / slices) <= max_group_size:
            return laid_out(dimensions, side)
    if not training_count or listed is None:  # (views of the helpers differ: see below)
        return None
    for dimensions, side in sides.items():
        if not 2 <= side < max_group_size:
            continue
        layout = laid_out(dimensions, side)  # (a helper finds a slice while any has room)
        if all(sum(max_group_size - len(m) for m in layout._slices(s).values()) >= training_count
               for s in range(dimensions)):
            return layout
    return None


def _root_ceil(n: int, d: int) -> int:
    """The least m with m ** d >= n."""
    m = max(1, round(n ** (1 / d)))
    while m ** d < n:
        m += 1
    while m > 1 and (m - 1) ** d >= n:
        m -= 1
    return m


def _label(cell: tuple[int, ...], s: int) -> str:
    return ".".join("x" if i == s else str(c) for i, c in enumerate(cell))


def _hash_index(key: str, text: str, count: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}\0{text}".encode()).digest()[:8], "big") % count


def grid_report(key: str, stages: Sequence[AveragingReport], everyone: Sequence[str]) -> AveragingReport:
    """The round's report from its stages' (see the module docstring); its members are
    `everyone` the grid was laid out for (met in a stage or through one)."""
    last = stages[-1]
    represented = min(last.represented, len(everyone))  # never more than the grid holds
    members = sorted({*everyone, *(m for r in stages for m in r.members)})
    failed = merge_ranges(p for r in stages for p in r.failed_parts)
    excluded: dict[str, str] = {}
    rejected: dict[str, str] = {}
    for r in stages:
        excluded.update(r.senders_excluded)
        rejected.update(r.senders_rejected)
    return AveragingReport(
        key=key, group_id=f"grid/{key}", members=tuple(members), trainers=represented,
        senders=represented, part=stages[0].part, shares=stages[0].shares,
        seconds=round(sum(r.seconds for r in stages), 4),
        matchmaking_seconds=round(sum(r.matchmaking_seconds for r in stages), 4),
        allreduce_seconds=round(sum(r.allreduce_seconds for r in stages), 4),
        bytes_sent=sum(r.bytes_sent for r in stages),
        bytes_received=sum(r.bytes_received for r in stages), failed_parts=failed,
        senders_excluded=excluded, senders_rejected=rejected, finished_at=last.finished_at,
        weight=last.weight, represented=represented, stages=len(stages),
        # our own vector went out in the first stage we were not alone in
        part_bounds=stages[0].part_bounds, chunk_elements=stages[0].chunk_elements,
        compression=stages[0].compression, aggregation=stages[0].aggregation,
        contributions_clipped=sum(r.contributions_clipped for r in stages))


# One stage: (vector, key suffix, weight, represents, max_represents, peers, min_trainers,
# leaders) -> its report; `max_represents` bounds what any member's `represents` counts for;
# `leaders`: the slice's trainers with a cell, ranked first for leading (every member of the
# slice knows them, where views of the helpers may differ).
StageRound = Callable[[np.ndarray, str, float, int, int, tuple[str, ...], int, tuple[str, ...]],
                      Awaitable[AveragingReport | None]]


class GridRounds:
    """Runs a grid round's stages through `stage_round` (one group each)."""

    def __init__(self, peer_id: str, max_group_size: int) -> None:
        self.peer_id = peer_id
        self.max_group_size = max_group_size

    def layout(self, key: str, trainers: Sequence[str], aux: Sequence[str], role: Role,
               leaders: Sequence[str] = (), *, roster: bool = False,
               helpers_said: tuple[Sequence[str], int] | None = None) -> GridLayout | None:
        """The grid of a round with `trainers` and `aux` peers (this peer aside). The cells go
        to the trainers among `leaders` (the members of the round that made the head: the same
        list on every peer that came out of it, where views of who is at the head differ a
        little, and a grid laid out on another set of trainers puts everyone elsewhere); the
        other trainers and the aux peers are helpers. Without leaders, the cells go to all the
        trainers this peer sees. Where the leaders are too few to seat the others as helpers,
        every trainer seen gets a cell; but where they are the round's agreed `roster`
        (roster.py: the same list on every peer, where views differ) and more than half of the
        trainers seen, the cells stay theirs and the helpers sit the round out, so that every
        peer still lays out the same grid; `helpers_said`: the trainers (ids) and the number of
        aux peers its writer saw beside the roster, so that every peer lays the grid out for
        those helpers (grid_layout's `listed`), those it does not see included. A list by which
        the cells alone would fit one group is not one an honest writer of a grid round makes:
        it is ignored."""
        me = {self.peer_id}
        seen = {*trainers, *(me if role == "trainer" else set())}
        base = (seen & set(leaders)) - set(aux) if leaders else seen
        if len(base) < 2:
            base = seen
        # (the list, where the roster has one, is the same on every peer that took it: each
        # reads from it alone whether a grid is needed and whether the roster is a majority)
        listed: tuple[Sequence[str], int] | None = None
        if roster and helpers_said is not None:
            named = sorted(set(helpers_said[0]) - base)
            if len(base) + len(named) + helpers_said[1] > self.max_group_size:
                listed = (named, helpers_said[1])
        # (a roster of at most half the trainers can make no step on its own cells: the round
        # needs more than half of them, so all get a cell, views differing or not)
        agreed = roster and 2 * len(base) > (len(base) + len(listed[0]) if listed is not None
                                             else len(seen))
        if not agreed:
            listed = None
        helpers = {*aux, *(me if role == "aux" else set()), *(seen - base)}
        layout = grid_layout(key, sorted(base), self.max_group_size, sorted(helpers),
                             sorted(seen - base), listed=listed)
        if layout is None and base != seen and not agreed:
            # the leaders are too few to seat the others as helpers (a round that stepped with
            # 3 of 8 trainers, in groups of 4: no grid of 3 cells has room for 6 helpers, and
            # a one-group round of 4 never holds the majority a step needs): every trainer
            # seen gets a cell
            layout = grid_layout(key, sorted(seen), self.max_group_size,
                                 sorted({*aux, *(me if role == "aux" else set())}))
        if layout is None and len(seen) + len(aux) + (role == "aux") > self.max_group_size:
            # nor do the aux peers fit beside the cells (4 trainers and an aux peer in groups
            # of 2), or the helpers beside the roster's cells: the cells average on a grid of
            # their own and the others sit it out (a one-group round could never hold the
            # majority a step needs)
            layout = grid_layout(key, sorted(base if agreed else seen), self.max_group_size)
        return layout

    async def average(self, layout: GridLayout, vector: np.ndarray, key: str, *, weight: float,
                      role: Role, stage_round: StageRound,
                      coming: Callable[[Iterable[str]], AbstractContextManager[None]] | None = None
                      ) -> AveragingReport | None:
        """The grid round; None if its first stage could not run. A stage that fails ends the
        round there (its report says what failed). `coming(labels)`: while inside, this peer
        tells the peers of those stages that it is on its way (matchmaking.py); it covers our
        stages and stand-ins until our own stages end. Raises RoundSatOut for an aux peer that
        has no slice in any stage, and for a trainer without a cell that has none in some stage
        (it would hold no mean)."""
        if role == "aux" and all(stage is None for stage in layout.stages(self.peer_id, key)):
            raise RoundSatOut(f"no slice of grid round {key} has room for this aux peer")
        if role == "trainer" and self.peer_id not in layout.cells \
                and any(stage is None for stage in layout.stages(self.peer_id, key)):
            # (before it sends: a helper with no slice in a later stage would give its gradient
            # to the others' mean and get none back)
            raise RoundSatOut(f"no slice of grid round {key} has room for this trainer in "
                              "every stage")
        everyone = [*layout.cells, *layout.helpers]
        reports: list[AveragingReport] = []
        duties = layout.duties(self.peer_id, key)
        labels = [st.label for st in layout.stages(self.peer_id, key) if st is not None]
        labels += [duty.label for stage_duties in duties for duty in stage_duties]
        standing_in: list[asyncio.Task[AveragingReport | None]] = []
        try:
            with coming(labels) if coming is not None else contextlib.nullcontext():
                outcome = await self._stages(layout, vector, key, weight, role, stage_round,
                                             duties, standing_in, reports)
            # the slices we stand in for count on us, whatever our own slice did
            results = await asyncio.gather(*standing_in, return_exceptions=True)
        finally:
            for task in standing_in:
                task.cancel()
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, AveragingError):
                log.warning("grid_stand_in_failed", key=key, error=repr(result))
        if outcome == "no step" or not reports:
            return None
        return grid_report(key, reports, everyone)

    async def _stages(self, layout: GridLayout, vector: np.ndarray, key: str, weight: float,
                      role: Role, stage_round: StageRound, duties: list[list[Stage]],
                      standing_in: list[asyncio.Task[AveragingReport | None]],
                      reports: list[AveragingReport]) -> str:
        """Our stages, in order, appending their reports; "no step" if this peer cannot hold
        the round's mean, else "done" (a stage that failed ends it: its report says so)."""
        represents = 1  # the averager counts a member that sends nothing (aux, weight 0) as 0
        helper = self.peer_id not in layout.cells
        for s, stage in enumerate(layout.stages(self.peer_id, key)):
            if stage is None:  # a helper no slice had room for
                if helper and role == "trainer":
                    return "no step"  # it would not hold the round's mean
                continue
            # stand in for empty cells: the same vector and weight (a copy), the result
            # dropped; they run beside our own stages, so a slow one delays no one's next
            standing_in += [asyncio.create_task(stage_round(
                vector.copy(), duty.label, weight, represents, layout.max_represents(s),
                tuple(p for p in duty.peers if p != self.peer_id), _majority(duty, layout),
                _cells(duty, layout))) for duty in duties[s]]
            peers = tuple(p for p in stage.peers if p != self.peer_id)
            if not peers:
                continue  # alone in its slice: its vector is its block's mean already
            log.debug("grid_stage_begin", key=key, stage=stage.label, role=role, helper=helper,
                      expected=len(stage.peers))
            report = await stage_round(vector, stage.label, weight, represents,
                                       layout.max_represents(s), peers,
                                       _majority(stage, layout), _cells(stage, layout))
            if report is None:
                return "done"
            reports.append(report)
            log.debug("grid_stage_done", key=key, stage=stage.label, role=role,
                      group_size=report.group_size, represented=report.represented,
                      expected=len(stage.peers), stand_ins=len(duties[s]),
                      failed_parts=len(report.failed_parts))
            if report.failed_parts:
                return "done"
            if helper:  # its slice's cells carry its weight from here on (LISTENING_SHARE)
                weight = report.weight * LISTENING_SHARE if role == "trainer" else 0.0
                represents = 0
            else:
                weight, represents = report.weight, report.represented
        return "done"


def _cells(stage: Stage, layout: GridLayout) -> tuple[str, ...]:
    return tuple(p for p in stage.peers if p in layout.cells)


def _majority(stage: Stage, layout: GridLayout) -> int:
    """The trainers a stage's round needs to count: more than half of those it expects."""
    return sum(1 for p in stage.peers if p in layout.cells) // 2 + 1
