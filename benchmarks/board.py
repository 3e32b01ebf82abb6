"""Reads of a run's progress board: the bytes and the reader's CPU per read, side by side.

N nodes on an in-memory DHT (one process); each writes a realistic progress report under one
key, as every trainer of a run does. Then readers read the key as the board does (three of its
eight nodes a read, each reader from its own place in their ring), two ways in one run:

- `three_full`: each of the three nodes sends every entry (how reads worked before summaries;
  the requests are made directly, as the reader's DHT node made them);
- `summaries`: `DHTNode.get` as it is now: the first node sends the entries, the other two a
  summary (a sub-key digest and an expiration per entry), and news only they hold is fetched;
- `lookup`: the same read by a reader whose route to the key's nodes has expired (every 30 s),
  as it was before `by_route`: an iterative lookup, whose nodes near the key each send their
  entries;
- `lookup_by_route`: that read as the board makes it now (`DHTNode.get(by_route=True)`): a
  lookup of the key's nodes only (find_node), then a read of three of them as `summaries`.

Each way decodes and checks the entries as a reader does (the signature cache emptied before
each way). Bytes are the find_value and find_node replies' headers (JSON) and payloads (deflated
as the reader accepts); CPU is
the process's over each read, the reader's and its nodes' work together (one process). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from typing import Any

import orjson
import structlog

from dedloc.daemon.collab.progress import PeerProgress
from dedloc.daemon.dht import DHTConfig, DHTNode, key_id_of, records
from dedloc.daemon.dht import protocol as wire
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext
from dedloc.daemon.net.memory import MemoryNetwork

KEY = "bench/progress"
READ_REPLICAS = 3
# the reports' lifetime: a board's is 30 s, but 256 nodes take longer than that to start and
# store on a loaded machine, and an expired report is not read (the ways would compare nothing)
TTL = 1800.0


def _report(peer_id: str, rng: random.Random, now: float) -> bytes:
    return PeerProgress(peer_id, 1200 + rng.randrange(2), rng.randrange(4096),
                        rng.uniform(20.0, 400.0), now, now + TTL, "trainer",
                        rng.randrange(10**7), rng.uniform(0.5, 3.0), started_at=now - 3600.0,
                        lineage=rng.randbytes(16).hex(), planned=rng.randrange(4096, 8192),
                        stepped=True, served=rng.randrange(20)).to_bytes()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    network = MemoryNetwork()
    config = DHTConfig(maintenance_period=3600.0)
    identities = [Identity.from_seed(rng.randbytes(32)) for _ in range(args.nodes)]
    transports = [network.transport(identity.peer_id) for identity in identities]
    nodes = [DHTNode(t, i, config, rng=random.Random(rng.random()))
             for t, i in zip(transports, identities, strict=True)]
    sent = [0]

    def counting(node: DHTNode, method: str) -> Any:
        serve = node._on_find_value if method == wire.FIND_VALUE else node._on_find_node

        async def answer(ctx: RequestContext, message: Message) -> Message:
            reply = await serve(ctx, message)
            sent[0] += len(orjson.dumps(reply.header)) + len(reply.payload)
            return reply
        return answer

    try:
        await nodes[0].start()
        bootstrap = [str(a) for a in transports[0].listen_addresses()]
        for node in nodes[1:]:
            await node.start(bootstrap)
        now = time.time()
        for node in nodes:
            await node.store(KEY, _report(node.peer_id, rng, now), now + TTL, sub_key=node.peer_id)
        for node, transport in zip(nodes, transports, strict=True):
            for method in (wire.FIND_VALUE, wire.FIND_NODE):  # (the replies' bytes counted)
                transport.add_unary_handler(method, counting(node, method))
        readers = rng.sample(nodes, min(args.reads, len(nodes)))
        for reader in readers:  # (each learns the key's nodes, as a board's first read does)
            await reader.get(KEY)
        results: dict[str, dict[str, float]] = {}
        for way in ("three_full", "summaries", "lookup", "lookup_by_route"):
            sent[0], entries_read, cpu = 0, 0, 0.0
            records._verified.cache_clear()  # (each way checks the signatures it reads afresh)
            for turn, reader in enumerate(readers):
                started = time.process_time()
                if way.startswith("lookup"):
                    reader._routes.forget(key_id_of(KEY))
                if way != "three_full":
                    record = await reader.get(KEY, replicas=READ_REPLICAS, start=turn,
                                              by_route=way == "lookup_by_route")
                    entries_read += 0 if record is None else len(record.entries)
                else:
                    entries_read += len(await _three_full(reader, turn))
                cpu += time.process_time() - started
            results[way] = {"bytes_per_read": round(sent[0] / len(readers)),
                            "cpu_ms_per_read": round(1000 * cpu / len(readers), 3),
                            "entries_per_read": round(entries_read / len(readers), 1)}
    finally:
        for node in nodes:
            await node.close()
        await asyncio.gather(*(t.close() for t in transports))
    full, summaries = results["three_full"], results["summaries"]
    return {
        "benchmark": "board",
        "nodes": args.nodes,
        "reports": args.nodes,
        "reads": len(readers),
        "read_replicas": READ_REPLICAS,
        **{f"{way}_{name}": value for way, figures in results.items()
           for name, value in figures.items()},
        "bytes_ratio": round(full["bytes_per_read"] / summaries["bytes_per_read"], 2),
        "cpu_ratio": round(full["cpu_ms_per_read"] / summaries["cpu_ms_per_read"], 2),
        "lookup_bytes_ratio": round(results["lookup"]["bytes_per_read"]
                                    / results["lookup_by_route"]["bytes_per_read"], 2),
    }


async def _three_full(reader: DHTNode, turn: int) -> list[Any]:
    """Read the key in full from three of its nodes, as a route read did before summaries."""
    held = reader._routes.held(key_id_of(KEY))
    first = turn % len(held)
    route = [*held[first:], *held[:first]][:READ_REPLICAS]
    request = {**reader._caller_header(), "key": KEY, "accept": wire.ACCEPT}
    entries: list[Any] = []
    replies = await asyncio.gather(*(reader.transport.call(
        contact.peer_id, wire.FIND_VALUE, Message(request), timeout=10.0) for contact in route))
    for contact, reply in zip(route, replies, strict=True):
        found, _ = wire.decode_values(KEY, reply)
        entries.extend(reader._checked(contact.peer_id, found))
    return records.merge_entries(entries, time.time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=256, help="nodes, each writing a report")
    parser.add_argument("--reads", type=int, default=64, help="readers, one read each way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = parser.parse_args()
    if args.nodes < 8 or args.reads < 1:
        parser.error("--nodes must be at least 8 and --reads at least 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    sys.stdout.write(orjson.dumps(asyncio.run(run(args))).decode() + "\n")


if __name__ == "__main__":
    main()
