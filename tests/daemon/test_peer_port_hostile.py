"""Hostile clients on a real daemon's peer port do not disturb its honest peers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

from support import p2p_address, wait_until


async def test_garbage_half_open_and_slowloris(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    target = await daemon_factory()
    honest = await daemon_factory()
    address = await p2p_address(target)
    port = int(address.split("/")[4])
    await honest.call("node.connect", {"address": address})
    loop = asyncio.get_running_loop()
    hostile: list[socket.socket] = []

    async def open_raw() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        hostile.append(sock)
        return sock

    # Garbage bytes instead of TLS.
    garbage = await open_raw()
    await loop.sock_sendall(garbage, b"\x16\x03\x01\xff\xff" + b"\x00" * 4096)
    # A TCP connection that never starts TLS.
    await open_raw()
    # A TLS handshake that stops half-way: send the ClientHello, never finish.
    half = await open_raw()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    await loop.sock_sendall(half, outgoing.read())
    # A slowloris: one byte at a time.
    slow = await open_raw()

    async def drip() -> None:
        with contextlib.suppress(OSError):
            for byte in b"\x16\x03\x01\x00\xc8" * 100:
                await loop.sock_sendall(slow, bytes([byte]))
                await asyncio.sleep(0.2)

    dripping = asyncio.create_task(drip())
    try:
        # Meanwhile the honest peer's DHT traffic and the control API keep working.
        for i in range(20):
            await honest.call("dht.store", {"key": f"k{i}", "value": i, "ttl": 60})
            record = await target.call("dht.get", {"key": f"k{i}"})
            assert record["value"] == i
            await asyncio.sleep(0.1)
    finally:
        dripping.cancel()
        for sock in hostile:
            sock.close()

    async def dropped_and_counted() -> dict | None:
        counters = (await target.call("node.info"))["counters"]
        return counters if counters.get("net.handshake_failures", 0) >= 3 else None

    counters = await wait_until(dropped_and_counted, timeout=60)
    assert counters["net.handshake_failures"] >= 3
    assert {p["peer_id"] for p in await target.call("node.peers")} == {
        (await honest.call("node.info"))["peer_id"]}
