"""DHT store/get latency and throughput on loopback.

Starts N DHT nodes in this one process (one event loop; `nodes_per_process` in the output), each
on its own transport: `--transport tls` (default: TlsTransport on 127.0.0.1, TLS and all) or
`--transport memory` (MemoryNetwork, no sockets). Every node bootstraps from the first. Then K
keys are stored one after the other, each from a random node, and read back one after the other,
each from another random node. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import resource
import statistics
import sys
import time
from typing import Any

import orjson
import structlog

from dedloc.daemon.dht import DHTConfig, DHTNode
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import PeerAddress, PeerTransport


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _make_transports(kind: str, identities: list[Identity]) -> list[PeerTransport]:
    if kind == "memory":
        from dedloc.daemon.net.memory import MemoryNetwork

        network = MemoryNetwork()
        return [network.transport(identity.peer_id) for identity in identities]
    from dedloc.daemon.net.transport import TlsTransport

    listen = [PeerAddress.parse("/ip4/127.0.0.1/tcp/0")]
    return list(await asyncio.gather(*(TlsTransport.start(i, listen=listen) for i in identities)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = DHTConfig(maintenance_period=3600.0)
    rss_before = _rss_mb()
    started = time.perf_counter()
    identities = [Identity.generate() for _ in range(args.nodes)]
    transports = await _make_transports(args.transport, identities)
    nodes = [DHTNode(t, i, config, rng=random.Random(rng.random())) for t, i in zip(transports, identities,
                                                                                     strict=True)]
    bootstrap = [str(a) for a in transports[0].listen_addresses()]
    try:
        await nodes[0].start()
        for node in nodes[1:]:
            await node.start(bootstrap)
        start_seconds = time.perf_counter() - started
        rss_per_node = (_rss_mb() - rss_before) / args.nodes

        value = bytes(rng.getrandbits(8) for _ in range(args.value_bytes))
        expiration = time.time() + 3600
        store_ms, get_ms, remote_get_ms, ok_stores, ok_gets = [], [], [], 0, 0
        begin = time.perf_counter()
        for i in range(args.keys):
            t = time.perf_counter()
            stored = await rng.choice(nodes).store(f"bench/{i}", value, expiration)
            store_ms.append((time.perf_counter() - t) * 1000)
            ok_stores += stored >= 1
        store_seconds = time.perf_counter() - begin
        begin = time.perf_counter()
        for i in range(args.keys):
            reader = rng.choice(nodes)
            local = bool(reader.storage.get(f"bench/{i}", time.time()))
            t = time.perf_counter()
            record = await reader.get(f"bench/{i}", latest=args.latest)
            get_ms.append((time.perf_counter() - t) * 1000)
            if not local:
                remote_get_ms.append(get_ms[-1])
            ok_gets += record is not None and record.value == value
        get_seconds = time.perf_counter() - begin
    finally:
        for node in nodes:
            await node.close()
        await asyncio.gather(*(t.close() for t in transports))
    return {
        "benchmark": "dht",
        "transport": args.transport,
        "nodes": args.nodes,
        "nodes_per_process": args.nodes,
        "keys": args.keys,
        "value_bytes": args.value_bytes,
        "latest": args.latest,
        "store_ops_per_s": round(args.keys / store_seconds, 1),
        "get_ops_per_s": round(args.keys / get_seconds, 1),
        "get_p50_ms": round(statistics.median(get_ms), 3),
        "get_p95_ms": round(_percentile(get_ms, 0.95), 3),
        # reads by a node that does not hold the key itself (it holds it on `replicas`/N of reads)
        "get_remote_p50_ms": round(statistics.median(remote_get_ms), 3) if remote_get_ms else None,
        "replicas": config.replicas,
        "store_p50_ms": round(statistics.median(store_ms), 3),
        "store_p95_ms": round(_percentile(store_ms, 0.95), 3),
        "success_rate": round((ok_stores + ok_gets) / (2 * args.keys), 4),
        "store_success_rate": round(ok_stores / args.keys, 4),
        "get_success_rate": round(ok_gets / args.keys, 4),
        "rss_mb_per_node": round(rss_per_node, 2),
        "start_seconds": round(start_seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--transport", choices=["tls", "memory"], default="tls")
    parser.add_argument("--value-bytes", type=int, default=64)
    parser.add_argument("--latest", action=argparse.BooleanOptionalAction, default=True,
                        help="get() asks all k closest nodes (default) or stops at the first hit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = parser.parse_args()
    if args.nodes < 1 or args.keys < 1:
        parser.error("--nodes and --keys must be at least 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    result = asyncio.run(run(args))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
