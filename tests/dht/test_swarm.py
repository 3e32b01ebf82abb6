"""DHT nodes on a MemoryNetwork: joining, replication under churn, client mode, forged records.
On virtual time: the 0.5 s call timeouts of a 40-node swarm expired on a loaded machine."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator

import pytest
from dht.swarm import FAST, Swarm

from dedloc.daemon import timebase
from dedloc.daemon.dht import DHTNode, Entry, ForbiddenWrite, key_id_of, node_id_of
from dedloc.daemon.dht import protocol as wire
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RemoteError

pytestmark = pytest.mark.virtual_time


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    swarm = Swarm()
    yield swarm
    await swarm.close()


async def grow(swarm: Swarm, count: int) -> list[DHTNode]:
    for _ in range(count):
        assert await swarm.add() or len(swarm.nodes) == 1
    return swarm.nodes


def holders(nodes: list[DHTNode], key: str) -> set[str]:
    now = timebase.now()
    return {n.peer_id for n in nodes if n.storage.get(key, now)}


async def test_64_nodes_survive_losing_20_percent(swarm: Swarm) -> None:
    rng = random.Random(20240501)
    nodes = await grow(swarm, 64)
    expiration = timebase.now() + 600
    keys = [f"key-{i}" for i in range(50)]
    for i, key in enumerate(keys):
        stored = await rng.choice(nodes).store(key, f"value-{i}".encode(), expiration)
        assert stored == FAST.replicas
        # replicas sit on the nodes closest to the key
        closest = sorted(nodes, key=lambda n: n.node_id ^ key_id_of(key))[:FAST.replicas]
        assert holders(nodes, key) == {n.peer_id for n in closest}

    victims = rng.sample(nodes, 13)
    for i, victim in enumerate(victims):
        if i % 4 == 0:
            swarm.network.blackhole(victim.peer_id)  # a silent peer: calls time out
        else:
            swarm.network.set_down(victim.peer_id)  # a refused dial
    survivors = [n for n in nodes if n not in victims]

    async def read(i: int, key: str) -> bytes | None:
        record = await rng.choice(survivors).get(key, timeout=FAST.lookup_timeout)
        return None if record is None else record.value

    values = await asyncio.gather(*(read(i, key) for i, key in enumerate(keys)))  # every get returned
    assert values == [f"value-{i}".encode() for i in range(50)]


async def test_all_nodes_form_one_swarm(swarm: Swarm) -> None:
    nodes = await grow(swarm, 40)

    async def finds_everyone(node: DHTNode) -> list[str]:
        missing = []
        for other in nodes:
            if await node.find_peer(other.peer_id) is None:
                missing.append(other.peer_id)
        return missing

    missing = await asyncio.gather(*(finds_everyone(n) for n in nodes))
    assert all(not m for m in missing)


async def test_client_mode_node_stores_and_reads_but_is_in_no_table(swarm: Swarm) -> None:
    nodes = await grow(swarm, 12)
    client = await swarm.add(dataclasses.replace(FAST, client_mode=True))
    assert client.joined
    expiration = timebase.now() + 60
    assert await client.store("from-client", b"hello", expiration) == FAST.replicas
    assert len(client.storage) == 0
    record = await nodes[5].get("from-client")
    assert record is not None and record.value == b"hello"
    assert (await client.get("from-client")).value == b"hello"  # type: ignore[union-attr]
    await nodes[3].store("from-server", b"hi", expiration)
    assert (await client.get("from-server")).value == b"hi"  # type: ignore[union-attr]
    for node in nodes:
        await node.find_nodes(client.node_id)
    assert all(client.peer_id not in node.routing_table for node in nodes)
    assert await nodes[0].find_peer(client.peer_id) is None
    with pytest.raises(RemoteError):  # it answers no DHT RPC
        await swarm.transports[0].call(client.peer_id, wire.PING, Message({}), timeout=1)


async def test_reader_detects_forged_records(swarm: Swarm) -> None:
    nodes = await grow(swarm, 16)
    alice, reader = nodes[1], nodes[2]
    key = "run/peers"
    stored = await alice.store(key, b"alice-is-here", timebase.now() + 60, sub_key=alice.peer_id)
    assert stored == FAST.replicas
    liars = [n for n in nodes if n not in (alice, reader) and n.storage.get(key, timebase.now())]
    honest_holder = liars.pop()
    for liar in liars:  # every holder but one (and the writer) lies, with a later expiration
        real = liar.storage.get(key, timebase.now())[0]
        forged = dataclasses.replace(real, value=b"evil", expiration=real.expiration + 5)
        liar.storage.replace_unchecked(forged)
    alice.storage.remove(key, alice.peer_id)
    reader.storage.remove(key, alice.peer_id)
    record = await reader.get(key)
    assert record is not None
    assert record.sub_keys[alice.peer_id].value == b"alice-is-here"
    assert reader.stats["forged_records"] >= 1
    assert honest_holder.peer_id in {c.peer_id for c in await reader.find_nodes(key_id_of(key))}
    # a liar that returned a forged record left the reader's routing table
    assert any(liar.peer_id not in reader.routing_table for liar in liars)
    # with no honest holder left, the reader returns nothing rather than the forgery
    honest_holder.storage.remove(key, alice.peer_id)
    assert await reader.get(key) is None


async def test_foreign_sub_key_write_refused_by_every_node(swarm: Swarm) -> None:
    nodes = await grow(swarm, 10)
    alice, bob = nodes[1], nodes[2]
    key = "run/peers"
    await alice.store(key, b"alice", timebase.now() + 60, sub_key=alice.peer_id)
    with pytest.raises(ForbiddenWrite):  # bob's own node refuses before sending anything
        await bob.store(key, b"bob-as-alice", timebase.now() + 120, sub_key=alice.peer_id)
    # bob bypasses his node and sends raw dht.store requests: every honest node refuses them
    bob_identity = bob.identity
    forbidden = Entry.create(bob_identity, key, b"bob-as-alice", timebase.now() + 120, sub_key=alice.peer_id)
    impersonating = dataclasses.replace(forbidden, signer=alice.peer_id)
    for node in nodes:
        if node is bob:
            continue
        for entry, kind in ((forbidden, "ForbiddenWrite"), (impersonating, "BadSignature")):
            message = wire.encode_store(entry, wire.encode_caller(False, []))
            with pytest.raises(RemoteError) as info:
                await swarm.transports[2].call(node.peer_id, wire.STORE, message, timeout=1)
            assert info.value.kind == kind
    record = await nodes[7].get(key)
    assert record is not None and record.sub_keys[alice.peer_id].value == b"alice"


async def test_bootstrap_failure_does_not_break_start_and_is_retried(swarm: Swarm) -> None:
    seed_identity = Identity.generate()
    seed_transport = swarm.network.transport(seed_identity.peer_id)
    swarm.network.set_down(seed_identity.peer_id)
    address = str(seed_transport.listen_addresses()[0])
    late = await swarm.add(bootstrap=[address, "/dns/memory/tcp/65000"])  # second: nothing there
    assert not late.joined
    swarm.network.restore(seed_identity.peer_id)
    seed = DHTNode(seed_transport, seed_identity, FAST)
    swarm.nodes.append(seed)
    swarm.transports.append(seed_transport)
    await seed.start()
    assert await late.wait_joined(timeout=10)
    assert late.peer_id in seed.routing_table and seed.peer_id in late.routing_table
    assert await late.store("k", b"v", timebase.now() + 60) == 2


async def test_lookup_returns_by_its_deadline_when_every_peer_is_silent(swarm: Swarm) -> None:
    nodes = await grow(swarm, 8)
    for node in nodes[1:]:
        swarm.network.blackhole(node.peer_id)
    assert await nodes[0].get("anything", timeout=0.2) is None
    assert await nodes[0].store("k", b"v", timebase.now() + 60, timeout=0.2) == 1  # only itself


async def test_expired_records_vanish_with_a_fake_clock() -> None:
    clock = [1_000_000.0]
    swarm = Swarm()
    try:
        for _ in range(6):
            identity = Identity.generate()
            transport = swarm.network.transport(identity.peer_id)
            node = DHTNode(transport, identity, FAST, clock=lambda: clock[0])
            bootstrap = [str(swarm.transports[0].listen_addresses()[0])] if swarm.transports else []
            swarm.nodes.append(node)
            swarm.transports.append(transport)
            await node.start(bootstrap)
        await swarm.nodes[0].store("short", b"v", clock[0] + 10)
        assert (await swarm.nodes[3].get("short")).value == b"v"  # type: ignore[union-attr]
        clock[0] += 11
        assert await swarm.nodes[4].get("short") is None
        assert all(n.storage.sweep(clock[0]) <= 1 and len(n.storage) == 0 for n in swarm.nodes)
    finally:
        await swarm.close()


async def test_new_node_close_to_a_key_receives_it(swarm: Swarm) -> None:
    nodes = await grow(swarm, 24)
    keys = [f"k{i}" for i in range(30)]
    for key in keys:
        await nodes[0].store(key, b"v", timebase.now() + 60)
    await grow(swarm, 8)
    newcomers = swarm.nodes[24:]
    await asyncio.sleep(0)  # let the replication tasks run
    for _ in range(50):
        if not any(len(n._tasks) > 1 for n in swarm.nodes):
            break
        await asyncio.sleep(0.01)
    due = received = 0
    for key in keys:
        closest = sorted(swarm.nodes, key=lambda n: n.node_id ^ key_id_of(key))[:FAST.replicas]
        for node in closest:
            if node in newcomers:
                due += 1
                received += bool(node.storage.get(key, timebase.now()))
    # Best effort (replication tasks beyond max_background_tasks are dropped; republish catches
    # up later): most, not necessarily all, of the records due reach the newcomers.
    assert due and received >= due // 2
    assert node_id_of(nodes[0].peer_id) == nodes[0].node_id


async def test_a_record_that_expires_in_transit_is_dropped_without_blaming_its_holder(swarm: Swarm) -> None:
    """A holder checks expiry at its own "now"; a record that expires while the reply travels is
    an honest race (it happened under load in the chaos test): the reader drops it and keeps the
    holder, where a forged record gets the holder banned."""
    nodes = await grow(swarm, 6)
    writer, reader = nodes[1], nodes[2]
    key = "run/short-lived"
    await writer.store(key, b"brief", timebase.now() + 60, sub_key=writer.peer_id)
    reader.storage.remove(key, writer.peer_id)
    writer.storage.remove(key, writer.peer_id)
    reader._clock = lambda: timebase.now() + 120  # the reader sees every reply after it expired
    assert await reader.get(key) is None
    assert reader.stats["expired_in_transit"] >= 1
    assert reader.stats["forged_records"] == 0
    assert sum(1 for n in nodes if n.peer_id in reader.routing_table) == len(nodes) - 1


async def test_a_node_that_lost_every_peer_waits_for_one_instead_of_saying_it_joined(
        swarm: Swarm) -> None:
    # it joined once, then its only peer's entry went (the peer left): `wait_joined` returned
    # at once then, and the daemon's run autojoin looped on it without yielding (CI: a daemon
    # that answered no call for 120 s). Now it waits until a peer is known again
    seed = await swarm.add()
    late = await swarm.add(bootstrap=[str(swarm.transports[0].listen_addresses()[0])])
    assert await late.wait_joined(timeout=10) and late.joined
    swarm.network.blackhole(seed.peer_id)  # (so that it does not call the node meanwhile)
    late.routing_table.remove(seed.peer_id)
    assert not late.joined
    assert not await late.wait_joined(timeout=1.0)  # (virtual time)
    swarm.network.restore(seed.peer_id)
    waiting = asyncio.create_task(late.wait_joined(timeout=30))
    await seed.introduce(late.peer_id, tuple(swarm.transports[1].listen_addresses()))
    assert await waiting and late.joined
