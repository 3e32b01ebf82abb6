"""Ten thousand writes to a closed run's keys under as many made-up signers: each is refused and
counted, but what is kept per peer stays bounded (ids are free) and the log gets a line per peer
a minute at most, not one per refusal. At the DHT, a record whose signature does not verify is
refused before it is counted against the signer it names."""

from __future__ import annotations

import pytest
import structlog

from dedloc.daemon.collab.membership import MAX_REFUSING, MembershipRegistry, NotAMember, namespace
from dedloc.daemon.collab.secrecy import RunSecret
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.identity import Identity


def test_a_flood_of_made_up_signers_is_counted_within_bounds() -> None:
    owner = Identity.generate()
    now = [1000.0]
    registry = MembershipRegistry(Identity.generate(), clock=lambda: now[0])
    key = f"{namespace('secret', owner.peer_id)}/progress"
    with structlog.testing.capture_logs() as logs:
        for i in range(10_000):
            with pytest.raises(NotAMember):
                registry.authorize_write(f"6Mk-made-up-{i}", key, None)
        for _ in range(100):  # one peer, again and again, within a minute: one line
            with pytest.raises(NotAMember):
                registry.authorize_write("6Mk-persistent", key, None)
        now[0] += 61.0
        with pytest.raises(NotAMember):
            registry.authorize_write("6Mk-persistent", key, None)
    assert registry.refusals_by_reason["dht_write"] == 10_101
    assert len(registry.refusals) <= MAX_REFUSING
    assert registry.refusals["6Mk-persistent"] == 101
    assert registry.refused_peers == 10_001
    persistent = [e for e in logs if e.get("peer") == "6Mk-persistent"[:16]]
    assert len(persistent) == 2
    assert len(logs) == 10_002  # one per made-up signer (each a new peer), two for the repeater


@pytest.mark.virtual_time
async def test_a_forged_record_is_refused_before_its_signer_is_counted() -> None:
    from dataclasses import replace

    from dht.swarm import Swarm

    from dedloc.daemon.dht import protocol
    from dedloc.daemon.dht.records import Entry
    from dedloc.daemon.net import RemoteError

    swarm = Swarm()
    try:
        for _ in range(2):
            await swarm.add()
        owner = Identity.generate()
        victim_node = swarm.nodes[1]
        registry = MembershipRegistry(victim_node.identity)
        victim_node.access = registry
        key = f"{namespace('secret', owner.peer_id)}/progress"
        attacker = Identity.generate()
        from dedloc.daemon import timebase
        entry = Entry.create(attacker, key, b"x", timebase.now() + 60)
        forged = replace(entry, signer=Identity.generate().peer_id)  # blames someone else
        with pytest.raises(RemoteError, match="signature"):
            await swarm.transports[0].call(victim_node.identity.peer_id, protocol.STORE,
                                           protocol.encode_store(forged, {}), timeout=5)
        assert registry.refusals == {} and registry.refused_peers == 0
    finally:
        await swarm.close()


@pytest.mark.virtual_time
async def test_a_closed_runs_records_without_a_membership_proof_are_not_read() -> None:
    """A node that knows nothing of closed runs stores anything: a non-member's record under a
    closed run's key, served from there, is dropped by a reader (proofs are checked on read too,
    not only on STORE); the owner's own record is read."""
    from dht.swarm import Swarm

    from dedloc.daemon import timebase

    swarm = Swarm()
    try:
        for _ in range(4):
            await swarm.add()
        owner_node, reader, _, attacker = swarm.nodes
        key = f"{namespace('secret', owner_node.identity.peer_id)}/progress"
        expiration = timebase.now() + 60
        # The owner encrypts the run's records with the run's key; the reader is a member (it
        # refuses to store the forgery, and holds the key).
        secret = RunSecret.generate()
        owner_node.access = owner_access = MembershipRegistry(owner_node.identity)
        owner_access.keep_secret("secret", secret)
        reader.access = reader_access = MembershipRegistry(reader.identity)
        reader_access.hold(MembershipToken.issue(owner_node.identity, "secret",
                                                 reader.identity.peer_id, "trainer", 600, secret))
        assert await attacker.store(key, b"forged report", expiration,
                                    sub_key=attacker.identity.peer_id)
        assert await owner_node.store(key, b"owner's report", expiration,
                                      sub_key=owner_node.identity.peer_id)
        record = await reader.get(key, timeout=5)
        assert record is not None
        assert {e.signer for e in record.entries} == {owner_node.identity.peer_id}
        assert [e.value for e in record.entries] == [b"owner's report"]
        assert reader.stats["unproven_records"] >= 1
    finally:
        await swarm.close()
