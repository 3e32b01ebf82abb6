"""Revoking a member of a closed run re-keys it: the others train on, the revoked one is shut out.

The swarm simulator runs the real DHT, progress board, matchmaking and engine of each peer on
virtual time; the owner is a DHT node of its own ("owner" peer) through which `Swarm.revoke`
publishes the revocation list and the re-keying records (collab/rekeying.py).

What it shows: members whose refreshes of the list are out of step (they joined 7 s apart) all
learn the new generation and switch to it without one member's record going unreadable to
another (`unreadable_record` refusals stay as they were: with REKEY_GRACE = 0 the first to learn
writes records the others cannot read yet, and this fails); no trainer's round fails; what they
write then does not open with the old generation; the revoked member has no entry in the
re-keying records; a token issued afterwards carries the new generation. What it does not show:
members offline across the rotation, failing re-keying publishes, clock skew (tests/collab/
test_rekeying.py covers those on their own), or that the revoked member cannot get the records
(it is refused by the members' nodes only once they hold the list).
"""

from __future__ import annotations

import asyncio

import pytest

from dedloc.daemon.collab.errors import MembershipError
from dedloc.daemon.collab.membership import closed_run_of, rekey_key
from dedloc.daemon.collab.rekeying import REKEY_GRACE, chunk_of, open_chunk
from dedloc.daemon.collab.secrecy import MAGIC, RecordUnreadable
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.sim.network import LinkProfile
from dedloc.sim.swarm import PeerSpec, RunSpec, SimPeer, Swarm

pytestmark = pytest.mark.virtual_time

LINK = LinkProfile(upload=12.5e6, download=12.5e6, latency=0.01)


async def _until(swarm: Swarm, peers: list[SimPeer], epoch: int, seconds: float) -> None:
    end = swarm.loop.time() + seconds
    while swarm.loop.time() < end:
        if all(p.engine is not None and p.engine.progress.epoch >= epoch for p in peers):
            return
        await asyncio.sleep(1.0)  # (virtual time)
    epochs = [None if p.engine is None else p.engine.progress.epoch for p in peers]
    raise AssertionError(f"the members did not reach epoch {epoch}: {epochs}")


def _unreadable(peers: list[SimPeer]) -> int:
    return sum(p.membership.refusals_by_reason.get("unreadable_record", 0) for p in peers)


def _failed(peers: list[SimPeer]) -> int:
    return sum(p.engine.progress.failed_rounds for p in peers if p.engine is not None)


async def test_a_revocation_rekeys_the_run_and_the_others_train_on() -> None:
    # 4 trainers of 100 samples/s and an aux peer: an epoch takes about 10 simulated seconds
    swarm = Swarm(RunSpec(size=64, target_batch_size=4000, closed=True, average_state_every=2),
                  seed=5)
    try:
        owner = await swarm.add(PeerSpec("owner", link=LINK))
        trainers = []
        for _ in range(4):  # (a few seconds apart: each refreshes the revocation list in its turn)
            trainers.append(await swarm.add(PeerSpec("trainer", 100.0, LINK)))
            swarm.running = True
            await asyncio.sleep(7.0)  # (virtual time)
        aux = await swarm.add(PeerSpec("aux", link=LINK))
        await _until(swarm, trainers, 3, seconds=180.0)
        revoked, staying = trainers[-1], trainers[:-1]
        members = [*staying, aux]
        old_keys = revoked.membership.keys(owner.peer_id, "sim")
        assert old_keys is not None and old_keys.newest == 0
        failed_before = _failed(staying)
        unreadable_before = _unreadable(members)
        epoch = max(p.engine.progress.epoch for p in staying if p.engine is not None)

        revoked_at = swarm.loop.time()
        assert await swarm.revoke(revoked)
        # every member learns the next generation within a refresh and writes with it after
        # the grace; the run goes on meanwhile
        await _until(swarm, staying, epoch + 4, seconds=120.0)
        await asyncio.sleep(max(0.0, revoked_at + 30.0 + REKEY_GRACE + 20.0 - swarm.loop.time()))  # (virtual)
        await _until(swarm, staying, epoch + 6, seconds=120.0)

        # The revoked member learnt of it and stopped, saying why; the others trained on in one
        # run, with no failed round (the trainers': an aux peer here misses a round now and then
        # with or without a revocation).
        assert isinstance(revoked.error, MembershipError) and "revoked" in str(revoked.error)
        for peer in members:
            assert peer.error is None, peer.error
            keys = peer.membership.keys(owner.peer_id, "sim")
            assert keys is not None and (keys.newest, keys.writing) == (1, 1)
        assert _failed(staying) == failed_before, [p.engine and p.engine.progress.failed_rounds
                                                   for p in members]
        # no member met a record of another that it could not read yet (the grace's purpose)
        assert _unreadable(members) == unreadable_before
        assert len({p.trainer.parameters.tobytes() for p in staying if p.trainer}) == 1
        for peer in staying:
            assert peer.engine is not None
            senders = [entry.get("senders") for entry in peer.engine.epoch_history]
            assert senders[-3:] == [len(staying)] * 3, senders

        # What the members write now opens for each other and not with the revoked member's
        # secret (the old generation), even for a node that holds it (the owner's here).
        progress = [e for e in owner.dht.storage.entries()
                    if closed_run_of(e.key) is not None and e.key.endswith("/progress")
                    and e.signer in {p.peer_id for p in members}]
        assert {e.signer for e in progress} == {p.peer_id for p in members}
        new_key_id = swarm.ledger.secret.key_id
        for entry in progress:
            assert entry.value.startswith(MAGIC) and entry.value[4:8] == new_key_id
            with pytest.raises(RecordUnreadable, match="another key"):
                old_keys.decrypt(entry.signer, entry.key, entry.sub_key, entry.value)
            assert b"samples" in (staying[0].membership.reveal(entry) or b"")
        # The re-keying records hold an entry for each member and none for the revoked one.
        rekeying = [e for e in owner.dht.storage.entries() if "/rekey/" in e.key]
        chunks = swarm.ledger.chunks
        assert len(rekeying) == chunks >= 1
        for peer in [*members, revoked]:
            chunk = chunk_of(peer.peer_id, chunks)
            (value,) = [e.value for e in rekeying if e.key == rekey_key(owner.peer_id, "sim", chunk)]
            opened = open_chunk(peer.identity, owner.peer_id, "sim", value, chunk, chunks)
            assert (opened is None) == (peer is revoked)

        # A token issued after the re-keying carries the new generation: its holder joins and
        # trains with the others.
        newcomer = await swarm.add(PeerSpec("trainer", 100.0, LINK))
        token = newcomer.membership.held(owner.peer_id, "sim")
        assert isinstance(token, MembershipToken) and token.generation == 1
        run_epoch = max(p.engine.progress.epoch for p in staying if p.engine is not None)
        await _until(swarm, [*staying, newcomer], run_epoch + 4, seconds=180.0)
        assert newcomer.error is None, newcomer.error
        assert len({p.trainer.parameters.tobytes() for p in [*staying, newcomer]
                    if p.trainer}) == 1
        assert _failed(staying) == failed_before
    finally:
        await swarm.close()
