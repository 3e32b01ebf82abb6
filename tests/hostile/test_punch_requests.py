"""`path.punch` makes the daemon query STUN servers and send SYNs and TLS hellos to the address it
is given. Asked by a stranger over a relayed link: never toward loopback, unspecified, multicast
or broadcast addresses; one punch per peer at a time and per PUNCH_COOLDOWN; a few at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from dedloc.daemon.net import punch_path
from dedloc.daemon.net.interface import Message
from dedloc.daemon.net.punch_path import PunchRefused, TcpPuncher


class FakeTransport:
    peer_id = "6MkSelf"

    def add_unary_handler(self, method: str, handler: Any) -> None:
        self.handler = handler


@pytest.mark.parametrize("ip", ["127.0.0.1", "::1", "::ffff:127.0.0.1", "0.0.0.0", "224.0.0.1",
                                "255.255.255.255", "ff02::1", "169.254.1.1", "fe80::1", "not-an-ip"])
def test_punches_toward_local_or_group_addresses_are_refused(ip: str) -> None:
    with pytest.raises(PunchRefused):
        punch_path._remote({"ip": ip, "port": 4100})


@pytest.mark.parametrize("ip", ["203.0.113.7", "10.240.12.5", "192.168.1.20", "2001:db8::5"])
def test_public_and_private_addresses_are_punched(ip: str) -> None:
    assert punch_path._remote({"ip": ip, "port": 4100}) == (ip, 4100)


async def test_punches_per_peer_and_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = asyncio.Event()

    async def public(self: TcpPuncher) -> tuple[str, int]:
        return ("203.0.113.1", 4100)

    async def answer(self: TcpPuncher, peer_id: str, port: int, theirs: tuple[str, int]) -> None:
        await release.wait()  # a punch under way

    monkeypatch.setattr(TcpPuncher, "_public", public)
    monkeypatch.setattr(TcpPuncher, "_answer", answer)
    monkeypatch.setattr(punch_path, "listen_port", lambda transport: 4100)
    puncher = TcpPuncher(FakeTransport(), lambda: [])  # type: ignore[arg-type]
    request = Message({"ip": "203.0.113.9", "port": 4100})

    def ctx(peer: str) -> Any:
        return SimpleNamespace(peer_id=peer, link_kind="relay")

    await puncher._on_punch(ctx("peer-a"), request)
    with pytest.raises(PunchRefused, match="busy"):  # the same peer again, while it runs
        await puncher._on_punch(ctx("peer-a"), request)
    for i in range(punch_path.MAX_PUNCHES - 1):
        await puncher._on_punch(ctx(f"peer-{i}"), request)
    with pytest.raises(PunchRefused, match="busy"):  # MAX_PUNCHES under way
        await puncher._on_punch(ctx("peer-z"), request)
    release.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    with pytest.raises(PunchRefused):  # done, but within the cool-down
        await puncher._on_punch(ctx("peer-a"), request)
    await puncher._on_punch(ctx("peer-z"), request)  # a new peer: fine again
    assert puncher.refused == 3
    await puncher.close()
