"""The butterfly all-reduce in one process: N TlsTransports on 127.0.0.1, one AllReduceService each,
N x MiB float32 vectors averaged in equal parts; plus the codecs' encode/decode speeds.

Prints one JSON object: seconds per round (best and median of --rounds), MBps per peer (vector
bytes / seconds), the max error against numpy's mean, whether every member ended with the same
vector, the payload bytes sent by all peers in the last round, and (--codecs) the codecs' MB/s
on 1M-element chunks. --no-check turns the reducers' accounts and the members' checks off
(accounts.py), to measure what they cost.

--aggregation names how the reducers combine contributions, one or more of `mean` (the weighted
mean), `norm_clip` (the norm-clipped mean, a run's default: aggregation.py) and `centered_clip`
(`averaging.robust_aggregation = "centered_clip"`, clipping.py); with several, each has its own
peers and their rounds take turns (round 1 of each, then round 2 of each, ..., the first of
each turn rotating), so that the machine's load weighs on all alike, and `modes` holds each
one's figures. --robust is --aggregation centered_clip. --outlier F multiplies the last peer's
vector by F (one far larger contribution: norm_clip then clips it, and max_error measures its
effect, not rounding).

    python benchmarks/allreduce_inproc.py --peers 4 --mib 64 [--plain] [--compression none]
        [--no-check] [--aggregation mean norm_clip centered_clip] [--outlier F] [--codecs]
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


AGGREGATIONS = ("mean", "norm_clip", "centered_clip")


async def _peers(count: int, tls: bool, policy: ScreeningPolicy
                 ) -> tuple[list[TlsTransport], list[AllReduceService]]:
    loopback = PeerAddress.parse("/ip4/127.0.0.1/tcp/0")
    transports = [await TlsTransport.start(Identity.generate(), [loopback], tls=tls)
                  for _ in range(count)]
    services = [AllReduceService(t, policy=policy) for t in transports]
    for a, b in itertools.combinations(transports, 2):
        a.learn_addresses(b.peer_id, b.listen_addresses())
        b.learn_addresses(a.peer_id, a.listen_addresses())
        await a.connect(b.listen_addresses()[0], timeout=10)
    return transports, services


def _aggregations(args: argparse.Namespace) -> list[str]:
    named = list(getattr(args, "aggregation", None) or [])
    if getattr(args, "robust", False) and "centered_clip" not in named:
        named.append("centered_clip")
    return named or ["mean"]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    modes = _aggregations(args)
    clusters: dict[str, tuple[list[TlsTransport], list[AllReduceService]]] = {}
    try:
        for mode in modes:
            policy = ScreeningPolicy(check_answers=not args.no_check,
                                     robust="centered_clip" if mode == "centered_clip" else "none")
            clusters[mode] = await _peers(args.peers, not args.plain, policy)
        size = args.mib * MiB // 4
        chunk = args.chunk_mib * MiB // 4
        chunks = -(-size // chunk)
        cuts = [min(size, chunk * (chunks * k // args.peers)) for k in range(args.peers + 1)]
        cuts[-1] = size
        rng = np.random.default_rng(1)
        originals = [rng.standard_normal(size).astype(np.float32) for _ in range(args.peers)]
        outlier = getattr(args, "outlier", None)
        if outlier is not None:
            originals[-1] *= np.float32(outlier)
        expected = np.mean([o.astype(np.float64) for o in originals], axis=0)
        figures = {mode: {"times": [], "error": 0.0, "identical": True, "sent": 0, "clipped": 0}
                   for mode in modes}
        for round_index in range(args.rounds):
            turn = round_index % len(modes)  # who goes first rotates: no mode always follows one
            for mode in modes[turn:] + modes[:turn]:
                transports, services = clusters[mode]
                figure = figures[mode]
                vectors = [o.copy() for o in originals]
                members = tuple(Member(t.peer_id, "trainer", 1.0, 1e8, 1e8) for t in transports)
                group = Group(f"bench-{mode}-{round_index}", "bench", members, size,
                              tuple(itertools.pairwise(cuts)), chunk, args.compression,
                              time.time() + 120, "norm_clip" if mode == "norm_clip" else "mean")
                began = time.perf_counter()
                reports = await asyncio.gather(*(
                    s.run(group, i, v, 1.0) for i, (s, v) in enumerate(zip(services, vectors, strict=True))))
                figure["times"].append(time.perf_counter() - began)
                figure["sent"] = sum(r.bytes_sent for r in reports)
                figure["clipped"] = sum(r.contributions_clipped for r in reports)
                if any(r.failed_parts for r in reports):
                    raise SystemExit(f"round failed: {[r.to_json()['failures'] for r in reports]}")
                figure["error"] = max(figure["error"],
                                      max(float(np.abs(v - expected).max()) for v in vectors))
                figure["identical"] = figure["identical"] and all(np.array_equal(v, vectors[0])
                                                                  for v in vectors)
                del vectors
        results = {}
        for mode, figure in figures.items():
            best = min(figure["times"])
            results[mode] = {
                "seconds_best": round(best, 4),
                "seconds_median": round(statistics.median(figure["times"]), 4),
                "MBps_per_peer": round(args.mib * MiB / 1e6 / best, 1),
                "max_error": figure["error"], "identical": figure["identical"],
                "payload_bytes_sent": figure["sent"],
                "contributions_clipped_last_round": figure["clipped"]}
        first = results[modes[0]]
        return {"benchmark": "allreduce_inproc", "peers": args.peers, "mib": args.mib,
                "chunk_mib": args.chunk_mib, "tls": not args.plain, "compression": args.compression,
                "rounds": args.rounds, "outlier": outlier, "aggregation": modes[0], **first,
                "checked": not args.no_check, "robust": modes[0] == "centered_clip",
                "modes": results, "codecs": codec_speeds() if args.codecs else {}}
    finally:
        for transports, services in clusters.values():
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
    parser.add_argument("--aggregation", nargs="+", choices=AGGREGATIONS,
                        help="how the reducers combine contributions (several: side by side)")
    parser.add_argument("--robust", action="store_true",
                        help="the same as --aggregation centered_clip")
    parser.add_argument("--outlier", type=float,
                        help="multiply the last peer's vector by this (norm_clip clips it)")
    parser.add_argument("--codecs", action="store_true", help="measure the codecs' speeds too")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.stdout.write(orjson.dumps(asyncio.run(bench(args))).decode() + "\n")


if __name__ == "__main__":
    main()
