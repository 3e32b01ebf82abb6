"""The butterfly all-reduce in one process: N TlsTransports on 127.0.0.1, one AllReduceService each,
N x MiB float32 vectors averaged in equal parts; plus the codecs' encode/decode speeds.

Prints one JSON object: seconds per round (best and median of --rounds), MBps per peer (vector
bytes / seconds), the max error against numpy, whether every member ended with the same vector,
the payload bytes sent by all peers in the last round, and (--codecs) the codecs' MB/s on
1M-element chunks. --no-check turns the reducers' accounts and the members' checks off
(accounts.py), to measure what they cost. --robust aggregates by centered clipping
(`averaging.robust_aggregation = "centered_clip"`) instead of the weighted mean.

    python benchmarks/allreduce_inproc.py --peers 4 --mib 64 [--plain] [--compression none]
        [--no-check] [--robust] [--codecs]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import statistics
import sys
import time
from typing import Any

import numpy as np
import orjson
import structlog

from dedloc.daemon.averaging.allreduce import AllReduceService
from dedloc.daemon.averaging.compression import CODECS
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.screening import ScreeningPolicy
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import PeerAddress, TlsTransport

MiB = 1024 * 1024


def codec_speeds() -> dict[str, dict[str, float]]:
    array = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    speeds = {}
    for name, codec in CODECS.items():
        payload, meta = codec.encode(array)
        out = np.empty_like(array)
        began = time.perf_counter()
        for _ in range(10):
            payload, meta = codec.encode(array)
        encode = (time.perf_counter() - began) / 10
        began = time.perf_counter()
        for _ in range(10):
            codec.decode(payload, meta, array.size, out=out)
        decode = (time.perf_counter() - began) / 10
        speeds[name] = {"encode_MBps": round(array.nbytes / encode / 1e6),
                        "decode_MBps": round(array.nbytes / decode / 1e6),
                        "ratio": round(array.nbytes / len(payload), 2)}
    return speeds


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    loopback = PeerAddress.parse("/ip4/127.0.0.1/tcp/0")
    transports = [await TlsTransport.start(Identity.generate(), [loopback], tls=not args.plain)
                  for _ in range(args.peers)]
    policy = ScreeningPolicy(check_answers=not args.no_check,
                             robust="centered_clip" if getattr(args, "robust", False) else "none")
    services = [AllReduceService(t, policy=policy) for t in transports]
    try:
        for a, b in itertools.combinations(transports, 2):
            a.learn_addresses(b.peer_id, b.listen_addresses())
            b.learn_addresses(a.peer_id, a.listen_addresses())
            await a.connect(b.listen_addresses()[0], timeout=10)
        size = args.mib * MiB // 4
        chunk = args.chunk_mib * MiB // 4
        chunks = -(-size // chunk)
        cuts = [min(size, chunk * (chunks * k // args.peers)) for k in range(args.peers + 1)]
        cuts[-1] = size
        rng = np.random.default_rng(1)
        originals = [rng.standard_normal(size).astype(np.float32) for _ in range(args.peers)]
        expected = np.mean([o.astype(np.float64) for o in originals], axis=0)
        times, error, identical, sent = [], 0.0, True, 0
        for round_index in range(args.rounds):
            vectors = [o.copy() for o in originals]
            members = tuple(Member(t.peer_id, "trainer", 1.0, 1e8, 1e8) for t in transports)
            group = Group(f"bench-{round_index}", "bench", members, size,
                          tuple(itertools.pairwise(cuts)), chunk, args.compression, time.time() + 120)
            began = time.perf_counter()
            reports = await asyncio.gather(*(s.run(group, i, v, 1.0)
                                             for i, (s, v) in enumerate(zip(services, vectors, strict=True))))
            times.append(time.perf_counter() - began)
            sent = sum(r.bytes_sent for r in reports)
            if any(r.failed_parts for r in reports):
                raise SystemExit(f"round failed: {[r.to_json()['failures'] for r in reports]}")
            error = max(error, max(float(np.abs(v - expected).max()) for v in vectors))
            identical = identical and all(np.array_equal(v, vectors[0]) for v in vectors)
        best = min(times)
        return {"benchmark": "allreduce_inproc", "peers": args.peers, "mib": args.mib,
                "chunk_mib": args.chunk_mib, "tls": not args.plain, "compression": args.compression,
                "seconds_best": round(best, 4), "seconds_median": round(statistics.median(times), 4),
                "MBps_per_peer": round(args.mib * MiB / 1e6 / best, 1), "max_error": error,
                "identical": identical, "checked": not args.no_check,
                "robust": bool(getattr(args, "robust", False)), "payload_bytes_sent": sent,
                "codecs": codec_speeds() if args.codecs else {}}
    finally:
        for service in services:
            service.close()
        for transport in transports:
            await transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compression", default="none", choices=sorted(CODECS))
    parser.add_argument("--plain", action="store_true", help="plain TCP instead of TLS 1.3")
    parser.add_argument("--no-check", action="store_true",
                        help="reducers send no account and members check no answer")
    parser.add_argument("--robust", action="store_true",
                        help="centered clipping (averaging.robust_aggregation) instead of the mean")
    parser.add_argument("--codecs", action="store_true", help="measure the codecs' speeds too")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.stdout.write(orjson.dumps(asyncio.run(bench(args))).decode() + "\n")


if __name__ == "__main__":
    main()
