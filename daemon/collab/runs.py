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
from .aux import AuxRun
from .errors import ManifestError
from .manifest import PublishedManifest, RunManifest, choose_manifest, find_manifests
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
        self._runs: dict[str, Run | AuxRun] = {}
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

    async def start(self, workload: str | None, config: dict[str, Any], name: str | None,
                    target_batch_size: int, epochs: int | None, checkpoint_every: int,
                    device: str | None, collaborative: bool = False, min_peers: int = 1,
                    role: str | None = None, average_state_every: int = 5,
                    compression: str = "none") -> dict[str, Any]:
        role = role or self.config.node.role
        collaborative = collaborative or role == "aux" or workload is None
        name = name or workload
        if name is None:
            raise ValueError("give a workload to start a run, or a run name to join one")
        if not RUN_NAME.match(name):
            raise ValueError(f"run name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if collaborative and self.network is None:
            raise RunNotActiveError("collaborative runs need the peer network")
        async with self._lock:
            if self._closing:
                raise ShuttingDownError("the daemon is shutting down")
            existing = self._runs.get(name)
            if existing is not None and existing.active:
                raise RunExistsError(f"run {name!r} is already {existing.state}; stop it first "
                                     "(run.stop) or give the new run another name")
            run: Run | AuxRun
            if role == "aux" or workload is None:
                published = await self._find(name, workload)
                if role == "aux":
                    assert self.network is not None
                    run = AuxRun(self.network, name, published, self.config.workers.stop_timeout)
                    await run.start()
                    self._runs[name] = run
                    return run.status()
                manifest = published.manifest
            else:
                manifest = RunManifest(workload, config, target_batch_size, epochs, min_peers,
                                       average_state_every, compression)
            spec = RunSpec(name=name, manifest=manifest, checkpoint_every=checkpoint_every,
                           seed=self.data_seed(name), device=device or self.config.workers.device)
            run = Run(spec, self.runs_dir, self._spawn_worker,
                      stop_timeout=self.config.workers.stop_timeout,
                      network=self.network if collaborative else None)
            await run.start()
            self._runs[name] = run
            status = run.status()
        if collaborative:
            status["other_manifests"] = await self._others(name, run.spec.fingerprint())
        return status

    async def _find(self, name: str, workload: str | None) -> PublishedManifest:
        dht = None if self.network is None else self.network.dht
        if dht is None:
            raise ManifestError("this node has not joined the network yet, so it cannot look up "
                                f"run {name!r}; try again in a few seconds")
        found = await find_manifests(dht, name)
        if workload is not None:
            found = [f for f in found if f.manifest.workload == workload]
        return choose_manifest(name, found)

    async def _others(self, name: str, fingerprint: str) -> list[dict[str, Any]]:
        """Manifests other peers publish under the same name (a typo or a changed config)."""
        dht = None if self.network is None else self.network.dht
        if dht is None:
            return []
        others = [f.to_json() for f in await find_manifests(dht, name) if f.fingerprint != fingerprint]
        if others:
            log.warning("other_runs_under_the_same_name", run=name, fingerprint=fingerprint,
                        others=[o["fingerprint"] for o in others])
        return others

    def find_by_key(self, key: str) -> Run | None:
        """The active collaborative run whose peer-to-peer key is `key` (for state donations)."""
        for run in self._runs.values():
            if isinstance(run, Run) and run.sync is not None and run.sync.key == key and run.active:
                return run
        return None

    def get(self, name: str | None) -> Run | AuxRun:
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
                raise RunNotActiveError(f"run {run.name!r} is {run.state}; only a stopped, "
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
