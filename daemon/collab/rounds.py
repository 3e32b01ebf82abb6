"""The `RoundAverager` port: a run's averaging rounds through the node's averager, or alone.

A collaborative run's rounds go through `Averager.average` under `<run key>/<round key>` with the
node's matchmaking window (averaging.window, 5 s by default), which ends as soon as the expected
peers are seen; a shorter one loses peers far away (on a 200 ms lossy link, announcing takes a
peer about 2 s, and the join's acknowledgement, half the window, runs out). A local run averages
alone: its "round" is a group of one, at once. A round of more peers than
`averaging.max_group_size` is a grid round (grid.py): a few stages of one group each.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import numpy as np
import structlog

from .. import timebase
from ..averaging.aggregation import check_aggregation
from ..averaging.averager import RoundOptions
from ..averaging.compression import get_codec, sparsifies
from ..averaging.errors import AveragingError
from ..averaging.report import AveragingReport
from .grid import GridRounds
from .progress import Role
from .roster import Rosters

if TYPE_CHECKING:
    from ..averaging.averager import Averager
    from ..dht import DHTNode

log = structlog.get_logger(__name__)

__all__ = ["ROUND_TIMEOUT", "NetworkRounds", "SoloRounds"]

ROUND_TIMEOUT = 60.0


def stage_compression(compression: str, label: str) -> str:
    """What a grid stage sends in: the run's codec in the first stage; after it, a sparsifying
    codec (topk) would drop most of each block's mean for good (only what a trainer sends of its
    own vector is kept for later by error feedback), so the later stages go in fp16."""
    if label.startswith("m0/") or not sparsifies(get_codec(compression)):
        return compression
    return "fp16"


class NetworkRounds:
    """Rounds with the run's peers, through the node's averager: one group, or a grid round
    (grid.py) when the peers expected are more than a group holds. With the node's `dht`, a
    grid round that knows no members of the round that made the head (its first) lays its
    cells out on the round's roster (roster.py)."""

    def __init__(self, averager: Averager, run_key: str, dht: DHTNode | None = None) -> None:
        self.averager = averager
        self.run_key = run_key
        self.grid = GridRounds(averager.peer_id, averager.config.max_group_size)
        self.rosters = None if dht is None else Rosters(dht, averager.peer_id, run_key)

    @property
    def max_group_size(self) -> int:
        return self.grid.max_group_size

    def refused(self, peers: Collection[str]) -> frozenset[str]:
        return frozenset(p for p in peers if self.averager.bans.banned(p) is not None)

    def round_over(self, key: str) -> None:
        self.averager.round_over(f"{self.run_key}/{key}")

    async def prepare(self) -> None:
        """Load the load balancer before the first round needs it."""
        await self.averager.prepare()

    async def average(self, vector: np.ndarray, key: str, *, weight: float, expected: int,
                      role: Role, compression: str = "none", aggregation: str = "mean",
                      min_trainers: int = 1,
                      peers: tuple[str, ...] = (), leaders: tuple[str, ...] = (),
                      aux: tuple[str, ...] = (), cells: tuple[str, ...] = (),
                      max_weight: float | None = None, weight_budget: float | None = None,
                      settled: tuple[str, ...] = ()) -> AveragingReport | None:
        trainers = [p for p in peers if p not in aux]
        layout = self.grid.layout(key, trainers, aux, role, cells or leaders) if peers else None
        if layout is not None and self.rosters is not None:
            # the cells go to the round's roster, the same on every peer. A first grid round
            # draws it from the trainers seen at the head for a while (newcomers that are still
            # settling begin their round late: they help, see policy.py); a later one from the
            # trainers that stepped in the round that made the head, which peers read off the
            # board at different moments (a report or two apart lays out another grid). Only a
            # peer of that list writes one
            me = self.averager.peer_id
            mine = {me} if role == "trainer" else set()
            known = set(cells or leaders)
            if not set(layout.cells) <= known:  # too few to lay the grid out on (grid.py)
                known = set()
            everyone = {*trainers, *mine} - set(aux)
            view = known & everyone if known else set(settled) - set(aux)
            if len(view - {me}) < 2:
                view = everyone
            log.debug("grid_roster_view", key=key, view=len(view), trainers=len(trainers),
                      settled=len(settled), known=len(known))
            # (meanwhile a slice's peers that begin sooner are told we are on our way: the
            # wait for the roster took up to a window, and they gave up on us as their leader
            # after one, averaging apart from the rest of our slice)
            # (the helpers beside the roster, written with it: how many stages the grid has
            # depends on them, and each peer sees the newest newcomers at another moment)
            seen_helpers = (tuple(sorted(everyone - view)), len(set(aux)))
            with self.averager.coming_under(f"{self.run_key}/{key}/"):
                # (a first round judges rosters by every trainer seen at the head: roster.py)
                roster, said = await self.rosters.agree(
                    key, view, wait=self.averager.config.window,
                    write=role == "trainer" and me in view, seen=() if known else everyone,
                    helpers=seen_helpers)
            layout = self.grid.layout(key, sorted({*trainers, *roster} - {me}), aux, role,
                                      roster, roster=True, helpers_said=said)
        if layout is None:
            return await self._round(vector, key, weight=weight, expected=expected, role=role,
                                     compression=compression, aggregation=aggregation,
                                     min_trainers=min_trainers,
                                     peers=peers, leaders=leaders, max_weight=max_weight,
                                     weight_budget=weight_budget)

        async def stage(part: np.ndarray, label: str, stage_weight: float, represents: int,
                        max_represents: int, stage_peers: tuple[str, ...],
                        stage_min: int, stage_leaders: tuple[str, ...]) -> AveragingReport | None:
            # the slice's leader: by rank among its trainers with a cell (the same on all of
            # them; which helpers a peer expects may differ with its view)
            return await self._round(part, f"{key}/{label}", weight=stage_weight,
                                     expected=len(stage_peers) + 1, role=role,
                                     compression=stage_compression(compression, label),
                                     aggregation=aggregation, min_trainers=stage_min,
                                     peers=stage_peers, leaders=stage_leaders,
                                     represents=represents,
                                     max_represents=max_represents,
                                     # a stage's vector stands for its slice's trainers
                                     max_weight=None if max_weight is None
                                     else max_weight * max_represents,
                                     weight_budget=weight_budget, staged=True)

        def coming(labels: Iterable[str]) -> AbstractContextManager[None]:
            return self.averager.coming(f"{self.run_key}/{key}/{label}" for label in labels)

        return await self.grid.average(layout, vector, key, weight=weight, role=role,
                                       stage_round=stage, coming=coming)

    async def roster_published(self, key: str, trainers: Collection[str], *,
                               timeout: float) -> bool:
        return self.rosters is not None and await self.rosters.published(key, trainers,
                                                                         timeout=timeout)

    async def _round(self, vector: np.ndarray, key: str, *, weight: float, expected: int,
                     role: Role, compression: str, min_trainers: int, peers: tuple[str, ...],
                     aggregation: str = "mean",
                     leaders: tuple[str, ...], represents: int = 1,
                     max_represents: int = 1, max_weight: float | None = None,
                     weight_budget: float | None = None,
                     staged: bool = False) -> AveragingReport | None:
        options = RoundOptions(key=f"{self.run_key}/{key}", weight=weight, role=role,
                               deadline=timebase.now() + ROUND_TIMEOUT, expected=expected,
                               compression=compression, aggregation=check_aggregation(aggregation),
                               min_trainers=min_trainers,
                               peers=peers, leaders=leaders, represents=represents,
                               max_represents=max_represents, max_weight=max_weight,
                               weight_budget=weight_budget, staged=staged)
        try:
            return await self.averager.average(vector, options)
        except AveragingError as exc:
            log.warning("averaging_round_not_run", run=self.run_key, round=key, error=str(exc))
            return None


