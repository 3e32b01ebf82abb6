"""Daemons on 127.0.0.1: one that nobody can dial reserves a slot on a reachable peer and is
reached through it; the relayed link shows as such."""

from __future__ import annotations

from typing import Any

from support import p2p_address, wait_until


async def test_an_undialable_daemon_is_reached_through_its_relay(daemon_factory: Any) -> None:
    relay = await daemon_factory()
    address = await p2p_address(relay)
    # It announces an address where nothing listens: its peers' dial-back fails, as behind a NAT.
    hidden = await daemon_factory("--net.bootstrap", address, "--net.announce", "/ip4/127.0.0.1/tcp/9")

    async def reserved() -> dict[str, Any] | None:
        info = await hidden.call("node.info")
        return info if info["relays"] else None

    info = await wait_until(reserved, timeout=60)
    relay_id = (await relay.call("node.info"))["peer_id"]
    assert info["reachable"] is False and info["relays"] == [relay_id]
    circuit = next(a for a in info["addresses"]["p2p"] if "/p2p-circuit/" in a)
    assert circuit.endswith(f"/p2p/{relay_id}/p2p-circuit/p2p/{info['peer_id']}")

    third = await daemon_factory()
    connected = await third.call("node.connect", {"address": circuit})
    assert connected["peer_id"] == info["peer_id"]
    peers = {p["peer_id"]: p for p in await third.call("node.peers")}
    assert peers[info["peer_id"]]["kind"] == "relay"
    counters = (await relay.call("node.info"))["counters"]
    assert counters["relay.circuits"] == 1 and counters["relay.reservations"] >= 1
    # The relay's own view: the hidden peer's slot.
    assert any(p["peer_id"] == info["peer_id"] for p in await relay.call("node.peers"))
