"""TCP hole punching (daemon/net/holepunch.py): on 127.0.0.1 for the listener and failure cases,
then in the NAT lab through two port-restricted NATs (it works) and two symmetric ones (it fails
by the deadline, leaving nothing open).

In the lab each peer is a small python process in its host's namespace (`PEER` below), driven by
JSON lines on its stdin; both are told one wall-clock moment to start punching.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from natlab import Host, NatKind, NatLab
from net.netutil import wait_until

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    Message,
    PeerAddress,
    PeerIdMismatchError,
    PeerUnreachableError,
    RequestContext,
    TlsTransport,
    TransportError,
)
from dedloc.daemon.net.holepunch import (
    AlreadyLinked,
    listen_port,
    public_tcp_guess,
    punch,
    stun_public_ip,
    tls_role,
)
from dedloc.daemon.net.stun import StunResponder


async def echo(ctx: RequestContext, message: Message) -> Message:
    return Message({"from": ctx.peer_id, "kind": ctx.link_kind})


def open_sockets() -> set[str]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


async def started(make_transport: Any) -> TlsTransport:
    transport = await make_transport()
    transport.add_unary_handler("echo", echo)
    return transport


# --- on 127.0.0.1 -------------------------------------------------------------------------------


@pytest.mark.parametrize("tls_server", [False, True])
async def test_a_punch_that_reaches_the_peers_listener_becomes_its_inbound_tcp_link(
        make_transport: Any, tls_server: bool) -> None:
    """Only one side punches: its SYN lands on the other's listener, which handshakes as TLS
    server. The punching side ends up TLS client whatever its designated role (as server it
    hears nothing for `role_wait`, then starts TLS itself); the listener's side gets an inbound
    "tcp" link, and its own punch then says AlreadyLinked."""
    a, b = await started(make_transport), await started(make_transport)
    loop = asyncio.get_running_loop()
    port_a, port_b = listen_port(a), listen_port(b)
    assert port_a and port_b
    done = await punch(a, local_port=port_a, remote=("127.0.0.1", port_b), tls_server=tls_server,
                       expected_peer_id=b.peer_id, deadline=loop.time() + 5, role_wait=0.3)
    assert done.peer.peer_id == b.peer_id and done.io.kind == "holepunch" and done.outbound
    assert done.adopt(a).kind == "holepunch"
    reply = await a.call(b.peer_id, "echo", Message(), timeout=5)
    assert reply.header == {"from": a.peer_id, "kind": "tcp"}  # b sees an ordinary inbound link
    reply = await b.call(a.peer_id, "echo", Message(), timeout=5)
    assert reply.header == {"from": b.peer_id, "kind": "holepunch"}
    with pytest.raises(AlreadyLinked) as info:
        await punch(b, local_port=port_b, remote=("127.0.0.1", port_a), tls_server=not tls_server,
                    expected_peer_id=a.peer_id, deadline=loop.time() + 5)
    assert info.value.kind == "tcp"


async def test_two_punches_at_once_make_one_link(make_transport: Any) -> None:
    """On loopback the first SYN meets the other's listener at once (the other side's connect then
    finds the 4-tuple taken): one side returns the punched connection, the other AlreadyLinked."""
    a, b = await started(make_transport), await started(make_transport)
    loop = asyncio.get_running_loop()
    port_a, port_b = listen_port(a), listen_port(b)
    assert port_a and port_b
    results = await asyncio.gather(
        punch(a, local_port=port_a, remote=("127.0.0.1", port_b), tls_server=tls_role(a.peer_id, b.peer_id),
              expected_peer_id=b.peer_id, deadline=loop.time() + 5, role_wait=0.3),
        punch(b, local_port=port_b, remote=("127.0.0.1", port_a), tls_server=tls_role(b.peer_id, a.peer_id),
              expected_peer_id=a.peer_id, deadline=loop.time() + 5, role_wait=0.3),
        return_exceptions=True)
    punched = [(t, r) for t, r in zip((a, b), results, strict=True) if not isinstance(r, BaseException)]
    assert len(punched) == 1, results
    assert sum(isinstance(r, AlreadyLinked) for r in results) == 1, results
    punched[0][1].adopt(punched[0][0])
    for x, y in ((a, b), (b, a)):
        assert (await x.call(y.peer_id, "echo", Message(), timeout=5)).header["from"] == x.peer_id
    assert len(a.links()) == len(b.links()) == 1


async def test_the_wrong_peer_at_the_address_is_refused(make_transport: Any) -> None:
    a, b = await started(make_transport), await started(make_transport)
    loop = asyncio.get_running_loop()
    port_a, port_b = listen_port(a), listen_port(b)
    assert port_a and port_b
    sockets = open_sockets()
    with pytest.raises(PeerIdMismatchError):
        await punch(a, local_port=port_a, remote=("127.0.0.1", port_b), tls_server=False,
                    expected_peer_id=Identity.generate().peer_id, deadline=loop.time() + 5)
    await wait_until(lambda: b.counters()["handshake_failures"] == 1)  # b's end of it is closed
    assert open_sockets() <= sockets and not a.links() and not b.links()


async def test_plain_tcp_transports_cannot_punch(make_transport: Any) -> None:
    a = await make_transport(tls=False)
    with pytest.raises(TransportError, match="needs a TLS transport"):
        await punch(a, local_port=1, remote=("127.0.0.1", 2), tls_server=True,
                    expected_peer_id=Identity.generate().peer_id, deadline=0)


async def test_only_a_punch_may_share_the_listen_port(make_transport: Any) -> None:
    a = await started(make_transport)
    port_a = listen_port(a)
    assert port_a
    with pytest.raises(TransportError, match="cannot listen"):  # SO_REUSEPORT came after the bind
        await TlsTransport.start(Identity.generate(), [PeerAddress.parse(f"/ip4/127.0.0.1/tcp/{port_a}")])
    with socket.socket() as other:  # a port held without SO_REUSEPORT cannot be punched from
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(PeerUnreachableError, match="cannot bind local port"):
            await punch(a, local_port=other.getsockname()[1], remote=("127.0.0.1", port_a),
                        tls_server=False, expected_peer_id=a.peer_id,
                        deadline=asyncio.get_running_loop().time() + 5)


async def test_deadline_closes_every_socket_and_names_what_was_tried(make_transport: Any) -> None:
    a = await started(make_transport)
    loop = asyncio.get_running_loop()
    port_a = listen_port(a)
    assert port_a
    with socket.socket() as closed_port:  # refused: a RST for every attempt
        closed_port.bind(("127.0.0.1", 0))
        refusing = closed_port.getsockname()[1]
    # silent: a listener whose accept queue is full drops further SYNs (the connect hangs)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    filler = socket.create_connection(silent.getsockname())
    tasks, sockets = asyncio.all_tasks(), open_sockets()
    try:
        with pytest.raises(PeerUnreachableError, match=r"ECONNREFUSED x\d+") as info:
            await punch(a, local_port=port_a, remote=("127.0.0.1", refusing), tls_server=False,
                        expected_peer_id=Identity.generate().peer_id, deadline=loop.time() + 0.6)
        assert f"to 127.0.0.1:{refusing} failed: the deadline passed" in str(info.value)
        started_at = loop.time()
        with pytest.raises(PeerUnreachableError, match=r"1 attempt\(s\) .* our SYNs got no answer"):
            await punch(a, local_port=port_a, remote=silent.getsockname(), tls_server=False,
                        expected_peer_id=Identity.generate().peer_id, deadline=loop.time() + 0.5)
        assert loop.time() - started_at < 1.0
        # cancelled while a socket waits in SYN_SENT: closed too
        task = asyncio.create_task(punch(a, local_port=port_a, remote=silent.getsockname(),
                                         tls_server=False, expected_peer_id=Identity.generate().peer_id,
                                         deadline=loop.time() + 10))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert open_sockets() == sockets
        assert asyncio.all_tasks() == tasks
    finally:
        filler.close()
        silent.close()


async def test_stun_public_ip_asks_our_own_responder() -> None:
    responder = await StunResponder.start("127.0.0.1")
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        seen = await stun_public_ip(("127.0.0.1", responder.bound_port), 2.0, local_port=port)
        assert seen == ("127.0.0.1", port)
        # the local port taken (here by the responder itself): any port will do, the IP is the news
        seen = await stun_public_ip(("127.0.0.1", responder.bound_port), 2.0,
                                    local_port=responder.bound_port)
        assert seen is not None and seen[0] == "127.0.0.1"
    finally:
        responder.close()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        assert await stun_public_ip(silent.getsockname(), 0.4) is None
    assert public_tcp_guess("10.240.1.100", 4100) == ("10.240.1.100", 4100)


# --- in the NAT lab -----------------------------------------------------------------------------

PORT = 4100
STUN_PORT = 3478

PEER = r"""
import asyncio, json, os, sys, time
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, PeerAddress, PeerUnreachableError, TlsTransport
from dedloc.daemon.net.holepunch import AlreadyLinked, public_tcp_guess, punch, stun_public_ip

