"""`path.punch` makes the daemon query STUN servers and send SYNs and TLS hellos to the address it
is given. Asked by a stranger over a relayed link: never toward loopback, unspecified, multicast
or broadcast addresses; one punch per peer at a time and per PUNCH_COOLDOWN; a few at once; and
toward one address only PER_TARGET times per PUNCH_COOLDOWN, however many ids ask."""

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

    def toward(i: int) -> Message:  # (one address each: the bound per address is tested below)
        return Message({"ip": f"203.0.113.{10 + i}", "port": 4100})

    await puncher._on_punch(ctx("peer-a"), request)
    with pytest.raises(PunchRefused, match="busy"):  # the same peer again, while it runs
        await puncher._on_punch(ctx("peer-a"), toward(99))
    for i in range(punch_path.MAX_PUNCHES - 1):
        await puncher._on_punch(ctx(f"peer-{i}"), toward(i))
    with pytest.raises(PunchRefused, match="busy"):  # MAX_PUNCHES under way
        await puncher._on_punch(ctx("peer-z"), toward(50))
    release.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    with pytest.raises(PunchRefused):  # done, but within the cool-down
        await puncher._on_punch(ctx("peer-a"), toward(98))
    await puncher._on_punch(ctx("peer-z"), toward(50))  # a new peer: fine again
    assert puncher.refused == 3 and puncher.refused_target == 0
    await puncher.close()


async def test_punches_toward_one_address_are_bounded_whoever_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def public(self: TcpPuncher) -> tuple[str, int]:
        return ("203.0.113.1", 4100)

    async def answer(self: TcpPuncher, peer_id: str, port: int, theirs: tuple[str, int]) -> None:
        return None

    now = [1000.0]
    monkeypatch.setattr(TcpPuncher, "_public", public)
    monkeypatch.setattr(TcpPuncher, "_answer", answer)
    monkeypatch.setattr(punch_path, "listen_port", lambda transport: 4100)
    puncher = TcpPuncher(FakeTransport(), lambda: [], clock=lambda: now[0])  # type: ignore[arg-type]

    def ctx(peer: str) -> Any:
        return SimpleNamespace(peer_id=peer, link_kind="relay")

    victim = [Message({"ip": "198.51.100.7", "port": port}) for port in (22, 80, 443)]
    for i in range(punch_path.PER_TARGET):  # fresh ids, other ports: one address all the same
        await puncher._on_punch(ctx(f"made-up-{i}"), victim[i])
    for spelling in (victim[2], Message({"ip": "::ffff:198.51.100.7", "port": 22})):
        with pytest.raises(PunchRefused, match="times in the last"):
            await puncher._on_punch(ctx("made-up-x"), spelling)
    await puncher._on_punch(ctx("made-up-x"), Message({"ip": "198.51.100.8", "port": 22}))
    now[0] += punch_path.PUNCH_COOLDOWN
    await puncher._on_punch(ctx("made-up-y"), victim[2])  # the window has passed
    assert puncher.refused == puncher.refused_target == 2
    await puncher.close()
