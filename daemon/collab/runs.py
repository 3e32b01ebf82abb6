"""The runs of this daemon, by name: start, stop, restart, status; all stopped on shutdown."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from .. import timebase
from ..dht.records import is_peer_id
from ..errors import RunExistsError, RunNotActiveError, ShuttingDownError, UnknownRunError
from ..workers.process import WorkerProcess
from ..workers.settings import WorkerSettings
from .aux import AuxRun
from .availability import Availability, IdleMonitor, TrainingHours, own_process_tree
from .errors import ManifestError, MembershipError
from .manifest import AUTO_AGGREGATION, PublishedManifest, RunManifest, choose_manifest, find_manifests
from .ownership import REPUBLISH_EVERY, OwnedRuns
from .run import Run, RunSpec
from .settings import RUN_NAME, LimitsSettings
from .tokens import MembershipToken

if TYPE_CHECKING:
    from ..dht import DHTNode
    from ..network import PeerNetwork
    from .ports import StateDonor

log = structlog.get_logger(__name__)

PAUSED_REASON = "paused by the volunteer (dedloc resume to go on)"


class RunRegistry:
    def __init__(self, peer_id: str, network: PeerNetwork | None = None, *, state_dir: Path,
                 runtime_dir: Path, workers: WorkerSettings, limits: LimitsSettings,
                 default_role: str = "trainer") -> None:
        """Runs keep their state under `state_dir` and their workers' sockets under
        `runtime_dir`; `default_role` is what a run.start without a role takes part as."""
        self.peer_id = peer_id
        self.network = network
        self.workers = workers
        self.default_role = default_role
        self.runs_dir = state_dir / "runs"
        self.sockets_dir = runtime_dir / "workers"
        self._runs: dict[str, Run | AuxRun] = {}
        self._lock = asyncio.Lock()
        self._closing = False
        self._publish_now = asyncio.Event()  # a revocation that was not published: try again
        self.owned = (None if network is None
                      else OwnedRuns(network.identity, state_dir / "owned",
                                     on_keys=network.membership.keep_keys))
        idle = (IdleMonitor(own_process_tree, limits.idle_cpu_share, limits.idle_seconds)
                if limits.idle_only else None)
        self.availability = Availability(TrainingHours.parse(limits.hours), idle)
        self._paused_file = state_dir / "paused"
        if self._paused_file.is_file():  # a pause outlives restarts until `dedloc resume`
            self.availability.paused_by = PAUSED_REASON

    def data_seed(self, run_name: str) -> int:
        """Each peer samples its own data: a seed from its peer id and the run's name."""
        digest = hashlib.sha256(f"{self.peer_id}/{run_name}".encode()).digest()
        return int.from_bytes(digest[:4], "big")

    async def _spawn_worker(self, run_name: str) -> WorkerProcess:
        workers = self.workers
        return await WorkerProcess.spawn(
            workers.command_line(), self.sockets_dir / f"{run_name}.sock",
            start_timeout=workers.start_timeout, call_timeout=workers.call_timeout,
            log_lines=workers.log_lines, threads=workers.threads,
            gpu_memory_fraction=workers.gpu_memory_fraction, duty_cycle=workers.duty_cycle,
            label=run_name)

    async def start(self, workload: str | None, config: dict[str, Any], name: str | None,
                    target_batch_size: int, epochs: int | None, checkpoint_every: int,
                    device: str | None, collaborative: bool = False, min_peers: int = 1,
                    role: str | None = None, average_state_every: int = 5,
                    compression: str = "none", closed: bool = False,
                    token: str | None = None,
                    sync: Mapping[str, Any] | None = None, *,
                    aggregation: str = AUTO_AGGREGATION) -> dict[str, Any]:
        """Start (or join) a run; `sync`: the manifest's sync fields (RunManifest.sync_fields)
        when the run is created here."""
        role = role or self.default_role
        held = self._hold(token, name) if token is not None else None
        if held is not None:  # a closed run of another owner: its manifest comes from the DHT
            name, workload, collaborative = held.run, None, True
            if held.role == "aux" and role != "aux":
                raise MembershipError("this token admits an aux peer only; join with --aux "
                                      "(role aux), or ask the run's owner for a trainer token")
        if closed and (workload is None or held is not None):
            raise ValueError("closed=true creates a run you own: give its workload (to join "
                             "someone else's closed run, give the token they issued you)")
        collaborative = collaborative or closed or role == "aux" or workload is None
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
            if existing is not None:  # finished, it may still linger or serve its final state
                await existing.stop()
            run: Run | AuxRun
            owner_signature = None
            if role == "aux" or workload is None:
                published = await self._find(name, workload, None if held is None else held.owner)
                if role == "aux":
                    assert self.network is not None
                    run = AuxRun(self.network, name, published, self.workers.stop_timeout)
                    await run.start()
                    self._runs[name] = run
                    return run.status()
                manifest, owner_signature = published.manifest, published.owner_signature
            else:
                if closed:  # its ledger holds the secret its records are encrypted with
                    self._owned().ledger(name)
                manifest = RunManifest(workload, config, target_batch_size, epochs, min_peers,
                                       average_state_every, compression,
                                       owner=self.peer_id if closed else None, closed=closed,
                                       aggregation=aggregation,
                                       **dict(sync or {}))
            spec = RunSpec(name=name, manifest=manifest, checkpoint_every=checkpoint_every,
                           seed=self.data_seed(name), device=device or self.workers.device,
                           owner_signature=owner_signature)
            run = Run(spec, self.runs_dir, self._spawn_worker,
                      stop_timeout=self.workers.stop_timeout,
                      network=self.network if collaborative else None,
                      availability=self.availability)
            await run.start()
            self._runs[name] = run
            status = run.status()
        if collaborative and not run.spec.manifest.closed:
            status["other_manifests"] = await self._others(name, run.spec.fingerprint())
        return status

    def _hold(self, token_text: str, name: str | None) -> MembershipToken:
        """Decode and keep the token of a closed run this peer was given (MembershipError)."""
        if self.network is None:
            raise RunNotActiveError("closed runs need the peer network")
        token = MembershipToken.decode(token_text)
        if name is not None and name != token.run:
            raise MembershipError(f"the token is for run {token.run!r}, not {name!r}")
        self.network.membership.hold(token)
        return token

    async def _find(self, name: str, workload: str | None, owner: str | None = None) -> PublishedManifest:
        if self.network is None or self.network.dht is None or not self.network.joined:
            raise ManifestError("this node has not joined the network yet, so it cannot look up "
                                f"run {name!r}; try again in a few seconds")
        found = await find_manifests(self.network.dht, name, owner)
        if workload is not None:
            found = [f for f in found if f.manifest.workload == workload]
        return choose_manifest(name, found)

    async def _others(self, name: str, fingerprint: str) -> list[dict[str, Any]]:
        """Manifests other peers publish under the same name (a typo or a changed config)."""
        if self.network is None or self.network.dht is None or not self.network.joined:
            return []
        others = [f.to_json() for f in await find_manifests(self.network.dht, name)
                  if f.fingerprint != fingerprint]
        if others:
            log.warning("other_runs_under_the_same_name", run=name, fingerprint=fingerprint,
                        others=[o["fingerprint"] for o in others])
        return others

    def find_by_key(self, key: str) -> StateDonor | None:
        """What serves the state of the collaborative run whose peer-to-peer key is `key`: its
        engine while it runs or lingers, then its final state's donor (final_state.py)."""
        for run in self._runs.values():
            if not isinstance(run, Run) or run.key != key:
                continue
            if run.engine is not None and (run.active or run.lingering):
                return run.engine
            if run.final_donor is not None and run.final_donor.holds_state:
                return run.final_donor
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

    # The volunteer's limits -----------------------------------------------------------------

    def pause(self) -> dict[str, Any]:
        """Stop training in every run (they leave their rounds) until resume(), restarts included."""
        self._paused_file.parent.mkdir(parents=True, exist_ok=True)
        self._paused_file.write_text(f"paused at {timebase.now():.0f}\n")
        self.availability.paused_by = PAUSED_REASON
        log.info("training_paused")
        return self.availability_status()

    def resume(self) -> dict[str, Any]:
        self._paused_file.unlink(missing_ok=True)
        self.availability.paused_by = None
        log.info("training_resumed")
        return self.availability_status()

    def availability_status(self) -> dict[str, Any]:
        idle = self.availability.idle
        return {"paused": self.availability.paused_by is not None,
                "blocked": self.availability.blocked(),
                "hours": self.availability.hours.describe(),
                "idle_only": idle is not None,
                "others_cpu_share": None if idle is None else idle.others_share}

    async def watch_idleness(self, every: float = 5.0) -> None:
        """Sample the machine's CPU use by others (only when training waits for idleness)."""
        while not self._closing:
            if self.availability.idle is not None:
                await asyncio.to_thread(self.availability.idle.sample)
            await asyncio.sleep(every)

    # The owner's side of closed runs ------------------------------------------------------

    def _owned(self) -> OwnedRuns:
        if self.owned is None:
            raise RunNotActiveError("closed runs need the peer network")
        return self.owned

    def token_issue(self, name: str, peer: str, role: str, days: float) -> dict[str, Any]:
        if not RUN_NAME.match(name):
            raise ValueError(f"run name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if not is_peer_id(peer):
            raise ValueError(f"{peer!r} is not a peer id (the volunteer's `dedloc info` shows it)")
        token = self._owned().issue(name, peer, role, days)
        return {"token": token.encode(), "run": name, "owner": token.owner, "peer": peer,
                "role": role, "serial": token.serial, "expires": token.expires}

    async def token_revoke(self, name: str, serial: str | None, peer: str | None) -> dict[str, Any]:
        owned = self._owned()
        revocations = owned.revoke(name, serial, peer)
        assert self.network is not None
        self.network.membership.learn(revocations)  # this daemon refuses them at once
        published = False
        if self.network.dht is not None and self.network.joined:
            published = await owned.publish(self.network.dht, name)
        if not published:  # (tried again soon, backing off: publish_revocations)
            self._publish_now.set()
        rekey_error = owned.rekey_errors.get(name)
        return {"run": name, "revoked_serials": sorted(revocations.serials),
                "revoked_peers": sorted(revocations.peers), "version": revocations.version,
                "published": published, "generation": revocations.generation,
                "rekeyed": rekey_error is None,
                **({} if rekey_error is None else {"rekey_error": rekey_error})}

    def token_list(self, name: str) -> dict[str, Any]:
        return self._owned().listing(name)

    async def publish_revocations(self) -> None:
        """Keep every owned run's revocation list in the DHT (on start, then periodically)."""
        owned = self.owned
        if owned is None or self.network is None:
            return
        network = self.network
        for name in owned.names():
            network.membership.learn(owned.ledger(name).revocations())

        async def joined() -> DHTNode | None:
            return network.dht if await network.wait_joined(timeout=REPUBLISH_EVERY) else None

        await owned.keep_published(joined, self._publish_now, lambda: self._closing)

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
