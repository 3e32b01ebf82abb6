"""The NAT-lab paths of benchmarks/transport.py (relay, webrtc, holepunch) and what all kinds share.

Topology (tests/natlab.py, one fresh lab per kind): a public host `pub` runs a relay (TlsTransport +
RelayService) and a STUN responder (StunResponder); the receiver sits behind a PORT_RESTRICTED NAT
`natr`, the sender behind another one, `nats` (--nat-kind: another kind for both). Both routers get
`--shape-mbit` (upload and download, tc tbf) and `--delay-ms` (one way, per router): a round trip
between the two NATed hosts crosses each router twice, so RTT = 4 x delay_ms (10 ms -> 40 ms),
relayed or not.

Each side is its own process in its own namespace (`transport.py --role relay|receiver|sender
--params JSON`), reporting on stdout lines that start with "@bench " (logs go to stderr, kept in a
temporary file whose tail is shown when a role fails).

- relay: the receiver reserves a slot on the relay (RelayClient.reserve); the sender, already linked
  to the relay (as a daemon is to its relays), dials the receiver's circuit address.
  `connect_seconds`: that dial (relay.connect stream + TLS + hellos inside it).
- webrtc: over that relayed link the sender opens a `bench.webrtc` stream and both run
  `webrtc_connect` with a StreamSignaller over it (as upgrade.py's PathUpgrader does), ICE servers:
  the relay host's STUN responder only. `connect_seconds`: signalling + ICE + DTLS + SCTP + hellos
  until the link is adopted; the relayed link that carried the signalling took
  `relayed_connect_seconds` before that.
- holepunch: both sides learn their public IP from the STUN responder at start (like a daemon does
  once, not per connection), swap `public_tcp_guess`es over a `bench.punch` stream on the relayed
  link and run holepunch.punch from their listen port at once; `connect_seconds` as for webrtc.

The stream then runs over the path's link only (the sender checks `link_kind` before it starts and
the receiver reports the kind of the link the stream came in on). Also reported, to find the
bottleneck: the relay's CPU over the transfer (`cpu_percent_relay`), the routers' delay stages' CPU
(`cpu_percent_delay_stages`, user-space Python, over the sender's whole run), where packets were
dropped (`drops`: the routers' tbf/TUN queues, the hosts' UDP receive-buffer overflows and TCP
retransmissions), for webrtc what the sender's SCTP did (`sctp_sender`), the p50/p99 of small echo
calls (`call_p50_ms`, about the RTT) and, when shaped, `link_fraction` (payload bits / shaped rate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import structlog

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    LinkStream,
    Message,
    PeerAddress,
    RequestContext,
    TlsTransport,
    TransportError,
)

MiB = 1024 * 1024
LAB_KINDS = ("relay", "webrtc", "holepunch")
PORT = 4100  # every daemon's TCP listen port (behind the NATs too: port-preserving mappings)
STUN_PORT = 3478
UPGRADE_SECONDS = 15.0  # the deadline of a webrtc or holepunch upgrade
MARK = "@bench "
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
BENCH_FILE = Path(__file__).resolve().with_name("transport.py")
TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


# --- shared by all kinds ------------------------------------------------------------------------
def quiet() -> None:
    """Warnings and worse only, on stderr (stdout carries the JSON)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def add_bench_handlers(transport: TlsTransport, chunk: int, done: asyncio.Event) -> None:
    """The receiver's side: `sink` (a stream, received in place, answered with bytes, CPU% and the
    link kind it came over), `echo` and `stop`."""

    async def echo(ctx: RequestContext, message: Message) -> Message:
        return Message({}, message.payload)

    async def sink(ctx: RequestContext, stream: LinkStream) -> None:
        buffer = bytearray(chunk)
        received = 0
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        while (message := await stream.receive_into(buffer, timeout=120)) is not None:
            received += len(message.payload)
        cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
        await stream.send(Message({"bytes": received, "cpu_percent": 100 * cpu / wall,
                                   "link_kind": ctx.link_kind}), timeout=60)

    async def stop(ctx: RequestContext, message: Message) -> Message:
        done.set()
        return Message()

    transport.add_unary_handler("echo", echo)
    transport.add_unary_handler("stop", stop)
    transport.add_stream_handler("sink", sink)


