"""Looking at the run: a run engine reads the progress board, folds the reports into the run's
estimate (estimate.py) as far as it believes them, and builds the view its policy decides on
(policy.py). A part of the run's engine (engine.py) kept apart, like round_taking.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .. import timebase
from .donors import DonorChoice
from .estimate import GlobalProgress, Head, estimate_global
from .pace import EpochPace
from .policy import Local, Schedule, Timing, View, majority_at, round_key
from .ports import ProgressBoard, RoundAverager, Trainer
from .progress import PeerProgress, Role
from .round_hold import RoundHold

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from .run_progress import PhaseCell, RunProgress

__all__ = ["STALE_AFTER", "Looking"]

STALE_AFTER = 30.0  # seconds a progress report stays believable


class Looking:
    """Reads the board and builds the view to decide on; mixed into `RunEngine`."""

    # the engine's state these methods read and write (set in RunEngine.__init__)
    peer_id: str
    role: Role
    schedule: Schedule
    timing: Timing
    board: ProgressBoard
    averaging: RoundAverager
    trainer: Trainer | None
    progress: RunProgress
    phase: PhaseCell
    donors: DonorChoice
    pace: EpochPace
    global_progress: GlobalProgress | None
    paused_reason: str | None
    _hold: RoundHold
    _held: frozenset[str]
    _reports: list[PeerProgress]
    _received: dict[str, float]
    _next_look: float
    _disbelieved: dict[str, frozenset[str]]
    _target_reached: tuple[Head, float] | None
    _head_seen: tuple[Head, frozenset[str], float] | None
    _head_since: dict[str, float]
    _promise: tuple[Head | None, int]
    _roster_seen: Head | None
    _failed_in_part: tuple[Head, float] | None
    _finished_at: float | None
    _on_finished: Callable[[], None] | None
    _averaged: Head | None
    _log: FilteringBoundLogger
    _blocked: Callable[[], str | None]
    _enter_pause: Callable[[str], Awaitable[None]]
    _leave_pause: Callable[[], Awaitable[None]]
    own_report: Callable[..., PeerProgress]
    _grid_cells: Callable[[], tuple[str, ...]]
    _save_checkpoint: Callable[[], Awaitable[None]]

    @property
    def head(self) -> Head:
        return Head(self.progress.epoch, self.progress.lineage)

    def _left_head(self) -> None:
        """This peer is about to move past its head (a step, a state round, a download): it does
        not gather under that head's rounds again (gatherings.py says when it may), and a peer
        that asks to join one of them late (a newcomer that loaded the state as the others
        averaged) is told so at once."""
        for kind in ("grad", "state"):
            self.averaging.round_over(round_key(kind, self.head))

    async def _look(self) -> tuple[View, bool]:
        """The view to decide on, and whether the board was read for it (else the last read is
        reused, with our own report fresh)."""
        blocked = self._blocked()
        if blocked is not None:
            await self._enter_pause(blocked)
        elif self.paused_reason is not None:
            await self._leave_pause()
        own = self.own_report()
        read = timebase.monotonic() >= self._next_look or self.global_progress is None
        if read:
            self.phase.set("syncing")
            self._reports, received = await self.board.read()
            self._received = dict(received)
        now, mono = timebase.now(), timebase.monotonic()
        run, refused = self._believed_run(now, own, mono)
        self.global_progress = run
        self._note_disbelieved(run)
        if self.role == "aux":  # an aux peer is where it last saw the run
            if run.head != self.head:
                self._left_head()
            self.progress.epoch, self.progress.lineage = run.epoch, run.lineage
        if run.ready and run.head == self.head and (
                self._target_reached is None or self._target_reached[0] != run.head):
            self._target_reached = (run.head, self._estimate_reached(run, now))
        grew_at = self._note_head(run, now)
        p = self.progress
        promised = self._promise[1] if self._promise[0] == self.head else 0
        reached = self._target_reached
        local = Local(self.role, p.epoch, p.lineage, p.accumulated if self.role == "trainer" else 0,
                      float(p.samples_per_second or 0.0), promised,
                      max_group_size=self.averaging.max_group_size,
                      knows_round_members=bool(self._grid_cells()), head_grew_at=grew_at,
                      ready_at=reached[1] if reached is not None and reached[0] == run.head else None,
                      roster_published=self._roster_seen == run.head,
                      failed_part_at=self._failed_in_part[1] if self._failed_in_part is not None
                      and self._failed_in_part[0] == self.head else None)
        if self.schedule.epochs is not None and self.role == "trainer" \
                and p.epoch >= self.schedule.epochs and self._finished_at is None:
            self._finished_at = now
            if p.accumulated and self.trainer is not None:
                # what was trained past the last step counts for nothing now: the final state
                # (checkpoint, donations) is the run's (a local-update run's outer parameters)
                await self.trainer.zero_grad()
                p.accumulated = 0
            # the final checkpoint first: a run that says it is finished has it on disk (a
            # status read between the two found "finished" and no checkpoint of the last epoch)
            await self._save_checkpoint()
            if self._on_finished is not None:
                self._on_finished()
        view = View(local, run, self.schedule, now, self.timing, blocked, self._finished_at,
                    self._averaged, refused)
        return view, read

    def _believed_run(self, now: float, own: PeerProgress,
                      mono: float) -> tuple[GlobalProgress, frozenset[str]]:
        """The run as we believe it (estimate.py), and the peers at its head our averaging
        refuses. Not believed ahead of us: the donors whose state failed us lately (donors.py)
        and, while our round at a head a majority holds is untried, the peers newly ahead
        (round_hold.py; `_held`)."""
        avoided = self.donors.failed_lately(mono)
        tries = self.progress.rounds + self.progress.failed_rounds + self.progress.rounds_sat_out
        ahead = (r.peer_id for r in self._reports if r.epoch > self.progress.epoch)
        held = self._hold.held(self.head, tries, ahead) - avoided - {self.peer_id} \
            if self.role == "trainer" else frozenset()
        run = self._estimate(now, own, mono, avoided | held)
        refused = self.averaging.refused(run.donors)
        if held and not majority_at(run, self.head, self.schedule, refused):
            held = frozenset()  # they stepped, and are the run now: follow them
            run = self._estimate(now, own, mono, avoided)
            refused = self.averaging.refused(run.donors)
        if self.role == "trainer":
            majority = majority_at(run, self.head, self.schedule, refused)
            # (a donor that failed us is never exempt: reporting our head, then the next epoch
            # as our round forms, would otherwise pass the hold)
            known = {*run.donors, *(p for _, ps in run.ahead for p in ps)} \
                - self.donors.failed_since_served()
            self._hold.looked(self.head, tries, known if majority else None)
        if held != self._held and held:
            self._log.debug("reports_held", peers=sorted(p[:12] for p in held - self._held),
                            epoch=self.progress.epoch)
        self._held = held
        return run, refused

    def _estimate(self, now: float, own: PeerProgress, mono: float,
                  unserved: frozenset[str]) -> GlobalProgress:
        """The run from the last read of the board (estimate.py), not believing `unserved` ahead."""
        return estimate_global(self._reports, target_batch_size=self.schedule.target_batch_size,
                               now=now, own=own, stale_after=STALE_AFTER, received=self._received,
                               max_epoch=self.pace.bound(mono), unserved=unserved,
                               contradicted=self.donors.contradicted_lately(mono))

    def _note_disbelieved(self, run: GlobalProgress) -> None:
        """Count and log, once each time they come to claim it, the peers whose reports the
        estimate did not believe: past our pace of the run (`reports_beyond_pace`, pace.py), or
        ahead of us with a state that failed us lately (`reports_unserved`, donors.py; not those
        held only until our round is tried, round_hold.py)."""
        unserved = tuple(p for p in run.unserved_ahead if p not in self._held)
        for counter, peers in (("reports_beyond_pace", run.beyond_pace),
                               ("reports_unserved", unserved)):
            current = frozenset(peers)
            new = current - self._disbelieved.get(counter, frozenset())
            self._disbelieved[counter] = current
            if new:
                setattr(self.progress, counter, getattr(self.progress, counter) + len(new))
                self._log.warning(counter, peers=sorted(p[:12] for p in new),
                                  epoch=self.progress.epoch,
                                  max_epoch=self.pace.bound(timebase.monotonic()),
                                  epoch_seconds=self.pace.epoch_seconds)

    def _note_head(self, run: GlobalProgress, now: float) -> float:
        """When the set of trainers seen at the run's head last grew (its first sight counts)."""
        at_head = frozenset(run.donors) | ({self.peer_id} if self.role == "trainer"
                                           and self.head == run.head else frozenset())
        seen = self._head_seen
        if seen is None or seen[0] != run.head:
            self._head_seen = (run.head, at_head, now)
            self._head_since = {}
        elif not at_head <= seen[1]:
            self._head_seen = (run.head, seen[1] | at_head, now)
        self._head_since = {peer: self._head_since.get(peer, now) for peer in at_head}
        return self._head_seen[2]

    def _settled(self) -> tuple[str, ...]:
        """The trainers at the run's head that we have seen there for `Timing.settle` seconds or
        more (ourselves included): a first grid round's roster is drawn from them (rounds.py),
        since a trainer that came a moment ago begins its round late (policy: it settles)."""
        until = timebase.now() - self.timing.settle
        return tuple(sorted(peer for peer, since in self._head_since.items() if since <= until))

    def _estimate_reached(self, run: GlobalProgress, now: float) -> float:
        """When the run reached its target, from the overshoot (for the epoch's overhead)."""
        overshoot = max(0, run.samples_accumulated - run.target_batch_size)
        rate = run.samples_per_second
        return now - min(self.timing.max_look, overshoot / rate if rate > 0 else 0.0)
