"""Simulated daemons: the real transport, DHT, averager, state sharing and run engine of each
peer, composed as the node composes them, on a `SimNetwork`, with a `VectorTrainer` for a worker.

`Swarm` starts, stops and crashes `SimPeer`s; each peer's tasks run in a context of its own (its
clock, with its own skew). Liars (`Lie`) publish false progress reports and are otherwise honest.
A closed run (`RunSpec.closed`) has an owner outside the swarm that issued every peer a token
(from `Swarm.ledger`); a peer of role "dht" runs only a DHT node, which takes no part in the run
(in a closed run: a non-member that stores the run's records, as any node close to their keys
does). A peer of role "owner" is the owner's DHT node: through it `Swarm.revoke` publishes a
revocation and the re-keying it brings (collab/rekeying.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import math
import random
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import structlog

from dedloc.daemon import timebase
from dedloc.daemon.averaging.aggregation import DEFAULT_RUN_AGGREGATION
from dedloc.daemon.averaging.averager import Averager
from dedloc.daemon.averaging.settings import AveragingSettings
from dedloc.daemon.collab.board import DhtProgressBoard
from dedloc.daemon.collab.donors import DonorChoice
from dedloc.daemon.collab.engine import RunEngine, RunProgress
from dedloc.daemon.collab.lineage import initial_lineage
from dedloc.daemon.collab.manifest import RunManifest, owner_signing_bytes
from dedloc.daemon.collab.membership import MembershipRegistry
from dedloc.daemon.collab.ownership import RunLedger, publish_ledger
from dedloc.daemon.collab.policy import Schedule, Timing
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.collab.rekeying import REKEY_GRACE
from dedloc.daemon.collab.rounds import NetworkRounds
from dedloc.daemon.collab.secrecy import RunSecret
from dedloc.daemon.collab.state_sync import NetworkStates, StateSharing
from dedloc.daemon.dht import DHTConfig, DHTNode
from dedloc.daemon.identity import Identity
from dedloc.daemon.net.link import LinkLimits
from dedloc.daemon.net.transport import TransportLimits

from .clock import SkewedClock
from .network import LinkProfile, SimNetwork, SimTransport
from .trainer import ArrayBuffer, VectorTrainer

log = structlog.get_logger(__name__)

__all__ = ["Lie", "PeerSpec", "RunSpec", "SimPeer", "Swarm"]

Lie = Literal["epoch", "next", "samples", "weight"]
#: what a "weight" liar claims as its averaging weight, in target batches (it reports honestly)
WEIGHT_LIE_TARGETS = 4


@dataclass(frozen=True)
class RunSpec:
    """The simulated run: its vector size and the manifest's schedule."""

    size: int = 256
    target_batch_size: int = 4096
    min_peers: int = 1
    average_state_every: int = 0
    epochs: int | None = None
    max_group_size: int = 64
    window: float = 5.0
    lr: float = 0.1
    aggregation: str = DEFAULT_RUN_AGGREGATION  # the reducers' rule (averaging/aggregation.py)
    closed: bool = False  # owned by `Swarm.owner`, which gives every peer a token

    def manifest(self, owner: str | None = None) -> RunManifest:
        return RunManifest("vector", {"size": self.size, "lr": self.lr}, self.target_batch_size,
                           self.epochs, self.min_peers, self.average_state_every,
                           aggregation=self.aggregation, owner=owner if self.closed else None,
                           closed=self.closed)

    def schedule(self) -> Schedule:
        return Schedule(self.target_batch_size, self.min_peers, self.epochs,
                        self.average_state_every)


@dataclass(frozen=True)
class PeerSpec:
    # "dht": a DHT node only; "owner": the closed run's owner's DHT node (module docstring)
    role: Literal["trainer", "aux", "dht", "owner"] = "trainer"
    samples_per_second: float = 100.0
    link: LinkProfile = field(default_factory=LinkProfile)
    skew: float = 0.0  # seconds this peer's clock is off
    lie: Lie | None = None