def say(**fields):
    print(json.dumps(fields), flush=True)

def fds():
    return len(os.listdir("/proc/self/fd"))

async def echo(ctx, message):
    return Message({"from": ctx.peer_id, "kind": ctx.link_kind})

async def main(port):
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    base = fds(), len(asyncio.all_tasks())
    identity = Identity.generate()
    listen = [PeerAddress.parse(f"/ip4/0.0.0.0/tcp/{port}")]
    transport = await TlsTransport.start(identity, listen)
    transport.add_unary_handler("echo", echo)
    say(ready=transport.peer_id)
    async for line in stdin:
        order = json.loads(line)
        if order["do"] == "stun":
            seen = await stun_public_ip(tuple(order["server"]), 3.0, local_port=port)
            say(guess=public_tcp_guess(seen[0], port) if seen else None, seen=seen)
        elif order["do"] == "punch":
            await asyncio.sleep(max(0.0, order["at"] - time.time()))
            before = fds(), len(asyncio.all_tasks())
            started = loop.time()
            try:
                done = await punch(transport, local_port=port, remote=tuple(order["remote"]),
                                   tls_server=order["tls_server"], expected_peer_id=order["peer"],
                                   deadline=started + order["timeout"])
            except AlreadyLinked as exc:
                say(result="already", kind=exc.kind, seconds=loop.time() - started)
            except PeerUnreachableError as exc:
                say(result="unreachable", error=str(exc), seconds=loop.time() - started,
                    before=before, after=(fds(), len(asyncio.all_tasks())))
            else:
                link = done.adopt(transport)
                say(result="punched", peer=done.peer.peer_id, kind=link.kind, outbound=done.outbound,
                    seconds=loop.time() - started)
        elif order["do"] == "call":
            reply = await transport.call(order["peer"], "echo", Message(), timeout=5)
            say(reply=reply.header)
        elif order["do"] == "restart":  # the same peer, its links gone (their 4-tuples linger)
            await transport.close()
            transport = await TlsTransport.start(identity, listen)
            transport.add_unary_handler("echo", echo)
            say(restarted=transport.peer_id)
        elif order["do"] == "close":
            await transport.close()
            say(closed=(fds(), len(asyncio.all_tasks())), base=base)
            return

