"""An aux peer's run: no worker, no gradients of its own; it lends its bandwidth to the run's rounds.

An aux daemon (`node.role = "aux"`, or `run.start role="aux"`) finds the run's manifest in the
DHT, follows the run's progress like a trainer does, and joins each epoch's gradient round as a
reducer with weight 0: the load balancer gives it a share of the vector to reduce, and the
trainers' average is what it would have been without it. It takes no part in state averaging
(it holds no state) and never steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from .collaboration import Collaboration
from .manifest import PublishedManifest
from .progress import GlobalProgress, PeerProgress, next_report_delay
from .run import finish_or_cancel
from .status import aux_status

if TYPE_CHECKING:
    from ..network import PeerNetwork
    from .run import Phase, RunState

log = structlog.get_logger(__name__)

MIN_LOOK_DELAY = 0.02
MAX_LOOK_DELAY = 5.0


class AuxRun:
    role = "aux"

    def __init__(self, network: PeerNetwork, name: str, published: PublishedManifest,
                 stop_timeout: float) -> None:
        self.name = name
        self.manifest = published.manifest
        self.parameters = published.parameters
        self.collab = Collaboration(network, name, self.manifest, "aux", self.parameters,
                                    published.owner_signature)
        self.global_progress: GlobalProgress | None = None
        self.last_round: dict[str, Any] | None = None
        self.state: RunState = "starting"
        self.phase: Phase = "idle"
        self.epoch = 0
        self.rounds = 0
        self.failed_rounds = 0
        self.error: dict[str, Any] | None = None
        self.started_at = time.time()
        self._stop_timeout = stop_timeout
        self._stop_requested = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._vector: np.ndarray | None = None
        self._log = log.bind(run=name, role="aux")

    @property
    def sync(self) -> AuxRun:  # what run.status reads the run-level fields from
        return self

    @property
    def active(self) -> bool:
        return self.state in ("starting", "running", "stopping")

    async def start(self) -> None:
        self._stop_requested.clear()
        self.error = None
        # What the trainers average; an aux peer sends none of it (weight 0), it only reduces.
        self._vector = np.zeros(self.parameters, dtype=np.float32)
        await self.collab.prepare()
        self.state = "running"
        self._task = asyncio.create_task(self._loop(), name=f"aux-{self.name}")
        self._log.info("aux_run_started", fingerprint=self.manifest.fingerprint(),
                       parameters=self.parameters)

    async def restart(self) -> None:
        await self.start()

    async def stop(self) -> None:
        if not self.active:
            return
        self.state = "stopping"
        self._stop_requested.set()
        if self._task is not None:
            await finish_or_cancel(self._task, self._stop_timeout)
        self.state = "stopped" if self.state == "stopping" else self.state
        self.phase = "idle"

    def _own(self) -> PeerProgress:
        return self.collab.own_progress(self.epoch, 0, 0.0, 0)

    async def _loop(self) -> None:
        last_epoch: int | None = None  # the epoch of our last round, and whether it went well
        last_ok = False
        try:
            while not self._stop_requested.is_set():
                self.phase = "syncing"
                own = self._own()
                await self.collab.publish(own)
                gp = await self.collab.global_progress(own)
                self.global_progress = gp
                self.epoch = gp.epoch
                if self.manifest.epochs is not None and gp.epoch >= self.manifest.epochs:
                    self.state = "finished"
                    break
                fresh = gp.epoch != last_epoch or not last_ok
                if gp.ready and fresh and gp.trainers_at_epoch >= self.manifest.min_peers:
                    last_epoch, last_ok = gp.epoch, await self._average(gp)
                    continue
                delay = next_report_delay(gp, 0.0, min_delay=MIN_LOOK_DELAY, max_delay=MAX_LOOK_DELAY)
                self.phase = "idle"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_requested.wait(), timeout=delay)
        except Exception as exc:  # keep the daemon up; the status says what happened
            self.state = "failed"
            self.error = {"message": f"{type(exc).__name__}: {exc}"}
            self._log.exception("aux_run_failed")
        finally:
            with contextlib.suppress(Exception):
                await self.collab.leave(self._own())
            self.phase = "idle"

    async def _average(self, gp: GlobalProgress) -> bool:
        assert self._vector is not None
        self.phase = "averaging"
        self._vector.fill(0.0)
        report = await self.collab.average(self._vector, f"grad/{gp.epoch}", 0.0,
                                           gp.trainers_at_epoch + gp.live_aux,
                                           self.manifest.compression)
        if report is not None and report["group_size"] > 1:
            self.last_round = report
        ok = report is not None and not report["failed_parts"] and report["group_size"] > 1
        if ok:
            self.rounds += 1
        else:
            self.failed_rounds += 1
        return ok

    def status(self) -> dict[str, Any]:
        return aux_status(self)
