"""All-reduce benchmark: N real dedlocd processes average an S MiB float32 vector, round after round.

    python benchmarks/allreduce.py --peers 4 --mib 64 [--compression none] [--netlab hetero4] --json

Each daemon averages through the `averaging.average` RPC (a shared-memory buffer per peer, the
same code the collaboration uses). Prints one JSON object: `seconds_median` (wall time of a round,
from the calls to the last answer, matchmaking included), `allreduce_seconds_median` (the
all-reduce alone), `bound_seconds` (the load balancer's optimal time for the bandwidths: the
shaped ones with --netlab, else those the daemons measured), `ratio_to_bound`,
`uniform_seconds_median` (the same rounds with equal shares, with --compare-uniform), and
`MBps_per_peer`. With --netlab the peers run in network namespaces shaped by `tc` (root needed;
profiles in netlab_profiles.toml). `--impl hivemind` runs hivemind's DecentralizedAverager instead
(when `hivemind` is importable: run this script with a Python that has it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import NetLab, load_profile

MIB = 1 << 20
WIRE_BYTES_PER_ELEMENT = {"none": 4.0, "fp16": 2.0, "uint8": 1.0, "quantile8": 1.0}


async def _wait_ready(socket: Path, process: asyncio.subprocess.Process, log: Path) -> dict[str, Any]:
    from dedloc.rpc import JsonRpcClient, RpcConnectionError

    async with asyncio.timeout(60):
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"dedlocd exited ({process.returncode}); see {log}")
            try:
                async with await JsonRpcClient.connect(socket) as client:
                    info = await client.call("node.info")
                    if info["dht"]["mode"] != "starting":
                        return info
            except RpcConnectionError:
                pass
            await asyncio.sleep(0.1)


class DedlocSwarm:
    """N dedlocd processes (optionally each in a shaped network namespace)."""

    def __init__(self, peers: int, workdir: Path, lab: NetLab | None, balancing: str,
                 guesses: list[tuple[float, float]] | None) -> None:
        self.peers = peers
        self.workdir = workdir
        self.lab = lab
        self.balancing = balancing
        self.guesses = guesses
        self.processes: list[asyncio.subprocess.Process] = []
        self.sockets: list[Path] = []

    async def start(self) -> None:
        bootstrap: str | None = None
        for index in range(self.peers):
            root = self.workdir / f"{self.balancing}{index}"
            root.mkdir()
            host = self.lab.addresses[index] if self.lab else "127.0.0.1"
            argv = [sys.executable, "-m", "dedloc.daemon", "--node.state_dir", str(root),
                    "--log.format", "json", "--log.level", "warning",
                    "--net.listen", f"/ip4/{host}/tcp/0", "--averaging.balancing", self.balancing]
            if self.guesses:
                up, down = self.guesses[index]
                argv += ["--averaging.upload_mbps", str(up), "--averaging.download_mbps", str(down)]
            if bootstrap:
                argv += ["--net.bootstrap", bootstrap]
            if self.lab:
                argv = self.lab.command(index, argv)
            log = root / "dedlocd.log"
            handle = log.open("wb")
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=handle, stderr=handle)
            finally:
                handle.close()
            self.processes.append(process)
            self.sockets.append(root / "dedlocd.sock")
            info = await _wait_ready(root / "dedlocd.sock", process, log)
            if bootstrap is None:
                bootstrap = next(a for a in info["addresses"]["p2p"] if f"/{host}/" in a)

    async def round(self, key: str, buffers: list[shared_memory.SharedMemory], length: int,
                    compression: str, timeout: float) -> tuple[float, list[dict[str, Any]]]:
        from dedloc.rpc import JsonRpcClient

        clients = [await JsonRpcClient.connect(s, default_timeout=timeout + 10) for s in self.sockets]
        try:
            started = time.perf_counter()
            reports = await asyncio.gather(*(
                client.call("averaging.average", {
                    "key": key, "buffer": shm.name, "length": length, "expected_peers": self.peers,
                    "compression": compression, "timeout": timeout, "window": 10.0})
                for client, shm in zip(clients, buffers, strict=True)))
            return time.perf_counter() - started, reports
        finally:
            for client in clients:
                await client.close()

    async def measured_bandwidth(self) -> list[tuple[float, float]]:
        from dedloc.rpc import JsonRpcClient

        result = []
        for socket in self.sockets:
            async with await JsonRpcClient.connect(socket) as client:
                bandwidth = (await client.call("averaging.status"))["bandwidth"]
            result.append((bandwidth["upload_bytes_per_second"], bandwidth["download_bytes_per_second"]))
        return result

    async def close(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in self.processes:
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


def bound_seconds(bandwidths: list[tuple[float, float]], vector_bytes: float) -> float:
    from dedloc.daemon.averaging.balancing import solve_shares
    from dedloc.daemon.averaging.group import Member

    members = [Member(f"p{i}", "trainer", 1.0, up, down) for i, (up, down) in enumerate(bandwidths)]
    return solve_shares(members, vector_bytes).seconds


async def run_dedloc(args: argparse.Namespace, lab: NetLab | None) -> dict[str, Any]:
    length = args.mib * MIB // 4
    rng = np.random.default_rng(args.seed)
    originals = [rng.standard_normal(length, dtype=np.float32) for _ in range(args.peers)]
    expected = np.mean(originals, axis=0)
    profile = load_profile(args.netlab) if args.netlab else None
    guesses = [(p.upload_mbit, p.download_mbit) for p in profile] if profile and args.declare else None
    result: dict[str, Any] = {}
    modes = ["lp", "uniform"] if args.compare_uniform else ["lp"]
    workdir = Path(tempfile.mkdtemp(prefix="dl-bench-", dir="/tmp"))
    try:
        for mode in modes:
            swarm = DedlocSwarm(args.peers, workdir, lab, mode, guesses)
            buffers = [shared_memory.SharedMemory(create=True, size=length * 4) for _ in range(args.peers)]
            try:
                await swarm.start()
                walls, allreduces = [], []
                for index in range(args.warmup + args.rounds):
                    for shm, original in zip(buffers, originals, strict=True):
                        np.ndarray(length, np.float32, shm.buf)[:] = original
                    wall, reports = await swarm.round(f"bench/{mode}/{index}", buffers, length,
                                                      args.compression, args.timeout)
                    if index == 0:
                        sizes = {r["group_size"] for r in reports}
                        if sizes != {args.peers}:
                            raise RuntimeError(f"groups of {sizes} formed instead of {args.peers}")
                    if any(r["failed_parts"] or r["senders_excluded"] for r in reports):
                        raise RuntimeError(f"round {index} had failures: {orjson.dumps(reports).decode()}")
                    if index == 0 and args.compression == "none":
                        for shm in buffers:
                            got = np.ndarray(length, np.float32, shm.buf)
                            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
                    if index >= args.warmup:
                        walls.append(wall)
                        allreduces.append(max(r["allreduce_seconds"] for r in reports))
                measured = await swarm.measured_bandwidth()
            finally:
                await swarm.close()
                for shm in buffers:
                    shm.close()
                    shm.unlink()
            prefix = "" if mode == "lp" else "uniform_"
            result[f"{prefix}seconds_median"] = round(statistics.median(walls), 4)
            result[f"{prefix}allreduce_seconds_median"] = round(statistics.median(allreduces), 4)
            if mode == "lp":
                bandwidths = ([(p.upload_mbit * 1e6 / 8, p.download_mbit * 1e6 / 8) for p in profile]
                              if profile else measured)
                wire_bytes = length * WIRE_BYTES_PER_ELEMENT[args.compression]
                result["bound_seconds"] = round(bound_seconds(bandwidths, wire_bytes), 4)
                result["bandwidths_used_for_bound"] = "shaped" if profile else "measured"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["ratio_to_bound"] = round(result["allreduce_seconds_median"] / result["bound_seconds"], 3) \
        if result.get("bound_seconds") else None
    result["MBps_per_peer"] = round(args.mib * MIB / 1e6 / result["allreduce_seconds_median"], 2)
    if "uniform_allreduce_seconds_median" in result:
        result["adaptive_speedup_vs_uniform"] = round(
            result["uniform_allreduce_seconds_median"] / result["allreduce_seconds_median"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--compression", choices=["none", "fp16", "uint8", "quantile8"], default="none")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--netlab", help="a profile of netlab_profiles.toml (root)")
    parser.add_argument("--declare", action=argparse.BooleanOptionalAction, default=True,
                        help="with --netlab, start each daemon with its shaped bandwidth as its guess")
    parser.add_argument("--compare-uniform", action="store_true",
                        help="also run the rounds with equal shares")
    parser.add_argument("--impl", choices=["dedloc", "hivemind"], default="dedloc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only format)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started = time.time()
    lab_context = NetLab(load_profile(args.netlab)) if args.netlab else contextlib.nullcontext()
    with lab_context as lab:
        if args.impl == "hivemind":
            from allreduce_hivemind import run_hivemind

            result = run_hivemind(args, lab)
        else:
            result = asyncio.run(run_dedloc(args, lab))
    summary = {"benchmark": "allreduce", "impl": args.impl, "peers": args.peers, "mib": args.mib,
               "compression": args.compression, "rounds": args.rounds, "netlab": args.netlab,
               "cpus": os.cpu_count(), **result, "total_seconds": round(time.time() - started, 1)}
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")


if __name__ == "__main__":
    main()