async def send_stream(transport: TlsTransport, peer: str, mib: int, chunk: int) -> dict[str, Any]:
    """One stream of `mib` MiB in `chunk`-byte messages to the peer's `sink`; the figures."""
    payload = memoryview(bytearray(os.urandom(1024)) * (chunk // 1024))
    total = mib * MiB
    stream = await transport.open_stream(peer, "sink", {}, timeout=10)
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    sent = 0
    while sent < total:
        piece = payload[: min(chunk, total - sent)]
        await stream.send(Message({}, piece), timeout=120)
        sent += len(piece)
    await stream.close()
    summary = await stream.receive(timeout=120)
    wall = time.perf_counter() - wall0
    cpu = cpu_seconds() - cpu0
    if summary is None or summary.header.get("bytes") != total:
        raise RuntimeError(f"the receiver got {summary and summary.header.get('bytes')} of {total} bytes")
    return {
        "mib": mib,
        "chunk_mib": chunk / MiB,
        "seconds": round(wall, 4),
        "MBps": round(total / wall / 1e6, 2),
        "MiBps": round(total / wall / MiB, 2),
        "cpu_percent_sender": round(100 * cpu / wall, 1),
        "cpu_percent_receiver": round(float(summary.header["cpu_percent"]), 1),
        "receiver_link_kind": summary.header.get("link_kind"),
    }


async def call_latencies(transport: TlsTransport, peer: str, calls: int, warmup: int) -> list[float]:
    """Microseconds of `calls` 100-byte echo calls (after `warmup` ones), sorted."""
    small = b"x" * 100
    for _ in range(warmup):
        await transport.call(peer, "echo", Message({}, small), timeout=10)
    latencies = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        await transport.call(peer, "echo", Message({}, small), timeout=10)
        latencies.append((time.perf_counter_ns() - t0) / 1000)
    latencies.sort()
    return latencies


def p99(latencies: list[float]) -> float:
    return latencies[max(0, int(len(latencies) * 0.99) - 1)]


# --- the roles (each in its own process and namespace) -----------------------------------------
def _emit(obj: dict[str, Any]) -> None:
    print(MARK + orjson.dumps(obj).decode(), flush=True)


async def _stdin_eof() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass


def _listen(host: str) -> list[PeerAddress]:
    return [PeerAddress.parse(f"/ip4/{host}/tcp/{PORT}")]


async def _relay_role(p: dict[str, Any]) -> None:
    from dedloc.daemon.net.relay import RelayLimits, RelayService
    from dedloc.daemon.net.stun import StunResponder

    transport = await TlsTransport.start(Identity.generate(), _listen(p["host"]))
    limits = RelayLimits() if p["default_limits"] else RelayLimits(
        bytes_per_second_per_peer=1e12, burst_bytes=1 << 40)
    relay = RelayService(transport, limits)
    stun = await StunResponder.start(p["host"], STUN_PORT)

    async def cpu(ctx: RequestContext, message: Message) -> Message:
        return Message({"cpu": cpu_seconds(), "wall": time.perf_counter()})

    transport.add_unary_handler("bench.cpu", cpu)
    try:
        _emit({"address": str(transport.listen_addresses()[0]), "stun": f"stun:{p['host']}:{STUN_PORT}",
               "bytes_per_second_per_peer": limits.bytes_per_second_per_peer,
               "burst_bytes": limits.burst_bytes})
        await _stdin_eof()
        _emit({"relay_counters": relay.counters, "stun_counters": stun.counters()})
    finally:
        stun.close()
        await transport.close()


async def _public_guess(p: dict[str, Any]) -> tuple[str, int] | None:
    """Our public TCP address as holepunch guesses it (STUN for the IP, our listen port)."""
    from dedloc.daemon.net.holepunch import public_tcp_guess, stun_public_ip

    mapped = await stun_public_ip((p["stun_host"], STUN_PORT), 5.0, local_port=PORT)
    return None if mapped is None else public_tcp_guess(mapped[0], PORT)


def _adopt_punched(transport: TlsTransport, punched: Any, outbound: bool) -> None:
    if hasattr(punched, "adopt"):
        punched.adopt(transport)
    else:  # a plain Handshaken
        transport.adopt(punched, outbound=outbound, address=None)


async def _receiver_role(p: dict[str, Any]) -> None:
    from dedloc.daemon.net.relay import RelayClient

    transport = await TlsTransport.start(Identity.generate(), _listen(p["host"]))
    client = RelayClient(transport)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    if p["kind"] == "webrtc" and p.get("udp_rcvbuf"):
        _udp_rcvbuf(p["udp_rcvbuf"])
    add_bench_handlers(transport, p["chunk"], done)
    guess = await _public_guess(p) if p["kind"] == "holepunch" else None

    async def on_webrtc(ctx: RequestContext, stream: LinkStream) -> None:
        from dedloc.daemon.net.upgrade import StreamSignaller
        from dedloc.daemon.net.webrtc import webrtc_connect

        try:
            hand = await webrtc_connect(StreamSignaller(stream), transport.identity, offerer=False,
                                        ice_servers=[p["stun"]], deadline=loop.time() + UPGRADE_SECONDS,
                                        addresses=transport.listen_addresses(),
                                        expected_peer_id=ctx.peer_id)
        except (TransportError, TimeoutError) as exc:
            print(f"webrtc answer failed: {exc!r}", file=sys.stderr, flush=True)
            return
        transport.adopt(hand, outbound=False, address=f"webrtc:{ctx.peer_id}")

    async def on_punch(ctx: RequestContext, stream: LinkStream) -> None:
        from dedloc.daemon.net.holepunch import AlreadyLinked, punch, tls_role

        first = await stream.receive(timeout=10)
        assert first is not None
        deadline = loop.time() + float(first.header["seconds"])
        if guess is None:
            await stream.send(Message({"error": "the receiver got no STUN answer"}), timeout=10)
            return
        await stream.send(Message({"ip": guess[0], "port": guess[1]}), timeout=10)
        server = tls_role(transport.peer_id, ctx.peer_id)
        try:
            remote = (str(first.header["ip"]), int(first.header["port"]))
            punched = await punch(transport, local_port=PORT, remote=remote, tls_server=server,
                                  expected_peer_id=ctx.peer_id, deadline=deadline)
            _adopt_punched(transport, punched, not server)
            outcome: dict[str, Any] = {"ok": transport.link_kind(ctx.peer_id)}
        except AlreadyLinked as exc:
            outcome = {"ok": exc.kind}
        except (TransportError, TimeoutError) as exc:
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        with contextlib.suppress(TransportError):
            await stream.send(Message(outcome), timeout=10)

    transport.add_stream_handler("bench.webrtc", on_webrtc)
    transport.add_stream_handler("bench.punch", on_punch)
    try:
        relay = PeerAddress.parse(p["relay"])
        await client.reserve(relay)
        assert relay.peer_id is not None
        _emit({"circuit": str(relay.via(transport.peer_id)), "peer_id": transport.peer_id,
               "public_guess": guess})
        stopped = asyncio.create_task(done.wait())
        eof = asyncio.create_task(_stdin_eof())
        await asyncio.wait([stopped, eof], timeout=3600, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        eof.cancel()
        await asyncio.sleep(0.1)  # let the reply to "stop" go out
    finally:
        await client.close()
        await transport.close()


def _sctp_counters() -> dict[str, Any]:
    """Count what aiortc's SCTP does in this process (the sender's congestion control): T3
    (retransmission timeout) expiries, fast recoveries, retransmitted DATA chunks, and of the
    SACKs received how many found the window full (cwnd-limited) or nothing queued to send
    (the application, i.e. our CPU, is the limit); the last cwnd, ssthresh, RTO and SRTT."""
    from aiortc.rtcsctptransport import DataChunk, RTCSctpTransport

    counts: dict[str, Any] = {"data_chunks": 0, "retransmitted_chunks": 0, "fast_recoveries": 0,
                              "t3_expirations": 0, "sacks": 0, "sacks_cwnd_limited": 0,
                              "sacks_nothing_queued": 0}
    t3_expired, send_chunk, receive_sack = (RTCSctpTransport._t3_expired, RTCSctpTransport._send_chunk,
                                            RTCSctpTransport._receive_sack_chunk)

    def counted_t3(self: Any) -> None:
        counts["t3_expirations"] += 1
        t3_expired(self)

    async def counted_send(self: Any, chunk: Any) -> None:
        if isinstance(chunk, DataChunk):
            counts["data_chunks"] += 1
            counts["retransmitted_chunks"] += chunk._sent_count > 1
        await send_chunk(self, chunk)

    async def counted_sack(self: Any, chunk: Any) -> None:
        before = self._fast_recovery_exit
        counts["sacks"] += 1
        counts["sacks_cwnd_limited"] += self._flight_size + 1200 >= self._cwnd
        counts["sacks_nothing_queued"] += not self._outbound_queue
        await receive_sack(self, chunk)
        if before is None and self._fast_recovery_exit is not None:
            counts["fast_recoveries"] += 1
        counts.update({"cwnd": self._cwnd, "ssthresh": self._ssthresh, "rto": self._rto,
                       "srtt_ms": round(1000 * (self._srtt or 0.0), 1)})

    RTCSctpTransport._t3_expired = counted_t3  # type: ignore[method-assign]
    RTCSctpTransport._send_chunk = counted_send  # type: ignore[method-assign]
    RTCSctpTransport._receive_sack_chunk = counted_sack  # type: ignore[method-assign]
    return counts


def _udp_rcvbuf(size: int) -> None:
    """An experiment (--udp-rcvbuf-kib): ICE's UDP sockets get SO_RCVBUF `size` bytes instead of
    aioice's 256 KiB (aioice.turn.UDP_SOCKET_BUFFER_SIZE, set on every host candidate's socket;
    the kernel caps it at net.core.rmem_max and doubles it)."""
    from aioice import turn

    turn.UDP_SOCKET_BUFFER_SIZE = size


async def _sender_role(p: dict[str, Any]) -> None:
    from dedloc.daemon.net.relay import RelayClient

    kind = p["kind"]
    sctp = _sctp_counters() if kind == "webrtc" else None
    if kind == "webrtc" and p.get("udp_rcvbuf"):
        _udp_rcvbuf(p["udp_rcvbuf"])
    transport = await TlsTransport.start(Identity.generate(), _listen(p["host"]))
    client = RelayClient(transport)
    loop = asyncio.get_running_loop()
    result: dict[str, Any] = {"kind": kind}
    try:
        guess = await _public_guess(p) if kind == "holepunch" else None
        relay = PeerAddress.parse(p["relay"])
        assert relay.peer_id is not None
        await transport.connect(relay, timeout=10)  # a daemon is linked to its relays already
        circuit = PeerAddress.parse(p["circuit"])
        t0 = time.perf_counter()
        peer = await transport.connect(circuit, timeout=20)
        relayed_s = time.perf_counter() - t0
        if kind == "relay":
            result["connect_seconds"] = round(relayed_s, 4)
        else:
            result["relayed_connect_seconds"] = round(relayed_s, 4)
            t0 = time.perf_counter()
            if kind == "webrtc":
                await _webrtc_offer(transport, peer, p["stun"], loop)
            else:
                if guess is None:
                    raise RuntimeError("unavailable: the sender got no STUN answer")
                result["punch"] = await _punch_offer(transport, peer, guess, loop)
            result["connect_seconds"] = round(time.perf_counter() - t0, 4)
        link_kind = transport.link_kind(peer)
        if link_kind != kind:
            raise RuntimeError(f"the link to the receiver is {link_kind}, not {kind}")
        result["link_kind"] = link_kind
        before = await transport.call(relay.peer_id, "bench.cpu", Message({}), timeout=10)
        result |= await send_stream(transport, peer, p["mib"], p["chunk"])
        after = await transport.call(relay.peer_id, "bench.cpu", Message({}), timeout=10)
        result["cpu_percent_relay"] = round(100 * (after.header["cpu"] - before.header["cpu"])
                                            / (after.header["wall"] - before.header["wall"]), 1)
        latencies = await call_latencies(transport, peer, p["calls"], warmup=5)
        result |= {"call_p50_ms": round(statistics.median(latencies) / 1000, 2),
                   "call_p99_ms": round(p99(latencies) / 1000, 2), "calls": p["calls"]}
        if transport.link_kind(peer) != kind:
            raise RuntimeError(f"the link changed to {transport.link_kind(peer)} during the run")
        if sctp is not None:
            result["sctp_sender"] = sctp
        with contextlib.suppress(TransportError):
            await transport.call(peer, "stop", Message(), timeout=10)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _emit(result)
        await client.close()
        await transport.close()


async def _webrtc_offer(transport: TlsTransport, peer: str, stun: str,
                        loop: asyncio.AbstractEventLoop) -> None:
    from dedloc.daemon.net.upgrade import StreamSignaller
    from dedloc.daemon.net.webrtc import webrtc_connect

    stream = await transport.open_stream(peer, "bench.webrtc", {}, timeout=10)
    try:
        hand = await webrtc_connect(StreamSignaller(stream), transport.identity, offerer=True,
                                    ice_servers=[stun], deadline=loop.time() + UPGRADE_SECONDS,
                                    addresses=transport.listen_addresses(), expected_peer_id=peer)
    finally:
        with contextlib.suppress(TransportError):
            await stream.close()
    transport.adopt(hand, outbound=True, address=f"webrtc:{peer}")


async def _punch_offer(transport: TlsTransport, peer: str, guess: tuple[str, int],
                       loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """Swap public guesses over the relayed link, punch at once on both sides; raises with both
    sides' reasons when it fails."""
    from dedloc.daemon.net.holepunch import AlreadyLinked, punch, tls_role

    stream = await transport.open_stream(peer, "bench.punch", {}, timeout=10)
    try:
        await stream.send(Message({"ip": guess[0], "port": guess[1], "seconds": UPGRADE_SECONDS}),
                          timeout=10)
        reply = await stream.receive(timeout=10)
        if reply is None or "error" in reply.header:
            raise RuntimeError(f"unavailable: {reply and reply.header.get('error')}")
        remote = (str(reply.header["ip"]), int(reply.header["port"]))
        server = tls_role(transport.peer_id, peer)
        ours: str | None = None
        try:
            punched = await punch(transport, local_port=PORT, remote=remote, tls_server=server,
                                  expected_peer_id=peer, deadline=loop.time() + UPGRADE_SECONDS)
            _adopt_punched(transport, punched, not server)
        except AlreadyLinked as exc:
            ours = f"already linked ({exc.kind})"
        except (TransportError, TimeoutError) as exc:
            ours = f"{type(exc).__name__}: {exc}"
        theirs: dict[str, Any] = {}
        with contextlib.suppress(TransportError, TimeoutError):
            outcome = await stream.receive(timeout=UPGRADE_SECONDS + 5)
            theirs = dict(outcome.header) if outcome is not None else {}
        if ours is not None:
            raise RuntimeError(f"hole punch failed: sender: {ours}; receiver: {theirs}")
        return {"remote": list(remote), "tls_server": server, "local": list(guess),
                "receiver": theirs}
    finally:
        with contextlib.suppress(TransportError):
            await stream.close()


def role_main(role: str, params: str) -> None:
    quiet()
    p = orjson.loads(params)
    main = {"relay": _relay_role, "receiver": _receiver_role, "sender": _sender_role}[role]
    asyncio.run(main(p))


# --- the orchestrator (root namespace) ----------------------------------------------------------
class _Role:
    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    async def report(self, timeout: float) -> dict[str, Any]:
        """The role's next "@bench" line."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = (await self.process.stdout.readline()).decode()
                if not line:
                    await self.process.wait()
                    raise RuntimeError(f"the {self.name} exited ({self.process.returncode}) "
                                       f"without a report: {self.tail()}")
                if line.startswith(MARK):
                    return dict(orjson.loads(line[len(MARK):]))

    def tail(self, size: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-size:].strip()
        except OSError:
            return ""


async def _start_role(host: Any, role: str, params: dict[str, Any], logs: Path) -> _Role:
    log = logs / f"{role}.log"
    with log.open("wb") as err:
        process = await host.spawn(sys.executable, BENCH_FILE, "--role", role, "--params",
                                   orjson.dumps(params).decode(), stdin=asyncio.subprocess.PIPE,
                                   stdout=asyncio.subprocess.PIPE, stderr=err)
    return _Role(role, process, log)


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _lab_drops(lab: Any, hosts: dict[str, Any]) -> dict[str, Any]:
    """Where packets were lost: the routers' qdisc drops (tbf: the shaping, a congestion signal;
    dly: the delay stage's TUN queue) and the hosts' UDP receive-buffer overflows and TCP
    retransmissions (the counters of the whole run, connecting included)."""
    out: dict[str, Any] = {}
    for name, router in lab.routers.items():
        done = subprocess.run([shutil.which("tc", path=SBIN_PATH) or "tc", "-n", router.namespace, "-s", "-j",
                               "qdisc", "show"], capture_output=True, text=True, timeout=10)
        with contextlib.suppress(ValueError):
            out[name] = {f"{q['dev']}_{q['kind']}_drops": q.get("drops", 0)
                         for q in orjson.loads(done.stdout or "[]")
                         if q.get("dev") in ("wan", "lan", "dly") and q.get("kind") != "noqueue"}
    for name, host in hosts.items():
        lines = host.exec("cat", "/proc/net/snmp", timeout=10).stdout.splitlines()
        table = {}
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            proto = head.split(":")[0]
            table[proto] = dict(zip(head.split()[1:], map(int, values.split()[1:]), strict=False))
        out[name] = {"udp_rcvbuf_errors": table.get("Udp", {}).get("RcvbufErrors"),
                     "udp_in_datagrams": table.get("Udp", {}).get("InDatagrams"),
                     "tcp_retrans_segs": table.get("Tcp", {}).get("RetransSegs")}
    return out


def _holepunch_missing() -> str | None:
    try:
        from dedloc.daemon.net import holepunch
    except Exception as exc:
        return f"daemon/net/holepunch.py cannot be imported: {exc!r}"
    missing = [name for name in ("punch", "tls_role", "public_tcp_guess", "stun_public_ip", "AlreadyLinked")
               if not hasattr(holepunch, name)]
    return f"daemon/net/holepunch.py lacks {', '.join(missing)}" if missing else None


async def run_lab_kind(kind: str, *, mib: int, chunk: int, calls: int, shape_mbit: float | None,
                       delay_ms: float, relay_default_limits: bool, nat_kind: str = "port-restricted",
                       udp_rcvbuf: int | None = None) -> dict[str, Any]:
    """One stream between two NATed daemons over `kind`, in a fresh lab; the figures, or
    {"available": False, "reason": ...}."""
    if kind == "holepunch" and (reason := _holepunch_missing()):
        return {"kind": kind, "available": False, "reason": reason}
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    from natlab import NatKind, NatLab

    setup: dict[str, Any] = {"kind": kind, "path": f"natlab: two {nat_kind} NATs",
                             "shape_mbit": shape_mbit, "delay_ms_per_router": delay_ms,
                             "expected_rtt_ms": 4 * delay_ms}
    if kind == "relay":
        setup["relay_limits"] = "default" if relay_default_limits else "generous"
    if kind == "webrtc" and udp_rcvbuf:
        setup["udp_rcvbuf_bytes"] = udp_rcvbuf
    roles: list[_Role] = []
    with tempfile.TemporaryDirectory(prefix="dl-bench-") as tmp:
        try:
            lab = await asyncio.to_thread(NatLab)
        except Exception as exc:  # not root, no `ip netns`, ...
            return {**setup, "available": False, "reason": f"no NAT lab: {exc}"}
        try:
            logs = Path(tmp)
            pub = lab.add_public_host("pub")
            routers = [lab.add_nat(name, NatKind(nat_kind), upload_mbit=shape_mbit,
                                   download_mbit=shape_mbit, delay_ms=delay_ms) for name in ("natr", "nats")]
            receiver_host = lab.add_host_behind(routers[0], "recv")
            sender_host = lab.add_host_behind(routers[1], "send")
            common = {"kind": kind, "chunk": chunk, "stun_host": pub.address, "udp_rcvbuf": udp_rcvbuf}
            relay = await _start_role(pub, "relay", {"host": pub.address,
                                                     "default_limits": relay_default_limits}, logs)
            roles.append(relay)
            relay_info = await relay.report(30)
            common |= {"relay": relay_info["address"], "stun": relay_info["stun"]}
            if kind == "relay":
                setup["relay_bytes_per_second_per_peer"] = relay_info["bytes_per_second_per_peer"]
            receiver = await _start_role(receiver_host, "receiver", {**common, "host": receiver_host.address},
                                         logs)
            roles.append(receiver)
            receiver_info = await receiver.report(30)
            sender = await _start_role(sender_host, "sender", {
                **common, "host": sender_host.address, "circuit": receiver_info["circuit"], "mib": mib,
                "calls": calls}, logs)
            roles.append(sender)
            stages = [process.pid for process in lab._processes]  # the routers' delay stages
            stage_cpu0, wall0 = [_process_cpu(pid) for pid in stages], time.perf_counter()
            result = await sender.report(120 + mib * 2)
            if stages:  # over the sender's whole run (connecting included), not just the transfer
                wall = time.perf_counter() - wall0
                setup["cpu_percent_delay_stages"] = [
                    round(100 * (_process_cpu(pid) - cpu0) / wall, 1)
                    for pid, cpu0 in zip(stages, stage_cpu0, strict=True)]
            with contextlib.suppress(Exception):  # diagnostics only
                setup["drops"] = await asyncio.to_thread(
                    _lab_drops, lab, {"receiver": receiver_host, "sender": sender_host})
            if relay.process.stdin is not None:
                relay.process.stdin.close()
            with contextlib.suppress(TimeoutError, RuntimeError):
                counters = await relay.report(10)
                setup["relay_bytes_relayed"] = counters["relay_counters"]["bytes_relayed"]
            if "error" in result:
                error = result.pop("error")
                tails = {role.name: role.tail(600) for role in roles if role.tail(600)}
                return {**setup, **result, "available": False, "reason": error, "stderr": tails}
            return {**setup, **result, "available": True}
        except Exception as exc:
            tails = {role.name: role.tail(600) for role in roles if role.tail(600)}
            return {**setup, "available": False, "reason": f"{type(exc).__name__}: {exc}", "stderr": tails}
        finally:
            await lab.aclose()
