"""Transport throughput and latency between two processes on loopback.

The receiver runs in a child process (multiprocessing, spawn), the sender in this one; they talk
over a real TlsTransport link on 127.0.0.1 (TLS 1.3 by default, plain TCP with --plain). Prints one
JSON object: MBps of one stream of S MiB sent in C MiB messages (received in place with
receive_into), CPU% of each process during the transfer, the time to connect (TCP + TLS + hellos),
and the p50/p99 latency of a 100-byte unary call.

    python benchmarks/transport.py --kind tcp --mib 256 --json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import statistics
import sys
import time
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
)

MiB = 1024 * 1024


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def _receiver_main(conn: Any, plain: bool, chunk: int) -> None:
    transport = await TlsTransport.start(Identity.generate(), [PeerAddress.parse("/ip4/127.0.0.1/tcp/0")],
                                         tls=not plain)
    done = asyncio.Event()

    async def echo(ctx: RequestContext, message: Message) -> Message:
        return Message({}, message.payload)

    async def sink(ctx: RequestContext, stream: LinkStream) -> None:
        buffer = bytearray(chunk)
        received = 0
        cpu0, wall0 = _cpu(), time.perf_counter()
        while (message := await stream.receive_into(buffer, timeout=60)) is not None:
            received += len(message.payload)
        cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
        await stream.send(Message({"bytes": received, "cpu_percent": 100 * cpu / wall}), timeout=60)

    async def stop(ctx: RequestContext, message: Message) -> Message:
        done.set()
        return Message()

    transport.add_unary_handler("echo", echo)
    transport.add_unary_handler("stop", stop)
    transport.add_stream_handler("sink", sink)
    conn.send(str(transport.listen_addresses()[0]))
    try:
        async with asyncio.timeout(600):
            await done.wait()
        await asyncio.sleep(0.05)  # let the reply to "stop" go out
    finally:
        await transport.close()


def _receiver(conn: Any, plain: bool, chunk: int) -> None:
    _quiet()
    asyncio.run(_receiver_main(conn, plain, chunk))


async def _sender(address: PeerAddress, mib: int, chunk: int, plain: bool, calls: int) -> dict[str, Any]:
    transport = await TlsTransport.start(Identity.generate(), [], tls=not plain)
    try:
        start = time.perf_counter()
        peer = await transport.connect(address, timeout=10)
        connect_s = time.perf_counter() - start

        payload = memoryview(bytearray(os.urandom(1024)) * (chunk // 1024))
        total = mib * MiB
        stream = await transport.open_stream(peer, "sink", {}, timeout=10)
        cpu0, wall0 = _cpu(), time.perf_counter()
        sent = 0
        while sent < total:
            piece = payload[: min(chunk, total - sent)]
            await stream.send(Message({}, piece), timeout=60)
            sent += len(piece)
        await stream.close()
        summary = await stream.receive(timeout=60)
        wall = time.perf_counter() - wall0
        cpu = _cpu() - cpu0
        assert summary is not None and summary.header["bytes"] == total

        small = b"x" * 100
        for _ in range(100):  # warm up
            await transport.call(peer, "echo", Message({}, small), timeout=10)
        latencies = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            await transport.call(peer, "echo", Message({}, small), timeout=10)
            latencies.append((time.perf_counter_ns() - t0) / 1000)
        latencies.sort()
        await transport.call(peer, "stop", Message(), timeout=10)
        return {
            "kind": "tcp",
            "tls": not plain,
            "processes": 2,
            "mib": mib,
            "chunk_mib": chunk / MiB,
            "seconds": round(wall, 4),
            "MBps": round(total / wall / 1e6, 1),
            "MiBps": round(total / wall / MiB, 1),
            "cpu_percent_sender": round(100 * cpu / wall, 1),
            "cpu_percent_receiver": round(float(summary.header["cpu_percent"]), 1),
            "connect_seconds": round(connect_s, 5),
            "call_p50_us": round(statistics.median(latencies), 1),
            "call_p99_us": round(latencies[int(len(latencies) * 0.99) - 1], 1),
            "calls": calls,
        }
    finally:
        await transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["tcp"], default="tcp")
    parser.add_argument("--mib", type=int, default=256, help="stream size in MiB")
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="message size in MiB")
    parser.add_argument("--calls", type=int, default=2000, help="100-byte calls for the latency")
    parser.add_argument("--plain", action="store_true", help="plain TCP instead of TLS 1.3")
    parser.add_argument("--json", action="store_true", help="print JSON only (the default output)")
    args = parser.parse_args()
    _quiet()
    chunk = int(args.chunk_mib * MiB)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_receiver, args=(child, args.plain, chunk), daemon=True)
    process.start()
    try:
        if not parent.poll(30):
            sys.exit("the receiver process did not start")
        address = PeerAddress.parse(parent.recv())
        result = asyncio.run(_sender(address, args.mib, chunk, args.plain, args.calls))
    finally:
        process.join(10)
        if process.is_alive():
            process.terminate()
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
