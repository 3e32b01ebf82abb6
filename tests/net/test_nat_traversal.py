"""Real daemons in the NAT lab: two peers behind home NATs and one public peer.

Behind port-restricted NATs the two NATed peers first reach each other through the public peer's
relay, then their link is upgraded to a punched path (WebRTC here, with the public peer's own STUN
responder; no outside server); behind symmetric NATs punching cannot work and they stay on the
relay. In both cases an averaging round among the three succeeds.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from natlab import Host, NatKind, NatLab
from support import DaemonProcess, wait_until

PORT = 4100
LENGTH = 300_000


@pytest.fixture
async def lab_daemons(natlab: NatLab) -> AsyncIterator[Any]:
    started: list[DaemonProcess] = []
    root = Path(tempfile.mkdtemp(prefix="dl-nat-", dir="/tmp"))
    names = itertools.count()

    async def start(host: Host, *args: str) -> DaemonProcess:
        directory = root / f"{host.namespace[-6:]}{next(names)}"
        directory.mkdir()
        daemon = await DaemonProcess.start(directory, *args, prefix=("ip", "netns", "exec", host.namespace),
                                           listen=f"/ip4/{host.address}/tcp/{PORT}")
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        await daemon.kill()
    shutil.rmtree(root, ignore_errors=True)


async def _swarm(natlab: NatLab, lab_daemons: Any, kind: NatKind) -> tuple[Any, Any, Any, dict[str, str]]:
    public = natlab.add_public_host("pub")
    homes = [natlab.add_nat(f"nat{i}", kind) for i in (1, 2)]
    hosts = [natlab.add_host_behind(router, f"peer{i}") for i, router in enumerate(homes, 1)]
    p = await lab_daemons(public)
    info = await p.call("node.info")
    bootstrap = next(a for a in info["addresses"]["p2p"] if a.startswith(f"/ip4/{public.address}/"))
    a, b = [await lab_daemons(h, "--net.bootstrap", bootstrap) for h in hosts]

    async def relayed(daemon: Any) -> dict[str, Any] | None:
        node = await daemon.call("node.info")
        return node if node["relays"] and node["dht"]["joined"] else None

    infos = [await wait_until(lambda d=d: relayed(d), timeout=60) for d in (a, b)]
    for node in infos:
        assert node["reachable"] is False and node["relays"] == [info["peer_id"]]
    ids = {"p": info["peer_id"], "a": infos[0]["peer_id"], "b": infos[1]["peer_id"]}
    circuit = next(x for x in infos[1]["addresses"]["p2p"] if "/p2p-circuit/" in x)
    assert (await a.call("node.connect", {"address": circuit, "timeout": 20}))["peer_id"] == ids["b"]
    return p, a, b, ids


async def _kind(daemon: Any, peer_id: str) -> str | None:
    kinds = {p["kind"] for p in await daemon.call("node.peers") if p["peer_id"] == peer_id}
    best = [k for k in ("tcp", "holepunch", "webrtc", "relay") if k in kinds]
    return best[0] if best else None


async def _average_three(daemons: list[Any], key: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(LENGTH, dtype=np.float32) for _ in daemons]
    shms = [shared_memory.SharedMemory(create=True, size=v.nbytes) for v in vectors]
    try:
        for shm, vector in zip(shms, vectors, strict=True):
            np.ndarray(LENGTH, np.float32, shm.buf)[:] = vector
        reports = await asyncio.gather(*(d.call("averaging.average", {
            "key": key, "buffer": shm.name, "length": LENGTH, "expected_peers": len(daemons),
            "timeout": 60}, timeout=90) for d, shm in zip(daemons, shms, strict=True)))
        expected = np.mean(vectors, axis=0)
        for shm in shms:
            np.testing.assert_allclose(np.ndarray(LENGTH, np.float32, shm.buf), expected, rtol=1e-5,
                                       atol=1e-5)
        return list(reports)
    finally:
        for shm in shms:
            shm.close()
            shm.unlink()


async def test_port_restricted_nats_punch_through(natlab: NatLab, lab_daemons: Any) -> None:
    p, a, b, ids = await _swarm(natlab, lab_daemons, NatKind.PORT_RESTRICTED)

    async def punched() -> bool:
        return await _kind(a, ids["b"]) in ("holepunch", "webrtc") and \
            await _kind(b, ids["a"]) in ("holepunch", "webrtc")

    await wait_until(punched, timeout=60)
    # TCP hole punching comes first where both NATs keep port mappings (here they do).
    assert await _kind(a, ids["b"]) == "holepunch" or await _kind(b, ids["a"]) == "holepunch"
    reports = await _average_three([p, a, b], "nat/round-1")
    assert {r["group_size"] for r in reports} == {3}
    assert all(not r["failed_parts"] for r in reports)


async def test_symmetric_nats_fall_back_to_the_relay(natlab: NatLab, lab_daemons: Any) -> None:
    p, a, b, ids = await _swarm(natlab, lab_daemons, NatKind.SYMMETRIC)
    assert await _kind(a, ids["b"]) == "relay"

    async def upgrade_given_up() -> bool:
        counters = (await a.call("node.info"))["counters"]
        counters_b = (await b.call("node.info"))["counters"]
        return counters.get("net.upgrades_failed", 0) + counters_b.get("net.upgrades_failed", 0) >= 1

    await wait_until(upgrade_given_up, timeout=60)
    assert await _kind(a, ids["b"]) == "relay"  # still carried, by the relay
    reports = await _average_three([p, a, b], "nat/round-2")
    assert {r["group_size"] for r in reports} == {3}
    assert all(not r["failed_parts"] for r in reports)


async def test_when_the_relay_dies_the_peers_reconnect_through_another(natlab: NatLab,
                                                                      lab_daemons: Any) -> None:
    publics = [natlab.add_public_host(f"pub{i}") for i in (1, 2)]
    homes = [natlab.add_nat(f"nat{i}", NatKind.SYMMETRIC) for i in (1, 2)]
    hosts = [natlab.add_host_behind(router, f"peer{i}") for i, router in enumerate(homes, 1)]
    relays = [await lab_daemons(h) for h in publics]
    infos = [await r.call("node.info") for r in relays]
    bootstraps = [next(x for x in i["addresses"]["p2p"] if x.startswith(f"/ip4/{h.address}/"))
                  for i, h in zip(infos, publics, strict=True)]
    await relays[1].call("node.connect", {"address": bootstraps[0]})
    a, b = [await lab_daemons(h, "--net.bootstrap", ",".join(bootstraps)) for h in hosts]

    async def two_relays(daemon: Any) -> dict[str, Any] | None:
        node = await daemon.call("node.info")
        return node if len(node["relays"]) == 2 else None

    node_a, node_b = [await wait_until(lambda d=d: two_relays(d), timeout=60) for d in (a, b)]
    circuits = [x for x in node_b["addresses"]["p2p"] if "/p2p-circuit/" in x]
    assert len(circuits) == 2
    await a.call("node.connect", {"address": circuits[0], "timeout": 20})
    peer = next(p for p in await a.call("node.peers") if p["peer_id"] == node_b["peer_id"])
    assert peer["kind"] == "relay"
    used = next(i for i, info in enumerate(infos) if info["peer_id"] in peer["address"])

    # The relay dies (SIGKILL): the relayed link breaks; asked for B by its peer id alone, A
    # finds the way through the other relay (B's circuit addresses reached A in B's hello).
    await relays[used].kill()

    async def link_gone() -> bool:
        return await _kind(a, node_b["peer_id"]) is None

    await wait_until(link_gone, timeout=60)
    again = await a.call("node.connect", {"address": node_b["peer_id"], "timeout": 30})
    assert again["peer_id"] == node_b["peer_id"]
    peer = next(p for p in await a.call("node.peers") if p["peer_id"] == node_b["peer_id"])
    assert peer["kind"] == "relay" and infos[1 - used]["peer_id"] in peer["address"]
    assert node_a["reachable"] is False


async def test_a_turn_server_carries_webrtc_between_symmetric_nats(natlab: NatLab, lab_daemons: Any,
                                                                   tmp_path: Path) -> None:
    """A coturn (Debian's package) that the run's owner operates, given in net.ice_servers: ICE
    relays through it where punching cannot work, beside our own relay."""
    turn_host = natlab.add_public_host("turn")
    config = tmp_path / "turnserver.conf"
    config.write_text("\\n".join([
        f"listening-ip={turn_host.address}", f"relay-ip={turn_host.address}", "listening-port=3479",
        "min-port=49152", "max-port=49400", "realm=lab", "lt-cred-mech", "user=lab:labpass",
        "fingerprint", "no-tls", "no-dtls", "no-cli", "no-multicast-peers", "log-file=stdout",
        "simple-log", f"pidfile={tmp_path / 'turn.pid'}"]) + "\\n")
    turn = turn_host.run("turnserver", "-c", str(config), stdout=asyncio.subprocess.DEVNULL,
                         stderr=asyncio.subprocess.DEVNULL)
    try:
        public = natlab.add_public_host("pub")
        homes = [natlab.add_nat(f"nat{i}", NatKind.SYMMETRIC) for i in (1, 2)]
        hosts = [natlab.add_host_behind(router, f"peer{i}") for i, router in enumerate(homes, 1)]
        p = await lab_daemons(public)
        info = await p.call("node.info")
        bootstrap = next(x for x in info["addresses"]["p2p"] if x.startswith(f"/ip4/{public.address}/"))
        ice = f"turn:lab:labpass@{turn_host.address}:3479?transport=udp"
        a, b = [await lab_daemons(h, "--net.bootstrap", bootstrap, "--net.ice_servers", ice)
                for h in hosts]

        async def relayed(daemon: Any) -> dict[str, Any] | None:
            node = await daemon.call("node.info")
            return node if node["relays"] else None

        node_b = await wait_until(lambda: relayed(b), timeout=60)
        await wait_until(lambda: relayed(a), timeout=60)
        circuit = next(x for x in node_b["addresses"]["p2p"] if "/p2p-circuit/" in x)
        await a.call("node.connect", {"address": circuit, "timeout": 20})

        async def over_turn() -> bool:
            return await _kind(a, node_b["peer_id"]) == "webrtc"

        await wait_until(over_turn, timeout=60)
    finally:
        turn.kill()
        turn.wait()


async def test_a_natted_peer_is_found_by_its_id_alone(natlab: NatLab, lab_daemons: Any) -> None:
    """Its circuit addresses are in the DHT (`peer/<id>`), for peers that know only its id (the
    transport's resolver reads them: tests/net/test_relay.py)."""
    public = natlab.add_public_host("pub")
    home = natlab.add_nat("nat1", NatKind.SYMMETRIC)
    host = natlab.add_host_behind(home, "peer1")
    other_public = natlab.add_public_host("pub2")
    p = await lab_daemons(public)
    info = await p.call("node.info")
    bootstrap = next(x for x in info["addresses"]["p2p"] if x.startswith(f"/ip4/{public.address}/"))
    hidden = await lab_daemons(host, "--net.bootstrap", bootstrap)
    stranger = await lab_daemons(other_public, "--net.bootstrap", bootstrap)

    async def published() -> dict[str, Any] | None:
        node = await hidden.call("node.info")
        # (the stranger reads the DHT once it has joined: on a loaded machine it may still be
        # joining when the hidden peer has its relays)
        if not node["relays"] or not (await stranger.call("node.info"))["dht"]["joined"]:
            return None
        found = await stranger.call("dht.get", {"key": f"peer/{node['peer_id']}"})
        return node if found and found.get("sub_keys") else None

    node = await wait_until(published, timeout=60)
    record = await stranger.call("dht.get", {"key": f"peer/{node['peer_id']}"})
    (entry,) = record["sub_keys"].values()
    circuits = [a for a in entry["value"] if "/p2p-circuit/" in a]
    assert f"{bootstrap}/p2p-circuit/p2p/{node['peer_id']}" in circuits
    answer = await stranger.call("node.connect", {"address": node["peer_id"], "timeout": 30})
    assert answer["peer_id"] == node["peer_id"]