class SoloRounds:
    """A local run's rounds: the peer alone, its vector unchanged."""

    max_group_size = 0  # alone: never a grid

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id

    def refused(self, peers: Collection[str]) -> frozenset[str]:
        return frozenset()

    def round_over(self, key: str) -> None:
        pass  # nobody asks to join a local run's rounds

    async def roster_published(self, key: str, trainers: Collection[str], *,
                               timeout: float) -> bool:
        return False

    async def average(self, vector: np.ndarray, key: str, *, weight: float, expected: int,
                      role: Role, compression: str = "none", aggregation: str = "mean",
                      min_trainers: int = 1,
                      peers: tuple[str, ...] = (), leaders: tuple[str, ...] = (),
                      aux: tuple[str, ...] = (), cells: tuple[str, ...] = (),
                      max_weight: float | None = None, weight_budget: float | None = None,
                      settled: tuple[str, ...] = ()) -> AveragingReport | None:
        now = timebase.now()
        return AveragingReport(key=key, group_id=f"local/{key}", members=(self.peer_id,),
                               trainers=1 if role == "trainer" else 0,
                               senders=1 if weight > 0 else 0, part=(0, int(vector.size)),
                               shares=(int(vector.size),), seconds=0.0, matchmaking_seconds=0.0,
                               allreduce_seconds=0.0, bytes_sent=0, bytes_received=0,
                               failed_parts=(), senders_excluded={}, senders_rejected={},
                               finished_at=now)
