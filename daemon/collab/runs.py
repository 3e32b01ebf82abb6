"""The runs of this daemon, by name: start, stop, restart, status; all stopped on shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import TYPE_CHECKING, Any

import structlog

from ..config import Config
from ..errors import RunExistsError, RunNotActiveError, ShuttingDownError, UnknownRunError
from ..workers.process import WorkerProcess
from .collaboration import Collaboration
from .run import Run, RunSpec

if TYPE_CHECKING:
    from ..network import PeerNetwork

log = structlog.get_logger(__name__)

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RunRegistry:
    def __init__(self, config: Config, peer_id: str, network: PeerNetwork | None = None) -> None:
        self.config = config
        self.peer_id = peer_id
        self.network = network
        self.runs_dir = config.state_dir() / "runs"
        self.sockets_dir = config.runtime_dir() / "workers"
        self._runs: dict[str, Run] = {}
        self._lock = asyncio.Lock()
        self._closing = False

    def data_seed(self, run_name: str) -> int:
        """Each peer samples its own data: a seed from its peer id and the run's name."""
        digest = hashlib.sha256(f"{self.peer_id}/{run_name}".encode()).digest()
        return int.from_bytes(digest[:4], "big")

    async def _spawn_worker(self, run_name: str) -> WorkerProcess:
        workers = self.config.workers
        return await WorkerProcess.spawn(
            self.config.worker_command(), self.sockets_dir / f"{run_name}.sock",
            start_timeout=workers.start_timeout, call_timeout=workers.call_timeout,
            log_lines=workers.log_lines, threads=workers.threads, label=run_name)

    async def start(self, workload: str, config: dict[str, Any], name: str | None,
                    target_batch_size: int, epochs: int | None, checkpoint_every: int,
                    device: str | None, collaborative: bool = False,
                    min_peers: int = 1) -> dict[str, Any]:
        name = name or workload
        if not RUN_NAME.match(name):
            raise ValueError(f"run name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        async with self._lock:
            if self._closing:
                raise ShuttingDownError("the daemon is shutting down")
            existing = self._runs.get(name)
            if existing is not None and existing.active:
                raise RunExistsError(f"run {name!r} is already {existing.state}; stop it first "
                                     "(run.stop) or give the new run another name")
            spec = RunSpec(name=name, workload=workload, config=config,
                           target_batch_size=target_batch_size, epochs=epochs,
                           checkpoint_every=checkpoint_every, seed=self.data_seed(name),
                           device=device or self.config.workers.device, min_peers=min_peers)
            if collaborative and self.network is None:
                raise RunNotActiveError("collaborative runs need the peer network")
            collaboration = Collaboration(self.network, spec) if collaborative and self.network else None
            run = Run(spec, self.runs_dir / name, self._spawn_worker,
                      stop_timeout=self.config.workers.stop_timeout, collaboration=collaboration)
            await run.start()
            self._runs[name] = run
            return run.status()

    def find_by_key(self, key: str) -> Run | None:
        """The active collaborative run whose peer-to-peer key is `key` (for state donations)."""
        for run in self._runs.values():
            if run.collaboration is not None and run.collaboration.key == key and run.active:
                return run
        return None

    def get(self, name: str | None) -> Run:
        if name is None:
            active = [r for r in self._runs.values() if r.active] or list(self._runs.values())
            if len(active) == 1:
                return active[0]
            if not active:
                raise UnknownRunError("there is no run; start one with run.start")
            raise UnknownRunError(f"several runs exist ({', '.join(sorted(self._runs))}); name one")
        try:
            return self._runs[name]
        except KeyError:
            raise UnknownRunError(f"no run named {name!r}; runs: "
                                  f"{', '.join(sorted(self._runs)) or 'none'}") from None

    async def stop(self, name: str | None) -> dict[str, Any]:
        run = self.get(name)
        async with self._lock:
            await run.stop()
        return run.status()

    async def restart(self, name: str | None) -> dict[str, Any]:
        run = self.get(name)
        async with self._lock:
            if self._closing:
                raise ShuttingDownError("the daemon is shutting down")
            if run.active:
                raise RunNotActiveError(f"run {run.spec.name!r} is {run.state}; only a stopped, "
                                        "crashed, failed or finished run can be restarted")
            await run.restart()
        return run.status()

    def statuses(self) -> list[dict[str, Any]]:
        return [run.status() for run in self._runs.values()]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for run in self._runs.values():
            counts[run.state] = counts.get(run.state, 0) + 1
        return counts

    async def close(self) -> None:
        """Stop every run (checkpointing each) and refuse new ones."""
        self._closing = True
        async with self._lock:
            await asyncio.gather(*(run.stop() for run in self._runs.values()))
