"""Control-API round trips: sequential latency and pipelined throughput on one unix socket.

Prints one JSON object: calls per second sequentially and with N calls in flight, and the
median/p99 latency of a sequential call, against a JsonRpcServer with a trivial method.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson
import structlog

from dedloc.rpc import JsonRpcClient, JsonRpcServer, MethodRegistry, rpc_method


class Echo:
    @rpc_method("echo")
    async def echo(self, value: int = 0) -> int:
        """Return the value."""
        return value


async def run(calls: int, inflight: int) -> dict[str, float]:
    registry = MethodRegistry("bench", "0")
    registry.register_object(Echo())
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        server = JsonRpcServer(registry, Path(tmp) / "b.sock", max_inflight_per_connection=inflight)
        await server.start()
        try:
            async with await JsonRpcClient.connect(server.path) as client:
                latencies = []
                start = time.perf_counter()
                for i in range(calls):
                    t0 = time.perf_counter()
                    await client.call("echo", {"value": i})
                    latencies.append(time.perf_counter() - t0)
                sequential = calls / (time.perf_counter() - start)
                start = time.perf_counter()
                for batch in range(0, calls, inflight):
                    await asyncio.gather(*(client.call("echo", {"value": i})
                                           for i in range(batch, min(calls, batch + inflight))))
                pipelined = calls / (time.perf_counter() - start)
        finally:
            await server.close()
    latencies.sort()
    return {
        "calls": calls,
        "inflight": inflight,
        "sequential_calls_per_second": round(sequential, 1),
        "pipelined_calls_per_second": round(pipelined, 1),
        "latency_median_us": round(statistics.median(latencies) * 1e6, 1),
        "latency_p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--inflight", type=int, default=16)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = asyncio.run(run(args.calls, args.inflight))
    sys.stdout.write(orjson.dumps({"benchmark": "rpc_roundtrip", **result}).decode() + "\n")


if __name__ == "__main__":
    main()
