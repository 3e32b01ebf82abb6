"""The `RoundAverager` port: a run's averaging rounds through the node's averager, or alone.

A collaborative run's rounds go through `Averager.average` under `<run key>/<round key>` with the
node's matchmaking window (averaging.window, 5 s by default), which ends as soon as the expected
peers are seen; a shorter one loses peers far away (on a 200 ms lossy link, announcing takes a
peer about 2 s, and the join's acknowledgement, half the window, runs out). A local run averages
alone: its "round" is a group of one, at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import structlog

from .. import timebase
from ..averaging.averager import RoundOptions
from ..averaging.errors import AveragingError
from ..averaging.report import AveragingReport
from .progress import Role

if TYPE_CHECKING:
    from ..averaging.averager import Averager

log = structlog.get_logger(__name__)

__all__ = ["ROUND_TIMEOUT", "NetworkRounds", "SoloRounds"]

ROUND_TIMEOUT = 60.0


class NetworkRounds:
    """Rounds with the run's peers, through the node's averager."""

    def __init__(self, averager: Averager, run_key: str) -> None:
        self.averager = averager
        self.run_key = run_key

    async def prepare(self) -> None:
        """Load the load balancer before the first round needs it."""
        await self.averager.prepare()

    async def average(self, vector: np.ndarray, key: str, *, weight: float, expected: int,
                      role: Role, compression: str = "none", min_trainers: int = 1,
                      peers: tuple[str, ...] = (),
                      leaders: tuple[str, ...] = ()) -> AveragingReport | None:
        averager = self.averager
        options = RoundOptions(key=f"{self.run_key}/{key}", weight=weight, role=role,
                               deadline=timebase.now() + ROUND_TIMEOUT, expected=expected,
                               compression=compression, min_trainers=min_trainers,
                               peers=peers, leaders=leaders)
        try:
            return await averager.average(vector, options)
        except AveragingError as exc:
            log.warning("averaging_round_not_run", run=self.run_key, round=key, error=str(exc))
            return None


class SoloRounds:
    """A local run's rounds: the peer alone, its vector unchanged."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id

    async def average(self, vector: np.ndarray, key: str, *, weight: float, expected: int,
                      role: Role, compression: str = "none", min_trainers: int = 1,
                      peers: tuple[str, ...] = (),
                      leaders: tuple[str, ...] = ()) -> AveragingReport | None:
        now = timebase.now()
        return AveragingReport(key=key, group_id=f"local/{key}", members=(self.peer_id,),
                               trainers=1 if role == "trainer" else 0,
                               senders=1 if weight > 0 else 0, part=(0, int(vector.size)),
                               shares=(int(vector.size),), seconds=0.0, matchmaking_seconds=0.0,
                               allreduce_seconds=0.0, bytes_sent=0, bytes_received=0,
                               failed_parts=(), senders_excluded={}, senders_rejected={},
                               finished_at=now)
