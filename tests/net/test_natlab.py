"""The NAT lab (tests/natlab.py) behaves like the internet, checked with plain sockets in its hosts.

Every probe runs inside the lab's namespaces (the probe tool of natlab.py); the root namespace is
never a party. Bounds on time are behaviour checks with generous margins, not benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from natlab import (
    TOOL,
    Host,
    NatKind,
    NatLab,
    leftovers,
    list_namespaces,
    root_network_state,
    sweep_stale,
)

ECHO = 3478


def tool(host: Host, *args: object) -> str:
    return host.exec(*TOOL, *args).stdout.strip()


def mapped(answer: str) -> tuple[str, int]:
    """"mapped 10.240.1.100:40000" -> ("10.240.1.100", 40000)."""
    kind, address = answer.split()
    assert kind == "mapped", answer
    ip, port = address.rsplit(":", 1)
    return ip, int(port)


async def test_host_behind_port_restricted_nat_reaches_the_internet_but_not_back(natlab: NatLab) -> None:
    server = natlab.add_public_host("server")
    stranger = natlab.add_public_host("stranger")
    home = natlab.add_nat("home", NatKind.PORT_RESTRICTED)
    alice = natlab.add_host_behind(home, "alice")
    assert alice.public_address == home.wan_address != alice.address
    assert server.public_address == server.address
    server.start_echo_server(ECHO)

    sent = json.loads(tool(alice, "tcp-send", server.address, ECHO, 10_000))
    assert sent["bytes"] == 10_000
    assert sent["seen"].split(":")[0] == home.wan_address  # TCP, source-NATed
    agent = await alice.start_agent()
    ip, port = mapped(await agent.ask(f"whoami {server.address} {ECHO}"))
    assert ip == home.wan_address  # UDP too

    # the stranger hears nothing back from the router: no answer, no RST, no ICMP...
    assert tool(stranger, "udp-probe", home.wan_address, 40000, 0.5) == "timeout"
    assert tool(stranger, "tcp-probe", home.wan_address, 40000, 0.5) == "timeout"
    # ...where a public host's closed port refuses at once (so the probes can tell)
    assert tool(stranger, "udp-probe", server.address, 40000, 0.5) == "refused"
    assert tool(stranger, "tcp-probe", server.address, 40000, 0.5) == "refused"
    # and alice's mapping only lets in what comes from where she sent to
    other = await stranger.start_agent()
    assert await other.ask(f"send {ip} {port} hello") == "sent"
    assert await agent.ask("recv 0.5") == "timeout"


async def test_udp_hole_punching_through_two_port_restricted_nats(natlab: NatLab) -> None:
    stun1, stun2 = natlab.add_public_host("stun1"), natlab.add_public_host("stun2")
    for stun in (stun1, stun2):
        stun.start_echo_server(ECHO)
    a = natlab.add_host_behind(natlab.add_nat("nata", NatKind.PORT_RESTRICTED), "a")
    b = natlab.add_host_behind(natlab.add_nat("natb", NatKind.PORT_RESTRICTED), "b")
    agent_a, agent_b = await a.start_agent(), await b.start_agent()

    seen_a = [mapped(await agent_a.ask(f"whoami {s.address} {ECHO}")) for s in (stun1, stun2)]
    seen_b = [mapped(await agent_b.ask(f"whoami {s.address} {ECHO}")) for s in (stun1, stun2)]
    assert seen_a[0] == seen_a[1]  # endpoint-independent mapping: one port for every destination
    assert seen_b[0] == seen_b[1]
    assert seen_a[0][0] == a.public_address and seen_b[0][0] == b.public_address

    (ip_a, port_a), (ip_b, port_b) = seen_a[0], seen_b[0]
    results = await asyncio.gather(agent_a.ask(f"punch {ip_b} {port_b} 5"),
                                   agent_b.ask(f"punch {ip_a} {port_a} 5"))
    assert results == ["punched", "punched"]


async def test_symmetric_nat_maps_each_destination_apart_and_punching_fails(natlab: NatLab) -> None:
    stun1, stun2 = natlab.add_public_host("stun1"), natlab.add_public_host("stun2")
    for stun in (stun1, stun2):
        stun.start_echo_server(ECHO)
    a = natlab.add_host_behind(natlab.add_nat("nata", NatKind.SYMMETRIC), "a")
    b = natlab.add_host_behind(natlab.add_nat("natb", NatKind.SYMMETRIC), "b")
    agent_a, agent_b = await a.start_agent(), await b.start_agent()

    seen_a = [mapped(await agent_a.ask(f"whoami {s.address} {ECHO}")) for s in (stun1, stun2)]
    seen_b = [mapped(await agent_b.ask(f"whoami {s.address} {ECHO}")) for s in (stun1, stun2)]
    assert seen_a[0][0] == seen_a[1][0] == a.public_address
    assert seen_a[0][1] != seen_a[1][1]  # a new (random) port per destination
    assert seen_b[0][1] != seen_b[1][1]

    (ip_a, port_a), (ip_b, port_b) = seen_a[0], seen_b[0]
    results = await asyncio.gather(agent_a.ask(f"punch {ip_b} {port_b} 1.5"),
                                   agent_b.ask(f"punch {ip_a} {port_a} 1.5"))
    assert results == ["timeout", "timeout"]


async def test_full_cone_nat_lets_anyone_reach_a_mapped_port(natlab: NatLab) -> None:
    stun, stranger = natlab.add_public_host("stun"), natlab.add_public_host("stranger")
    stun.start_echo_server(ECHO)
    cone = natlab.add_nat("cone", NatKind.FULL_CONE)
    alice = natlab.add_host_behind(cone, "alice")
    agent, other = await alice.start_agent(), await stranger.start_agent()
    ip, port = mapped(await agent.ask(f"whoami {stun.address} {ECHO}"))
    assert ip == cone.wan_address

    assert await other.ask(f"send {ip} {port} hello") == "sent"  # never sent to by alice
    assert await agent.ask("recv 2") == f"got {stranger.address}:{other.port} hello"
    assert await agent.ask(f"send {stranger.address} {other.port} hi") == "sent"
    assert await other.ask("recv 2") == f"got {ip}:{port} hi"  # the same mapping out
    # a port that nothing behind the router mapped stays closed
    assert tool(stranger, "udp-probe", ip, port + 1 if port < 65535 else port - 1, 0.5) == "timeout"


async def test_shaping_limits_tcp_transfers_to_the_configured_rate(natlab: NatLab) -> None:
    server = natlab.add_public_host("server")
    server.start_echo_server(ECHO)
    dsl = natlab.add_nat("dsl", NatKind.PORT_RESTRICTED, upload_mbit=50, download_mbit=50)
    alice = natlab.add_host_behind(dsl, "alice")
    for direction in ("tcp-send", "tcp-fetch"):
        result = json.loads(tool(alice, direction, server.address, ECHO, 3_000_000))
        assert result["bytes"] == 3_000_000
        mbit = result["bytes"] * 8 / result["seconds"] / 1e6
        assert 40 <= mbit <= 55, (direction, mbit, result)


async def test_delay_stage_adds_the_delay_once_each_way(natlab: NatLab) -> None:
    server = natlab.add_public_host("server")
    server.start_echo_server(ECHO)
    near = natlab.add_host_behind(natlab.add_nat("fast", NatKind.PORT_RESTRICTED), "near")
    far = natlab.add_host_behind(natlab.add_nat("slow", NatKind.PORT_RESTRICTED, delay_ms=20), "far")
    near_rtt = json.loads(await (await near.start_agent()).ask(f"rtt {server.address} {ECHO} 10"))
    far_rtt = json.loads(await (await far.start_agent()).ask(f"rtt {server.address} {ECHO} 10"))
    assert near_rtt["received"] == far_rtt["received"] == 10
    assert near_rtt["median_ms"] < 10
    # 20 ms out + 20 ms back: the stage never releases a packet early
    assert far_rtt["min_ms"] >= 38 and far_rtt["median_ms"] < 100, far_rtt


async def test_loss_stage_drops_packets_in_each_direction(natlab: NatLab) -> None:
    server = natlab.add_public_host("server")
    server.start_echo_server(ECHO)
    alice = natlab.add_host_behind(natlab.add_nat("lossy", NatKind.PORT_RESTRICTED, loss=0.2), "alice")
    result = json.loads(await (await alice.start_agent()).ask(f"burst {server.address} {ECHO} 200"))
    # both ways through the stage: 0.8 * 0.8 = 64 % expected; bounds are > 4 standard deviations
    assert 0.45 <= result["received"] / result["sent"] <= 0.82, result


async def test_close_removes_everything_even_when_the_test_body_raised(natlab: NatLab) -> None:
    before = root_network_state()
    lab = NatLab()
    processes: list[subprocess.Popen] = []
    try:
        async with lab:
            assert lab.prefix != natlab.prefix and lab.prefix.startswith("dl")
            server = lab.add_public_host("server")
            router = lab.add_nat("home", NatKind.SYMMETRIC, upload_mbit=10, delay_ms=1)
            alice = lab.add_host_behind(router, "alice")
            processes.append(alice.run("sleep", "600"))
            await server.spawn("sleep", "600")
            assert len(lab.namespaces()) == 4
            raise RuntimeError("the test body failed")
    except RuntimeError as error:
        assert str(error) == "the test body failed"
    assert lab.namespaces() == [] and leftovers(lab.prefix) == []
    assert all(process.poll() is not None for process in processes)
    assert root_network_state() == before  # no address, route, rule or link of the root changed
    assert natlab.namespaces()  # another lab is left alone


async def test_sweep_removes_leftovers_of_a_dead_owner_only(natlab: NatLab) -> None:
    natlab.add_public_host("server")
    crashed = NatLab()
    try:
        sleeper = crashed.add_public_host("host").run("sleep", "600")
        dead = await asyncio.create_subprocess_exec("true")
        await dead.wait()
        crashed_owner = Path(f"/run/natlab/{crashed.prefix.rstrip('-')}.owner")
        assert crashed_owner.exists()
        crashed_owner.write_text(f"{dead.pid} 0\n")  # as if its creator had died
        assert crashed.prefix in sweep_stale()
        assert sleeper.wait(timeout=5) == -9
        assert not any(name.startswith(crashed.prefix) for name in list_namespaces())
        assert not crashed_owner.exists()
        assert natlab.namespaces()  # a live owner's lab stays
        assert natlab.prefix not in sweep_stale()
    finally:
        crashed.close()
