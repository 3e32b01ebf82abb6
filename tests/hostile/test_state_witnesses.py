"""A donor that serves a doctored state (its parameters poisoned, its head the run's): the
newcomer asks witnesses at the same head for sketches of their parameters under a seed of its
own (collab/state_check.py) and refuses the state; it then loads an honest donor's, although the
poisoner also answers as a witness. The real transport, links, state streams and engine on the
simulator's virtual clock; the attacker is a peer that speaks the protocol."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping

import numpy as np
from collab.test_state_serving import KEY, L0, Donor

from dedloc.daemon import timebase
from dedloc.daemon.averaging.report import AveragingReport
from dedloc.daemon.collab.donors import DonorChoice
from dedloc.daemon.collab.engine import RunEngine, RunProgress
from dedloc.daemon.collab.membership import MembershipRegistry
from dedloc.daemon.collab.policy import Schedule
from dedloc.daemon.collab.ports import DownloadedState, Trained
from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.collab.state_sync import NetworkStates, StateSharing
from dedloc.daemon.identity import Identity
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import run_virtual
from dedloc.sim.network import SimNetwork, SimTransport
from dedloc.sim.trainer import ArrayBuffer

SIZE = 50_000
EPOCH = 3


class HeadBoard:
    """The donors' reports: all at the run's head (epoch 3), the target not reached."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = peers

    async def publish(self, report: PeerProgress) -> bool:
        return True

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        now = timebase.now()
        return ([PeerProgress(p, EPOCH, 0, 10.0, now, now + 30.0, "trainer", 100, lineage=L0)
                 for p in self.peers], {p: now for p in self.peers})

    async def leave(self, report: PeerProgress) -> None:
        return None


class NoRounds:
    max_group_size = 16

    async def average(self, vector: np.ndarray, key: str, **options: object) -> AveragingReport | None:
        raise AssertionError("no round in this test")

    def refused(self, peers: object) -> frozenset[str]:
        return frozenset()

    def round_over(self, key: str) -> None:
        pass

    async def roster_published(self, key: str, trainers: object, *, timeout: float) -> bool:
        return False


class LoadingTrainer:
    """Records the states it loads; the engine stops at the first."""

    def __init__(self) -> None:
        self.loaded: list[np.ndarray] = []
        self.engine: RunEngine | None = None

    async def train(self, samples: int, seconds: float) -> Trained:
        await asyncio.sleep(seconds)
        return Trained(0, 1.0, None)

    async def export_gradients(self) -> np.ndarray:
        return np.zeros(SIZE, np.float32)

    async def step(self, epoch: int) -> float | None:
        return None

    async def zero_grad(self) -> None:
        return None

    async def settle_residual(self, residual: np.ndarray) -> None:
        return None

    async def export_state(self) -> DownloadedState:
        raise AssertionError("nobody downloads from the newcomer")

    async def load_state(self, state: DownloadedState) -> None:
        self.loaded.append(state.buffer.array[: state.numel].copy())
        assert self.engine is not None
        self.engine.stop()


class PoisonerFirst(DonorChoice):
    """Picks the poisoner while it may (the test's worst case: a random pick finds it later)."""

    poisoner: str = ""

    def pick(self, donors: list[str], now: float,
             served: Mapping[str, int] | None = None) -> str | None:
        if self.poisoner in donors and now - self._failed_at.get(self.poisoner, -1e9) >= self.avoid_seconds:
            return self.poisoner
        return super().pick(donors, now, served)


def test_a_doctored_state_is_refuted_by_witnesses_and_an_honest_one_is_loaded() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        timebase.use(SkewedClock(loop))
        network = SimNetwork()
        honest_values = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
        donors, sharings = [], []
        for poisoned in (True, False, False):
            donor = Donor(SIZE)
            donor.epoch, donor.lineage = EPOCH, L0
            donor.values = honest_values.copy()
            if poisoned:  # a tenth of the values moved by one: 30 % of the norm
                donor.values[: SIZE // 10] += 1.0
            transport = SimTransport.start_on(network, network.add_host(), Identity.generate())
            sharings.append(StateSharing(transport, lambda key, d=donor: d if key == KEY else None))
            donors.append(transport)
        identity = Identity.generate()
        me = SimTransport.start_on(network, network.add_host(), identity)
        for transport in donors:
            me.learn_addresses(transport.peer_id, transport.listen_addresses())
        ids = [t.peer_id for t in donors]
        choice = PoisonerFirst(rng=random.Random(1))
        choice.poisoner = ids[0]
        trainer = LoadingTrainer()
        engine = RunEngine(peer_id=me.peer_id, role="trainer", schedule=Schedule(1000),
                           board=HeadBoard(ids), averaging=NoRounds(),
                           states=NetworkStates(me, MembershipRegistry(identity), KEY,
                                                allocate=ArrayBuffer, parameters=SIZE,
                                                rng=random.Random(2)),
                           trainer=trainer, progress=RunProgress(lineage=L0), parameters=SIZE,
                           donors=choice)
        trainer.engine = engine
        await asyncio.wait_for(engine.run(), timeout=3600)

        assert engine.progress.refuted_states == 1  # the poisoner's state, by both witnesses
        assert len(trainer.loaded) == 1  # an honest donor's, though the poisoner witnessed it
        np.testing.assert_array_equal(trainer.loaded[0], honest_values)
        assert engine.progress.epoch == EPOCH and engine.progress.state_downloads == 1
        assert sum(s.sketched for s in sharings) >= 3
        for transport in (*donors, me):
            await transport.close()

    run_virtual(main())
