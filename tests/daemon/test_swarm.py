"""Five real dedlocd processes on loopback, bootstrapped from one: discovery, DHT, ownership, expiry."""

from __future__ import annotations

import asyncio

import pytest
from support import p2p_address, wait_until

from dedloc.daemon.identity import Identity
from dedloc.rpc import ErrorCode, RpcCallError


async def test_five_daemons_form_one_swarm(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    first = await daemon_factory()
    bootstrap = await p2p_address(first)
    others = await asyncio.gather(*(daemon_factory("--net.bootstrap", bootstrap) for _ in range(4)))
    daemons = [first, *others]
    infos = [await d.call("node.info") for d in daemons]
    ids = {info["peer_id"] for info in infos}
    assert len(ids) == 5

    seen: dict[str, set[str]] = {}

    async def everyone_knows_everyone() -> bool:
        for daemon, info in zip(daemons, infos, strict=True):
            seen[info["peer_id"]] = {p["peer_id"] for p in await daemon.call("node.peers")}
        return all(seen[peer] == ids - {peer} for peer in ids)

    try:
        await wait_until(everyone_knows_everyone, timeout=60)
    except TimeoutError:
        pytest.fail("not everyone linked: " + repr({p[:8]: sorted(s[:8] for s in seen[p]) for p in seen}))
    for daemon in others:
        info = await daemon.call("node.info")
        assert info["reachable"] is True  # the bootstrap peer dialed it back on loopback
        assert info["dht"]["mode"] == "server" and info["dht"]["joined"]
    links = await first.call("node.peers")
    assert all(link["kind"] == "tcp" and link["bytes_in"] > 0 for link in links)

    # A value stored through one daemon is read through every other.
    stored = await daemons[2].call("dht.store", {"key": "run/demo", "value": {"epoch": 7}})
    assert stored["stored_on"] >= 3
    for daemon in daemons:
        record = await daemon.call("dht.get", {"key": "run/demo"})
        assert record["value"] == {"epoch": 7}
        assert record["signer"] == infos[2]["peer_id"]

    # A sub-key named by peer A can be written by A only.
    a, b = infos[1]["peer_id"], infos[3]["peer_id"]
    await daemons[1].call("dht.store", {"key": "run/members", "sub_key": a, "value": "A's"})
    with pytest.raises(RpcCallError) as refused:
        await daemons[3].call("dht.store", {"key": "run/members", "sub_key": a, "value": "B's"})
    assert refused.value.code == ErrorCode.DHT_REFUSED
    await daemons[3].call("dht.store", {"key": "run/members", "sub_key": b, "value": "B's"})
    for daemon in daemons:
        record = await daemon.call("dht.get", {"key": "run/members"})
        assert record["sub_keys"][a]["value"] == "A's"
        assert record["sub_keys"][a]["signer"] == a
        assert record["sub_keys"][b]["value"] == "B's"

    # Expired values disappear everywhere.
    await daemons[4].call("dht.store", {"key": "run/short", "value": 1, "ttl": 1.5})
    assert (await daemons[0].call("dht.get", {"key": "run/short"}))["value"] == 1

    async def gone_everywhere() -> bool:
        results = [await d.call("dht.get", {"key": "run/short"}) for d in daemons]
        return all(r is None for r in results)

    await wait_until(gone_everywhere, timeout=30)


async def test_connect_and_bad_addresses(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    one, two = await daemon_factory(), await daemon_factory()
    address = await p2p_address(two)
    answer = await one.call("node.connect", {"address": address})
    assert answer["peer_id"] == (await two.call("node.info"))["peer_id"]
    with pytest.raises(RpcCallError) as caught:
        await one.call("node.connect", {"address": "/ip4/127.0.0.1/tcp"})
    assert caught.value.code == ErrorCode.INVALID_PARAMS
    # The right address with another peer's id: the answering peer is not who it claims.
    wrong = address.rsplit("/", 1)[0] + "/" + (await one.call("node.info"))["peer_id"]
    with pytest.raises(RpcCallError) as caught:
        await one.call("node.connect", {"address": wrong})
    assert caught.value.code == ErrorCode.PEER_ID_MISMATCH
    # Nobody listens on port 9 of loopback.
    stranger = Identity.generate().peer_id
    with pytest.raises(RpcCallError) as caught:
        await one.call("node.connect", {"address": f"/ip4/127.0.0.1/tcp/9/p2p/{stranger}", "timeout": 5})
    assert caught.value.code == ErrorCode.PEER_UNREACHABLE
    assert (await one.call("node.info"))["counters"]["net.peer_id_mismatches"] == 1


async def test_bootstrap_failure_does_not_stop_start_up(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    lonely = await daemon_factory()
    lonely_id = (await lonely.call("node.info"))["peer_id"]
    # Port 9 on loopback: nothing listens there.
    daemon = await daemon_factory("--net.bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{lonely_id}")
    async def dht_started() -> dict | None:
        info = await daemon.call("node.info")
        return info if info["dht"]["mode"] != "starting" else None

    info = await wait_until(dht_started, timeout=60)
    assert info["reachable"] is None and info["dht"]["joined"] is False
    events = [e["event"] for e in daemon.events()]
    assert "bootstrap_peer_unreachable" in events