class _LyingBoard:
    """A board that publishes this peer's reports falsified (and reads honestly)."""

    def __init__(self, board: DhtProgressBoard, lie: Lie, target: int) -> None:
        self._board = board
        self._lie = lie
        self._target = target
        self._seen = 0
        self.key = board.key

    def _falsify(self, report: PeerProgress) -> PeerProgress:
        if self._lie == "epoch":  # colluding liars: one far head, claimed by all of them
            return dataclasses.replace(report, epoch=report.epoch + 10_000, lineage="f" * 32,
                                       samples_accumulated=self._target, planned=None,
                                       total_samples=10**12)
        if self._lie == "next":  # colluding liars: the epoch after the run's, a lineage of their own
            return dataclasses.replace(report, epoch=max(report.epoch, self._seen) + 1,
                                       lineage="e" * 32, samples_accumulated=self._target,
                                       planned=None)
        return dataclasses.replace(report, samples_accumulated=self._target, planned=None,
                                   samples_per_second=1e6)

    async def publish(self, report: PeerProgress) -> bool:
        return await self._board.publish(self._falsify(report))

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        reports, received = await self._board.read()
        # (the highest epoch the others report: a "next" liar claims the one after it)
        self._seen = max([self._seen, *(r.epoch for r in reports if r.lineage != "e" * 32)])
        return reports, received

    async def leave(self, report: PeerProgress) -> None:
        await self._board.leave(report)


class _TimedBoard:
    """A peer's board whose reads are timed on the virtual clock (`Swarm.board_reads`): at a
    few hundred peers they took seconds, while the trainers decided apart."""

    def __init__(self, board: DhtProgressBoard | _LyingBoard, reads: array[float]) -> None:
        self._board = board
        self._reads = reads
        self.key = board.key

    async def publish(self, report: PeerProgress) -> bool:
        return await self._board.publish(report)

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        started = asyncio.get_running_loop().time()
        try:
            return await self._board.read()
        finally:
            self._reads.append(asyncio.get_running_loop().time() - started)

    async def leave(self, report: PeerProgress) -> None:
        await self._board.leave(report)


#: Links in a simulation: keepalives every 30 s (a real daemon's 15 s would only cost wall time).
SIM_LINKS = LinkLimits(ping_interval=30.0, ping_timeout=90.0, idle_timeout=300.0)
SIM_DHT = DHTConfig(rpc_timeout=2.0, lookup_timeout=5.0, join_timeout=10.0,
                    refresh_interval=600.0, republish_interval=300.0, maintenance_period=30.0)


