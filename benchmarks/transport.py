"""Transport throughput and latency of one stream between two daemons, per path kind.

--kind tcp: the receiver runs in a child process (multiprocessing, spawn), the sender in this one;
they talk over a real TlsTransport link on 127.0.0.1 (TLS 1.3 by default, plain TCP with --plain),
not through the NAT lab (so --shape-mbit/--delay-ms do not apply to it).

--kind relay|webrtc|holepunch: the two daemons sit behind two port-restricted NATs of the NAT lab
(tests/natlab.py: needs root and network namespaces), each side its own process in its namespace,
a public host running the relay and the STUN responder; --shape-mbit and --delay-ms apply to both
NAT routers (RTT = 4 x delay-ms). See transport_paths.py for how each path is set up and what
connect_seconds covers there. A holepunch that cannot run (holepunch.py missing or failing) is
reported as unavailable with the reason; --kind all runs the four side by side.

Prints one JSON object: MBps of one stream of S MiB sent in C MiB messages (received in place with
receive_into), CPU% of each process during the transfer, the time to connect, and the p50/p99
latency of a 100-byte unary call.

    python benchmarks/transport.py --kind tcp --mib 256 --json
    sudo .venv/bin/python benchmarks/transport.py --kind all --mib 16 --shape-mbit 50 --delay-ms 10 --json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import statistics
import sys
import time
from typing import Any

import orjson
from transport_paths import (
    LAB_KINDS,
    MiB,
    add_bench_handlers,
    call_latencies,
    p99,
    quiet,
    role_main,
    run_lab_kind,
    send_stream,
)

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, PeerAddress, TlsTransport

KINDS = ("tcp", *LAB_KINDS)


async def _receiver_main(conn: Any, plain: bool, chunk: int) -> None:
    transport = await TlsTransport.start(Identity.generate(), [PeerAddress.parse("/ip4/127.0.0.1/tcp/0")],
                                         tls=not plain)
    done = asyncio.Event()
    add_bench_handlers(transport, chunk, done)
    conn.send(str(transport.listen_addresses()[0]))
    try:
        async with asyncio.timeout(600):
            await done.wait()
        await asyncio.sleep(0.05)  # let the reply to "stop" go out
    finally:
        await transport.close()


def _receiver(conn: Any, plain: bool, chunk: int) -> None:
    quiet()
    asyncio.run(_receiver_main(conn, plain, chunk))


async def _sender(address: PeerAddress, mib: int, chunk: int, plain: bool, calls: int) -> dict[str, Any]:
    transport = await TlsTransport.start(Identity.generate(), [], tls=not plain)
    try:
        start = time.perf_counter()
        peer = await transport.connect(address, timeout=10)
        connect_s = time.perf_counter() - start
        figures = await send_stream(transport, peer, mib, chunk)
        latencies = await call_latencies(transport, peer, calls, warmup=100)
        await transport.call(peer, "stop", Message(), timeout=10)
        return {
            "kind": "tcp",
            "available": True,
            "path": "loopback 127.0.0.1 (no NAT lab, not shaped)",
            "tls": not plain,
            "processes": 2,
            **figures,
            "connect_seconds": round(connect_s, 5),
            "call_p50_us": round(statistics.median(latencies), 1),
            "call_p99_us": round(p99(latencies), 1),
            "calls": calls,
        }
    finally:
        await transport.close()


def _run_tcp(args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_receiver, args=(child, args.plain, chunk), daemon=True)
    process.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("the receiver process did not start")
        address = PeerAddress.parse(parent.recv())
        return asyncio.run(_sender(address, args.mib, chunk, args.plain, args.calls))
    finally:
        process.join(10)
        if process.is_alive():
            process.terminate()


async def _run_lab_kinds(kinds: list[str], args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    results = {}
    for kind in kinds:
        results[kind] = await run_lab_kind(
            kind, mib=args.mib, chunk=chunk, calls=min(args.calls, args.lab_calls),
            shape_mbit=args.shape_mbit, delay_ms=args.delay_ms,
            relay_default_limits=args.relay_default_limits, nat_kind=args.nat_kind,
            udp_rcvbuf=args.udp_rcvbuf_kib * 1024 if args.udp_rcvbuf_kib else None)
        if args.shape_mbit and results[kind].get("MBps"):
            results[kind]["link_fraction"] = round(results[kind]["MBps"] * 8 / args.shape_mbit, 3)
    return results


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=[*KINDS, "all"], default="tcp")
    parser.add_argument("--mib", type=int, default=256, help="stream size in MiB")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="message size in MiB")
    parser.add_argument("--calls", type=int, default=2000, help="100-byte calls for the latency")
    parser.add_argument("--lab-calls", type=int, default=50,
                        help="at most this many of the calls on the NAT lab kinds (each is one RTT)")
    parser.add_argument("--plain", action="store_true", help="tcp: plain TCP instead of TLS 1.3")
    parser.add_argument("--shape-mbit", type=float, default=None,
                        help="NAT lab kinds: both routers' upload and download rate, Mbit/s")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="NAT lab kinds: one-way delay added by each of the two routers "
                             "(RTT = 4 x this)")
    parser.add_argument("--nat-kind", choices=["port-restricted", "full-cone", "symmetric"],
                        default="port-restricted", help="NAT lab kinds: the kind of both NATs")
    parser.add_argument("--relay-default-limits", action="store_true",
                        help="relay: the relay's default RelayLimits instead of generous ones")
    parser.add_argument("--udp-rcvbuf-kib", type=int, default=None,
                        help="webrtc experiment: SO_RCVBUF of ICE's UDP sockets (default: aioice's 256)")
    parser.add_argument("--json", action="store_true", help="print JSON only (the default output)")
    parser.add_argument("--role", choices=["relay", "receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:  # one side of a NAT lab kind, inside its namespace (transport_paths.py)
        role_main(args.role, args.params)
        return
    quiet()
    signal.signal(signal.SIGTERM, _interrupt)  # like Ctrl-C: the NAT lab is removed on the way out
    chunk = int(args.chunk_mib * MiB)
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    results: dict[str, Any] = {}
    try:
        if "tcp" in kinds:
            try:
                results["tcp"] = _run_tcp(args, chunk)
            except Exception as exc:
                results["tcp"] = {"kind": "tcp", "available": False, "reason": f"{type(exc).__name__}: {exc}"}
        lab_kinds = [kind for kind in kinds if kind != "tcp"]
        if lab_kinds:
            results |= asyncio.run(_run_lab_kinds(lab_kinds, args, chunk))
    except KeyboardInterrupt:
        sys.exit("interrupted (the NAT lab was removed)")
    # a kind that failed is a failure, except holepunch (still being built): reported, exit 0
    failed = [kind for kind, result in results.items() if not result.get("available") and kind != "holepunch"]
    if args.kind == "all":
        print(orjson.dumps({"kinds": results, "mib": args.mib, "shape_mbit": args.shape_mbit,
                            "delay_ms_per_router": args.delay_ms, "cpus": os.cpu_count()}).decode())
    else:
        print(orjson.dumps(results[args.kind]).decode())
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
