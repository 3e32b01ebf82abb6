"""The same all-reduce measurement with hivemind's DecentralizedAverager, for side-by-side numbers.

Run through `allreduce.py --impl hivemind` with a Python that has hivemind (its own virtual
environment: `python -m venv .venv-hivemind && .venv-hivemind/bin/pip install hivemind==1.1.12`).
Each peer is a process with its own hivemind DHT (and hivemind's Go daemon), told never to reach
outside this machine. A round is timed from the moment every peer calls `step()` to the last
return, matchmaking included, like dedloc's `seconds_median`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

MIB = 1 << 20
LOCAL_ONLY = {"nat_port_map": False, "auto_nat": False, "use_relay": False, "use_auto_relay": False}


def _peer(index: int, args: argparse.Namespace, host: str, initial: list[str], addresses: Any,
          barrier: Any, results: Any) -> None:
    import hivemind
    import torch

    dht = hivemind.DHT(start=True, initial_peers=initial or None, host_maddrs=[f"/ip4/{host}/tcp/0"],
                       **LOCAL_ONLY)
    if index == 0:
        addresses.put([str(a) for a in dht.get_visible_maddrs()])
    torch.manual_seed(index)
    tensor = torch.randn(args.mib * MIB // 4)
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor], dht, start=True, prefix="bench", target_group_size=args.peers,
        min_group_size=args.peers, min_matchmaking_time=1.0, request_timeout=3.0)
    for round_index in range(args.warmup + args.rounds):
        barrier.wait()
        started = time.time()
        outcome = averager.step(timeout=args.timeout)
        results.put((round_index, index, started, time.time(), outcome is not None))
    barrier.wait()
    averager.shutdown()
    dht.shutdown()


def run_hivemind(args: argparse.Namespace, lab: Any) -> dict[str, Any]:
    if lab is not None:
        raise SystemExit("--impl hivemind does not run in the netlab yet")
    context = mp.get_context("fork")  # hivemind starts its own processes by fork
    addresses = context.Queue()
    barrier = context.Barrier(args.peers)
    results = context.Queue()
    first = context.Process(target=_peer, args=(0, args, "127.0.0.1", [], addresses, barrier, results))
    first.start()
    initial = addresses.get(timeout=120)
    processes = [first, *(context.Process(target=_peer, args=(i, args, "127.0.0.1", initial, addresses,
                                                                barrier, results))
                          for i in range(1, args.peers))]
    for process in processes[1:]:
        process.start()
    rounds: dict[int, list[tuple[float, float, bool]]] = {}
    for _ in range(args.peers * (args.warmup + args.rounds)):
        round_index, _, started, finished, ok = results.get(timeout=args.timeout + 120)
        rounds.setdefault(round_index, []).append((started, finished, ok))
    for process in processes:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    walls = [max(f for _, f, _ in rows) - min(s for s, _, _ in rows)
             for index, rows in sorted(rounds.items()) if index >= args.warmup]
    failures = sum(not ok for rows in rounds.values() for *_, ok in rows)
    median = statistics.median(walls)
    return {"seconds_median": round(median, 4), "failed_steps": failures,
            "MBps_per_peer": round(args.mib * MIB / 1e6 / median, 2)}