class SimPeer:
    """One simulated daemon (see the module docstring)."""

    def __init__(self, swarm: Swarm, index: int, spec: PeerSpec) -> None:
        self.swarm = swarm
        self.index = index
        self.spec = spec
        self.identity = Identity.from_seed(swarm.rng.randbytes(32))
        if spec.role == "owner":
            self.identity = swarm.owner
        self.rng = random.Random(swarm.rng.random())
        self.peer_id = self.identity.peer_id
        self.context = contextvars.copy_context()
        self.context.run(timebase.use, SkewedClock(swarm.loop, spec.skew))
        self.context.run(structlog.contextvars.bind_contextvars, sim=index)  # (in its logs)
        self.host = swarm.network.add_host(spec.link)
        self.started_at = swarm.loop.time()
        self.stopped_at: float | None = None
        self.synced_at: float | None = None  # first step or state download
        self.run_epoch_at_join: int | None = None
        self.trainer: VectorTrainer | None = None
        self.engine: RunEngine | None = None
        self.sharing: StateSharing | None = None
        self.dht_serving = False  # a "dht" peer, once its node has started
        self._task: asyncio.Task[str] | None = None
        # what a stopped peer leaves for the scenario's figures (its daemon's objects are let go:
        # a churn scenario replaces hundreds of peers, and memory per live peer must stay flat)
        self._final_progress: RunProgress | None = None
        self.served = 0  # state downloads it served

    @property
    def alive(self) -> bool:
        return self.stopped_at is None

    def _in_context(self, coro: object) -> asyncio.Task[object]:
        return self.swarm.loop.create_task(coro, context=self.context)  # type: ignore[arg-type]

    async def start(self, bootstrap: list[str]) -> None:
        await self._in_context(self._start(bootstrap))

    async def _start(self, bootstrap: list[str]) -> None:
        swarm, run = self.swarm, self.swarm.run
        self.transport = SimTransport.start_on(swarm.network, self.host, self.identity,
                                               limits=TransportLimits(link=SIM_LINKS))
        self.membership = MembershipRegistry(self.identity)
        self.dht = DHTNode(self.transport, self.identity, SIM_DHT, access=self.membership,
                           rng=random.Random(self.rng.random()))
        role = self.spec.role
        if role in ("dht", "owner"):
            if role == "owner":
                ledger = swarm.ledger
                self.membership.keep_keys("sim", ledger.generation, ledger.newest_first(), 0.0)
            await self.dht.start(bootstrap, wait=True)
            self.dht_serving = True
            return
        owner_signature = None
        if run.closed:
            owner = swarm.owner
            self.membership.hold(swarm.ledger.issue(owner, self.peer_id, role, 30 * 86400.0))
            owner_signature = owner.sign(owner_signing_bytes(
                "sim", run.manifest(owner.peer_id).fingerprint())).hex()
        averaging = AveragingSettings(window=run.window, max_group_size=run.max_group_size,
                                      upload_mbps=self.spec.link.upload * 8 / 1e6,
                                      download_mbps=self.spec.link.download * 8 / 1e6)
        self.transport.set_address_resolver(lambda peer: self.dht.addresses_of(peer, timeout=5))
        self.averager = Averager(self.transport, self.dht, averaging, nonce=self.rng.randbytes)
        manifest = run.manifest(swarm.owner.peer_id)
        board = DhtProgressBoard(self.dht, self.identity, self.membership, "sim", manifest,
                                 role, run.size, owner_signature=owner_signature)
        published = _TimedBoard(board if self.spec.lie in (None, "weight")
                                else _LyingBoard(board, self.spec.lie, run.target_batch_size),
                                swarm.board_reads)
        if self.spec.lie == "weight":  # it claims samples it never computed in every round
            self.averager._claimed_weight = float(WEIGHT_LIE_TARGETS * run.target_batch_size)
        self.sharing = StateSharing(self.transport, self._find_engine, self.membership)
        await self.dht.start(bootstrap, wait=True)
        if role == "trainer":
            self.trainer = VectorTrainer(run.size, samples_per_second=self.spec.samples_per_second,
                                         run_seed=swarm.seed, data_seed=self.rng.randrange(2**31),
                                         lr=run.lr)
        progress = RunProgress(lineage=initial_lineage(manifest.fingerprint()))
        self.engine = RunEngine(
            peer_id=self.peer_id, role=role, schedule=run.schedule(), board=published,
            averaging=NetworkRounds(self.averager, board.key, self.dht),
            states=NetworkStates(self.transport, self.membership, board.key, allocate=ArrayBuffer,
                                parameters=run.size, rng=random.Random(self.rng.random())),
            trainer=self.trainer, progress=progress, parameters=run.size,
            aggregation=manifest.aggregation, timing=swarm.timing,
            name="sim", donors=DonorChoice(rng=random.Random(self.rng.random())))
        self._key = board.key
        self._task = self.swarm.loop.create_task(self.engine.run(), context=self.context)

    def _find_engine(self, key: str) -> RunEngine | None:
        return self.engine if self.alive and key == self._key else None

    async def stop(self, *, crash: bool = False) -> None:
        """Leave (a farewell, then close), or `crash`: vanish at once, links reset."""
        await self._in_context(self._stop(crash))

    async def _stop(self, crash: bool) -> None:
        self.stopped_at = self.swarm.loop.time()
        task = self._task
        if self.engine is not None and task is not None:
            if crash:
                task.cancel()
            else:
                self.engine.stop()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                log.warning("sim_engine_failed", peer=self.index, error=repr(task.exception()))
        await self.dht.close()
        await self.transport.close()
        self._release()

    def _release(self) -> None:
        """Let a stopped peer's daemon go; keep its figures (`progress`, `served`, `error`)."""
        if self.engine is not None:
            self._final_progress = self.engine.progress
        if self.sharing is not None:
            self.served = self.sharing.served
        self.engine = self.trainer = self.sharing = None
        for name in ("averager", "membership", "dht", "transport", "_key"):
            self.__dict__.pop(name, None)

    @property
    def progress(self) -> RunProgress | None:
        """The run's progress on this peer (a stopped one's as it left)."""
        return self.engine.progress if self.engine is not None else self._final_progress

    @property
    def error(self) -> BaseException | None:
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()


