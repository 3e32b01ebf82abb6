"""An aux peer's run: no worker, no gradients of its own; it lends its bandwidth to the run's rounds.

An aux daemon (`node.role = "aux"`, or `run.start role="aux"`) finds the run's manifest in the
DHT, follows the run's progress like a trainer does, and joins each head's gradient round as a
reducer with weight 0: the load balancer gives it a share of the vector to reduce, and the
trainers' average is what it would have been without it. It takes no part in state averaging
(it holds no state) and never steps. The same engine as a trainer's runs it (engine.py), with
no trainer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog

from .. import timebase
from ..errors import RunNotActiveError
from .board import DhtProgressBoard
from .engine import RunEngine
from .errors import MembershipError
from .manifest import PublishedManifest
from .rounds import NetworkRounds
from .run import RunState, finish_or_cancel, schedule_of
from .status import aux_status

if TYPE_CHECKING:
    from ..network import PeerNetwork

log = structlog.get_logger(__name__)

__all__ = ["AuxRun"]


class AuxRun:
    role = "aux"

    def __init__(self, network: PeerNetwork, name: str, published: PublishedManifest,
                 stop_timeout: float) -> None:
        self.network = network
        self.name = name
        self.manifest = published.manifest
        self.parameters = published.parameters
        if network.dht is None or network.averager is None:
            raise RunNotActiveError("the peer network is not started")
        self.board = DhtProgressBoard(network.dht, network.identity, network.membership, name,
                                      self.manifest, "aux", self.parameters,
                                      published.owner_signature)
        self.rounds = NetworkRounds(network.averager, self.board.key, network.dht)
        self.engine = self._engine()
        self.state: RunState = "starting"
        self.error: dict[str, Any] | None = None
        self.started_at = timebase.now()
        self._stop_timeout = stop_timeout
        self._task: asyncio.Task[None] | None = None
        self._log = log.bind(run=name, role="aux")

    def _engine(self) -> RunEngine:
        return RunEngine(peer_id=self.network.identity.peer_id, role="aux",
                         schedule=schedule_of(self.manifest), board=self.board,
                         averaging=self.rounds, parameters=self.parameters,
                         compression=self.manifest.compression,
                         aggregation=self.manifest.aggregation, name=self.name)

    @property
    def key(self) -> str:
        return self.board.key

    @property
    def active(self) -> bool:
        return self.state in ("starting", "running", "stopping")

    async def start(self) -> None:
        self.error = None
        if self._task is not None:  # a restart: a new engine, the counters carried over
            progress = self.engine.progress
            self.engine = self._engine()
            self.engine.progress.rounds = progress.rounds
            self.engine.progress.failed_rounds = progress.failed_rounds
            self.engine.progress.rounds_sat_out = progress.rounds_sat_out
        await self.rounds.prepare()
        self.state = "running"
        self._task = asyncio.create_task(self._main(self.engine), name=f"aux-{self.name}")
        self._log.info("aux_run_started", fingerprint=self.manifest.fingerprint(),
                       parameters=self.parameters)

    async def _main(self, engine: RunEngine) -> None:
        try:
            reason = await engine.run()
            if reason == "finished":
                self.state = "finished"
        except MembershipError as exc:
            self.state = "failed"
            self.error = {"message": str(exc)}
            self._log.error("run_membership_lost", error=str(exc))
        except Exception as exc:  # keep the daemon up; the status says what happened
            self.state = "failed"
            self.error = {"message": f"{type(exc).__name__}: {exc}"}
            self._log.exception("aux_run_failed")

    async def restart(self) -> None:
        await self.start()

    async def stop(self) -> None:
        if not self.active:
            return
        self.state = "stopping"
        self.engine.stop()
        if self._task is not None:
            await finish_or_cancel(self._task, self._stop_timeout)
        self.state = "stopped" if self.state == "stopping" else self.state

    def status(self) -> dict[str, Any]:
        return aux_status(self)
