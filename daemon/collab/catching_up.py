"""Catching up: a trainer behind the run's head (new, restarted, back from a pause, after a failed
round) downloads the state of a peer at the head and, before loading it, asks witnesses at the
same head whether its parameters agree with theirs (state_check.py). A part of the run's engine
(engine.py) kept apart, like round_taking.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import timebase
from .donors import DonorChoice
from .errors import DonorBusy, DonorContradicted, LocalStateError, StateSyncError
from .pace import EpochPace
from .policy import CatchUp, Wait
from .ports import DownloadedState, StateSource, Trainer, TrainerRefused
from .progress import PeerProgress
from .state_check import WITNESSES, Verdict, judge

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from structlog.typing import FilteringBoundLogger

    from .estimate import Head
    from .run_progress import PhaseCell, RunProgress

__all__ = ["UNANSWERED_RETRY_SECONDS", "CatchingUp"]

UNANSWERED_RETRY_SECONDS = 1.0  # after a state that no witness could check, before asking again
BUSY_WAIT_SECONDS = 0.5  # after a donor's "busy", before asking one again


class StateContradictsReport(TrainerRefused):
    """A donor sent a state behind, or beside, the head it reported holding: its own word against
    it (an honest donor's state only moves on from what it reported)."""


class CatchingUp:
    """Downloads and checks a state at the run's head; mixed into `RunEngine`."""

    # the engine's state these methods read and write (set in RunEngine.__init__)
    peer_id: str
    trainer: Trainer | None
    progress: RunProgress
    states: StateSource | None
    donors: DonorChoice
    phase: PhaseCell
    pace: EpochPace
    _reports: list[PeerProgress]
    _head_group: tuple[str, ...]
    _stepped_in: Head | None
    _epoch_loss: tuple[float, int]
    _log: FilteringBoundLogger
    _schedule_look: Callable[[float], None]
    _wait: Callable[[Wait], Awaitable[None]]
    _left_head: Callable[[], None]

    async def _catch_up(self, action: CatchUp) -> None:
        """Load the state of a peer at the run's head (this peer is new, or fell behind)."""
        assert self.trainer is not None
        p = self.progress
        now = timebase.monotonic()
        served = {report.peer_id: report.served for report in self._reports}
        donor = self.donors.pick(list(action.donors), now, served)
        if donor is None or self.states is None:  # every donor failed lately: wait a little
            self.phase.set("waiting")
            await self._wait(Wait(timebase.now() + min(1.0, self.donors.wait(now)), "backoff"))
            return
        self.phase.set("downloading_state")
        others = self.donors.others(list(action.donors), donor, now)
        try:
            state = await self.states.download(donor, action.head, others=others)
        except DonorBusy as exc:  # serving others, or in a long round: ask again soon
            now = timebase.monotonic()
            # (a donor that sends us elsewhere serves us no more than a busy one: an identity
            # that sheds everyone is a failure after the same patience)
            if self.donors.busy(donor, now):  # only busy for a while: a failure (donors.py)
                p.failed_state_downloads += 1
                self._log.warning("state_donor_always_busy", donor=donor[:12], error=str(exc),
                                  retry_in=round(self.donors.wait(now), 2))
            elif exc.shed:  # it served others lately and we have others to ask: ask one now
                again = self.donors.shed(donor, now, exc.retry_after)
                self._log.debug("state_donor_shed", donor=donor[:12], others=others,
                                retry_after=exc.retry_after, again=again)
                if not again:  # (the donors are those just read: no new read of the board)
                    return
            else:
                self.donors.full(donor, now)
                self._log.debug("state_donor_busy", donor=donor[:12], error=str(exc))
            await self._wait(Wait(timebase.now() + BUSY_WAIT_SECONDS, "the donor is busy"))
            return
        except LocalStateError as exc:  # not the donor's fault: no avoiding it
            p.failed_state_downloads += 1
            self.phase.set("waiting")
            self._log.warning("state_download_impossible", donor=donor[:12], error=str(exc))
            await self._wait(Wait(timebase.now() + UNANSWERED_RETRY_SECONDS * 30,
                                  "no_room_for_state"))
            return
        except DonorContradicted as exc:  # (as StateContradictsReport below, without the download)
            p.failed_state_downloads += 1
            self.donors.failed(donor, timebase.monotonic(), contradicted=True)
            self._log.warning("downloaded_state_refused", donor=donor[:12], error=str(exc))
            return
        except StateSyncError as exc:
            p.failed_state_downloads += 1
            now = timebase.monotonic()  # (when it ended: a stalled attempt counts from there)
            self.donors.failed(donor, now)
            self._log.warning("state_download_failed", donor=donor[:12], error=str(exc),
                              retry_in=round(self.donors.wait(now), 2))
            return
        unanswered = False
        try:
            if state.epoch < p.epoch:  # never back to an earlier epoch
                raise TrainerRefused(f"the donor's state is at epoch {state.epoch}, behind ours "
                                     f"({p.epoch})")
            bound = self.pace.bound(timebase.monotonic())
            if bound is not None and state.epoch > bound:  # no honest run got there so soon
                raise TrainerRefused(
                    f"the donor sent a state at epoch {state.epoch}, past what the run's pace "
                    f"allows ({bound})")
            if state.epoch < action.head.epoch or (state.epoch == action.head.epoch
                                                   and state.lineage != action.head.lineage):
                raise StateContradictsReport(  # it reports a head it does not hold (or went back)
                    f"the donor reported the run's head (epoch {action.head.epoch}) but sent a "
                    f"state at epoch {state.epoch}, lineage {state.lineage}")
            verdict = await self._witnessed(state, donor, action)
            if verdict == "refuted":
                p.refuted_states += 1
                raise TrainerRefused("peers at the state's head hold other parameters "
                                     "(state_check.py): not loaded")
            if verdict == "unanswered":  # not the donor's fault: no backoff, no avoiding it
                p.unanswered_states += 1
                unanswered = True
                return
            if verdict == "unverified":
                p.unverified_states += 1
            await self.trainer.load_state(state)
        except TrainerRefused as exc:
            p.failed_state_downloads += 1
            now = timebase.monotonic()
            self.donors.failed(donor, now, contradicted=isinstance(exc, StateContradictsReport))
            self._log.warning("downloaded_state_refused", donor=donor[:12], error=str(exc))
            return
        finally:
            state.close()
            if unanswered:  # (witnesses that moved on meanwhile: at the next head, they answer)
                await self._wait(Wait(timebase.now() + UNANSWERED_RETRY_SECONDS, "state_unanswered"))
        self.donors.succeeded(donor)
        self._left_head()
        p.epoch, p.lineage, p.accumulated = state.epoch, state.lineage, 0
        self.pace.loaded(state.epoch, timebase.monotonic())
        self._head_group = state.group
        self._stepped_in = None
        self._epoch_loss = (0.0, 0)
        p.state_downloads += 1
        self._schedule_look(0.0)
        self._log.info("state_downloaded", donor=donor[:12], epoch=state.epoch)

    async def _witnessed(self, state: DownloadedState, donor: str, action: CatchUp) -> Verdict:
        """Ask up to WITNESSES peers at the run's head (other than the donor, picked at random)
        whether the downloaded state's parameters agree with theirs (state_check.py)."""
        assert self.states is not None
        others = sorted(set(action.donors) - {donor, self.peer_id})
        chosen = self.donors.rng.sample(others, min(WITNESSES, len(others)))
        if not chosen:
            return "unverified"
        answers = await asyncio.gather(*(self.states.witness(peer, state) for peer in chosen))
        verdict = judge(answers)
        if verdict != "verified":
            self._log.info("downloaded_state_" + verdict, donor=donor[:12], epoch=state.epoch,
                           witnesses=len(chosen), answers=[a for a in answers])
        return verdict