class Swarm:
    """Peers on one simulated network (see the module docstring)."""

    def __init__(self, run: RunSpec, *, seed: int = 0, timing: Timing | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.network = SimNetwork()
        self.run = run
        self.seed = seed
        self.rng = random.Random(seed)
        self.timing = timing or Timing()
        self.peers: list[SimPeer] = []
        self.running = False  # set once the first peers have started: later ones are newcomers
        self.board_reads: array[float] = array("f")  # seconds each board read took (_TimedBoard)
        # a closed run's owner (outside the swarm) and the secret its tokens carry (drawn apart
        # from `rng`: an open run's swarm is the same with or without them)
        owner_rng = random.Random(f"owner-{seed}")
        self.owner = Identity.from_seed(owner_rng.randbytes(32))
        self.secret = RunSecret(owner_rng.randbytes(32))
        self.ledger = RunLedger("sim", self.owner.peer_id, {0: self.secret})

    async def revoke(self, peer: SimPeer) -> bool:
        """The owner revokes `peer` (a new generation of the run's secret) and publishes it
        through its DHT node (a live "owner" peer); True if it was stored."""
        owner = next(p for p in self.live if p.spec.role == "owner")
        return bool(await owner._in_context(self._revoke(owner, peer)))

    async def _revoke(self, owner: SimPeer, peer: SimPeer) -> bool:
        ledger = self.ledger
        ledger.revoke(None, peer.peer_id)
        owner.membership.learn(ledger.revocations())
        # as OwnedRuns does: the owner writes with it only a grace after its records are stored
        owner.membership.keep_keys("sim", ledger.generation, ledger.newest_first(), math.inf)
        stored = await publish_ledger(owner.dht, ledger)
        if ledger.rekeyed:
            owner.membership.keep_keys("sim", ledger.generation, ledger.newest_first(),
                                       REKEY_GRACE, ledger.rekeyed)
        return stored

    @property
    def live(self) -> list[SimPeer]:
        return [p for p in self.peers if p.alive]

    async def add(self, spec: PeerSpec | None = None) -> SimPeer:
        peer = SimPeer(self, len(self.peers), spec or PeerSpec())
        self.peers.append(peer)
        live = [p for p in self.live if p is not peer and p.engine is not None]
        if live and self.running:
            gp = max((p.engine.global_progress for p in live if p.engine is not None
                      and p.engine.global_progress is not None), key=lambda g: g.epoch, default=None)
            peer.run_epoch_at_join = None if gp is None else gp.epoch
        known = [p for p in self.live if p is not peer and (
            p.engine is not None or p.dht_serving)]
        bootstrap = [str(p.transport.listen_addresses()[0])
                     for p in self.rng.sample(known, min(3, len(known)))]
        await peer.start(bootstrap)
        return peer

    async def close(self) -> None:
        await asyncio.gather(*(p.stop(crash=True) for p in self.live))
