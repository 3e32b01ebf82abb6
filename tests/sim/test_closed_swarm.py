"""A closed run's records in the DHT are ciphertext to every node that is not a member.

The swarm simulator runs the real DHT, progress board, manifest publishing, matchmaking and run
engine of each peer over its in-memory transport, on virtual time. Two of its nodes take no part
in the run ("dht" peers: no token, nothing but a DHT node), and in a swarm this small every node
is among the closest to every key, so they store all of the run's records. They must hold and
serve them without being able to read them, while the members train together as in an open run.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from dedloc.daemon import timebase
from dedloc.daemon.averaging.matchmaking import DHT_PREFIX
from dedloc.daemon.collab.manifest import run_key
from dedloc.daemon.collab.membership import closed_run_of
from dedloc.daemon.collab.roster import Rosters, writers
from dedloc.daemon.collab.secrecy import MAGIC, RunSecret
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.dht.records import Entry
from dedloc.sim.network import LinkProfile
from dedloc.sim.scenarios import run_scenario
from dedloc.sim.swarm import PeerSpec, RunSpec, SimPeer, Swarm

pytestmark = pytest.mark.virtual_time

TRAINERS = 4
EPOCHS = 3


def _run() -> RunSpec:
    # 4 trainers of 100 samples/s: an epoch takes about 10 simulated seconds
    return RunSpec(size=64, target_batch_size=4000, closed=True, average_state_every=2)


async def _start(swarm: Swarm, strangers: int, trainers: int, aux: int) -> tuple[
        list[SimPeer], list[SimPeer]]:
    link = LinkProfile(upload=12.5e6, download=12.5e6, latency=0.01)
    outside = [await swarm.add(PeerSpec("dht", link=link)) for _ in range(strangers)]
    members = [await swarm.add(PeerSpec("trainer", 100.0, link)) for _ in range(trainers)]
    members += [await swarm.add(PeerSpec("aux", link=link)) for _ in range(aux)]
    swarm.running = True
    return outside, members


async def _until_epoch(swarm: Swarm, peers: list[SimPeer], epoch: int, seconds: float) -> None:
    end = swarm.loop.time() + seconds
    while swarm.loop.time() < end:
        if all(p.engine is not None and p.engine.progress.epoch >= epoch for p in peers):
            return
        await asyncio.sleep(1.0)  # (virtual time: the simulator's clock, not the wall's)
    epochs = [None if p.engine is None else p.engine.progress.epoch for p in peers]
    raise AssertionError(f"the members did not reach epoch {epoch}: {epochs}")


def _closed_entries(peer: SimPeer) -> list[Entry]:
    return [e for e in peer.dht.storage.entries() if closed_run_of(e.key) is not None]


async def test_non_members_store_the_runs_records_as_ciphertext_only() -> None:
    swarm = Swarm(_run(), seed=0)
    try:
        outside, members = await _start(swarm, strangers=2, trainers=TRAINERS, aux=1)
        trainers = [p for p in members if p.spec.role == "trainer"]
        await _until_epoch(swarm, trainers, EPOCHS, seconds=EPOCHS * 60.0)

        # The members trained together: every trainer stepped every epoch with all the others
        # (no failed round, one state).
        for peer in members:
            assert peer.error is None, peer.error
            assert peer.engine is not None and peer.engine.progress.failed_rounds == 0
        assert len({p.trainer.parameters.tobytes() for p in trainers if p.trainer}) == 1
        for peer in trainers:
            assert peer.engine is not None
            senders = [entry.get("senders") for entry in peer.engine.epoch_history]
            assert senders and all(count == TRAINERS for count in senders[1:]), senders

        # Matchmaking files its announcements under its own prefix (here the rounds found their
        # peers on the progress board and announced nothing): such a key is the run's too.
        writer, reader = trainers[-1], trainers[0]
        prefix = run_key("sim", swarm.run.manifest(swarm.owner.peer_id))
        announcement = f"{DHT_PREFIX}{prefix}/epoch-99"
        info = orjson.dumps({"peer_id": writer.peer_id, "compression": "none",
                             "addresses": ["/ip4/10.1.2.3/tcp/4567"]})
        assert await writer.dht.store(announcement, info, timebase.now() + 60.0,
                                      sub_key=writer.peer_id, timeout=5.0) >= 2

        # So are grid rounds' rosters (here no round needed one): the first writer of a view
        # publishes it, and another member takes it.
        view = [p.peer_id for p in trainers]
        first = next(p for p in trainers if p.peer_id == writers("grad/99", view)[0])
        assert await Rosters(first.dht, first.peer_id, prefix).agree("grad/99", view, wait=0.0)
        assert await Rosters(reader.dht, reader.peer_id, prefix).published("grad/99", view)

        # What the members read: every key of the run that a non-member holds, in clear.
        held = {e.key for p in outside for e in _closed_entries(p)}
        kinds = {key.rsplit("/", 1)[-1] for key in held}
        assert {"manifests", "progress", "epoch-99", "99"} <= kinds, held
        plain: list[bytes] = []
        for key in held:
            record = await reader.dht.get(key, timeout=5.0)
            if record is not None:
                plain += [entry.value for entry in record.entries]
        assert len(plain) >= TRAINERS + 1, plain
        assert any(b'"samples_accumulated"' in value for value in plain)  # progress reports
        assert any(b'"workload":"vector"' in value for value in plain)  # the manifest
        assert info in plain

        # What the non-members hold: ciphertext, none of it readable to them.
        for stranger in outside:
            entries = _closed_entries(stranger)
            assert len(entries) >= TRAINERS + 1
            for entry in entries:
                assert entry.value.startswith(MAGIC), entry
                with pytest.raises(orjson.JSONDecodeError):
                    orjson.loads(entry.value)
                for value in plain:
                    assert value[:16] not in entry.value and value[-16:] not in entry.value
                for text in (b"samples", b"epoch", b"workload", b"vector", b"compression",
                             b"addresses", b"fingerprint", b"/ip4/"):
                    assert text not in entry.value, (entry.key, text)
            # Reading the keys through their own node gives them nothing either.
            progress = next(key for key in held if key.endswith("/progress"))
            assert await stranger.dht.get(progress, timeout=5.0) is None
            assert stranger.dht.stats["unreadable_records"] > 0
            # (no member is blamed for what a node without the key cannot read)
            assert "unreadable_record" not in stranger.membership.refusals_by_reason
    finally:
        await swarm.close()


async def test_a_member_writing_with_another_key_is_dropped_and_counted() -> None:
    # A member holding a token the owner signed with another run key (an old key, or one that
    # a hostile member made up): the others cannot read its records. They drop each one,
    # count it against its writer, and train on without it; nothing fails.
    swarm = Swarm(_run(), seed=1)
    try:
        _, members = await _start(swarm, strangers=1, trainers=TRAINERS, aux=0)
        odd = members[-1]
        odd.membership.hold(MembershipToken.issue(swarm.owner, "sim", odd.peer_id, "trainer",
                                                  86400.0, RunSecret.generate()))
        honest = members[:-1]
        await _until_epoch(swarm, honest, EPOCHS, seconds=EPOCHS * 90.0)
        for peer in honest:
            assert peer.error is None, peer.error
            refusals = peer.membership.refusals_by_reason["unreadable_record"]
            assert refusals > 0 and set(peer.membership.refusals) == {odd.peer_id}, (
                peer.membership.refusals)
            assert peer.dht.stats["unreadable_records"] >= refusals
        assert odd.error is None, odd.error  # (it trains alone: it reads nobody either)
        assert len({p.trainer.parameters.tobytes() for p in honest if p.trainer}) == 1
    finally:
        await swarm.close()


async def test_a_closed_run_in_grid_rounds_trains_as_an_open_one() -> None:
    # 12 trainers in groups of at most 4: grid rounds, whose rosters are records of the run too
    # (collab/roster.py). Encrypted, they serve as in an open run (with the encryption replaced
    # by the identity this seed gives the same participation, failed rounds and step spread).
    result = await run_scenario("steady", 12, aux=1, epochs=3, max_group_size=4, closed=True)
    assert result.errors == [], result.errors
    assert not result.split_brain and result.max_epoch_spread <= 1, result.to_json()
    assert result.epochs >= 3, result.to_json()
    assert result.min_round_participation == 1.0 and result.failed_rounds == 0, result.to_json()
    assert result.step_spread <= 1e-5, result.to_json()