asyncio.run(main(int(sys.argv[1])))
"""

STUN = r"""
import asyncio, sys
from dedloc.daemon.net.stun import StunResponder

async def main():
    await StunResponder.start("0.0.0.0", int(sys.argv[1]))
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class Peer:
    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log
        self.peer_id = ""

    @classmethod
    async def start(cls, host: Host, log: Path) -> Peer:
        with log.open("wb") as stderr:  # the child keeps its own copy
            process = await host.spawn(sys.executable, "-c", PEER, PORT, stdin=asyncio.subprocess.PIPE,
                                       stdout=asyncio.subprocess.PIPE, stderr=stderr)
        peer = cls(process, log)
        peer.peer_id = (await peer.read())["ready"]
        return peer

    async def read(self, timeout: float = 15.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise AssertionError(f"peer exited ({await self.process.wait()}):\n{self.log.read_text()}")
        return dict(json.loads(line))

    async def ask(self, timeout: float = 15.0, **order: Any) -> dict[str, Any]:
        self.send(**order)
        return await self.read(timeout)

    def send(self, **order: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(order).encode() + b"\n")


async def two_peers(natlab: NatLab, kind: NatKind, tmp_path: Path) -> tuple[Peer, Peer, list[Host]]:
    hosts = [natlab.add_host_behind(natlab.add_nat(f"nat{i}", kind, delay_ms=10), f"peer{i}")
             for i in (1, 2)]
    peers = await asyncio.gather(*(Peer.start(host, tmp_path / f"{host.name}.log") for host in hosts))
    return peers[0], peers[1], hosts


async def punch_both(a: Peer, b: Peer, guesses: tuple[list[Any], list[Any]],
                     timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    at = time.time() + 0.3
    for me, other, remote in ((a, b, guesses[1]), (b, a, guesses[0])):
        me.send(do="punch", remote=remote, peer=other.peer_id, at=at, timeout=timeout,
                tls_server=tls_role(me.peer_id, other.peer_id))
    first, second = await asyncio.gather(a.read(timeout + 10), b.read(timeout + 10))
    return first, second


async def test_punch_through_two_port_restricted_nats(natlab: NatLab, tmp_path: Path) -> None:
    stun = natlab.add_public_host("stun")
    responder = await stun.spawn(sys.executable, "-c", STUN, STUN_PORT, stdout=asyncio.subprocess.PIPE)
    assert responder.stdout is not None
    assert await asyncio.wait_for(responder.stdout.readline(), 15) == b"ready\n"
    a, b, hosts = await two_peers(natlab, NatKind.PORT_RESTRICTED, tmp_path)

    # each learns its public IP from the STUN responder; the NAT kept the port number
    answers = [await p.ask(do="stun", server=[stun.address, STUN_PORT]) for p in (a, b)]
    for answer, host in zip(answers, hosts, strict=True):
        assert answer["seen"] == [host.public_address, PORT]
    first, second = await punch_both(a, b, (answers[0]["guess"], answers[1]["guess"]), timeout=10)

    for me, other, result in ((a, b, first), (b, a, second)):
        assert result["result"] == "punched", result
        assert result["peer"] == other.peer_id and result["kind"] == "holepunch"
        assert result["seconds"] < 3.0, result  # about a round trip and the TLS handshake
        assert result["outbound"] == (not tls_role(me.peer_id, other.peer_id))
    for me, other in ((a, b), (b, a)):
        reply = await me.ask(do="call", peer=other.peer_id)
        assert reply["reply"] == {"from": me.peer_id, "kind": "holepunch"}
    for peer in (a, b):
        closed = await peer.ask(do="close")
        assert closed["closed"] == closed["base"], closed  # sockets and tasks: all gone
        assert await asyncio.wait_for(peer.process.wait(), 10) == 0


async def test_punching_through_symmetric_nats_fails_by_the_deadline(natlab: NatLab, tmp_path: Path) -> None:
    a, b, hosts = await two_peers(natlab, NatKind.SYMMETRIC, tmp_path)
    guesses = ([hosts[0].public_address, PORT], [hosts[1].public_address, PORT])
    first, second = await punch_both(a, b, guesses, timeout=3)
    for result in (first, second):
        assert result["result"] == "unreachable", result
        assert 2.9 < result["seconds"] < 4.0, result
        assert "deadline passed (1 attempt(s)" in result["error"], result  # no RST: silence
        assert result["after"] == result["before"], result  # no socket, no task left behind
    for peer in (a, b):
        closed = await peer.ask(do="close")
        assert closed["closed"] == closed["base"], closed
        assert await asyncio.wait_for(peer.process.wait(), 10) == 0


async def test_a_syn_that_meets_a_public_peers_listener_still_makes_one_link(natlab: NatLab,
                                                                            tmp_path: Path) -> None:
    """The NATed peer starts first and, designated TLS server, reaches the public peer's listener:
    it hears no ClientHello, handshakes as client; the public peer's late punch finds the inbound
    link its listener made and says AlreadyLinked."""
    public = natlab.add_public_host("pub")
    home = natlab.add_host_behind(natlab.add_nat("nat", NatKind.PORT_RESTRICTED, delay_ms=10), "home")
    p, h = await asyncio.gather(Peer.start(public, tmp_path / "pub.log"),
                                Peer.start(home, tmp_path / "home.log"))
    at = time.time() + 0.3
    h.send(do="punch", remote=[public.address, PORT], peer=p.peer_id, at=at, timeout=5, tls_server=True)
    p.send(do="punch", remote=[home.public_address, PORT], peer=h.peer_id, at=at + 0.5, timeout=5,
           tls_server=False)
    from_home, from_public = await asyncio.gather(h.read(15), p.read(15))
    assert from_home["result"] == "punched" and from_home["outbound"], from_home
    assert from_home["kind"] == "holepunch" and from_home["peer"] == p.peer_id
    assert from_public == {**from_public, "result": "already", "kind": "tcp"}
    assert (await h.ask(do="call", peer=p.peer_id))["reply"] == {"from": h.peer_id, "kind": "tcp"}
    assert (await p.ask(do="call", peer=h.peer_id))["reply"] == {"from": p.peer_id, "kind": "holepunch"}
