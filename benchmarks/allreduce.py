"""All-reduce benchmark: N real dedlocd processes average an S MiB float32 vector, round after round.

    python benchmarks/allreduce.py --peers 4 --mib 64 [--compression none] [--netlab hetero4] --json

Each daemon averages through the `averaging.average` RPC (a shared-memory buffer per peer, the
same code the collaboration uses). Prints one JSON object: `seconds_median` (wall time of a round,
from the calls to the last answer, matchmaking included), `allreduce_seconds_median` (the
all-reduce alone), `bound_seconds` (the load balancer's optimal time for the bandwidths: the
shaped ones with --netlab, else those the daemons measured), `ratio_to_bound`,
`uniform_seconds_median` (the same rounds with equal shares, with --compare-uniform), and
`MBps_per_peer`. The medians are over the timed rounds in which every peer answered.

A round fails when a peer's call errs or times out, a peer's group is not all N peers, a peer
reports failed_parts or senders_excluded, or (without compression) a full round's average is
wrong. A failed round is counted, not fatal: `failed_rounds` (warm-up included) and
`failed_timed_rounds`, and `per_round` lists each round's wall time, slowest all-reduce and
matchmaking, group sizes (size: peers), peers with failed parts or excluded senders, wrong
averages and errors. --keep keeps the daemons' state and logs; --profile runs each daemon under
cProfile (files in --profile-dir, kept; written when a daemon exits) and prints daemon 0's top 15
to stderr. With --netlab the peers run in network namespaces shaped by `tc` (root needed;
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
from collections import Counter
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collab import print_profile  # one copy, beside collab.py's own use
from netlab import NetLab, load_profile

MIB = 1 << 20
STARTING_AT_ONCE = 8  # daemons started together after the first
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
                 guesses: list[tuple[float, float]] | None, log_level: str = "warning",
                 profile_dir: Path | None = None) -> None:
        self.peers = peers
        self.log_level = log_level
        self.profile_dir = profile_dir
        self.workdir = workdir
        self.lab = lab
        self.balancing = balancing
        self.guesses = guesses
        self.processes: list[asyncio.subprocess.Process] = []
        self.sockets: list[Path] = []

    async def start(self) -> None:
        await self._start_one(0, None)
        info = await _wait_ready(self.sockets[0], self.processes[0], self.sockets[0].with_name("dedlocd.log"))
        host = self.lab.addresses[0] if self.lab else "127.0.0.1"
        bootstrap = next(a for a in info["addresses"]["p2p"] if f"/{host}/" in a)
        # A few at a time: 64 interpreters importing at once on 2 cores miss the 60 s readiness wait.
        for batch in range(1, self.peers, STARTING_AT_ONCE):
            indices = range(batch, min(batch + STARTING_AT_ONCE, self.peers))
            for index in indices:
                await self._start_one(index, bootstrap)
            await asyncio.gather(*(_wait_ready(self.sockets[i], self.processes[i],
                                               self.sockets[i].with_name("dedlocd.log")) for i in indices))
        await self._wait_joined()

    async def _start_one(self, index: int, bootstrap: str | None) -> None:
        root = self.workdir / f"{self.balancing}{index}"
        root.mkdir()
        host = self.lab.addresses[index] if self.lab else "127.0.0.1"
        argv = [sys.executable]
        if self.profile_dir is not None:
            argv += ["-m", "cProfile", "-o", str(self.profile_dir / f"{self.balancing}{index}.prof")]
        argv += ["-m", "dedloc.daemon", "--node.state_dir", str(root),
                 "--log.format", "json", "--log.level", self.log_level,
                 "--net.listen", f"/ip4/{host}/tcp/0", "--averaging.balancing", self.balancing]
        if self.guesses:
            up, down = self.guesses[index]
            argv += ["--averaging.upload_mbps", str(up), "--averaging.download_mbps", str(down)]
        if bootstrap:
            argv += ["--net.bootstrap", bootstrap]
        if self.lab:
            argv = self.lab.command(index, argv)
        handle = (root / "dedlocd.log").open("wb")
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=handle, stderr=handle)
        finally:
            handle.close()
        self.processes.append(process)
        self.sockets.append(root / "dedlocd.sock")

    async def _wait_joined(self, timeout: float = 120.0) -> None:
        """Until every daemon says it has joined the DHT (else matchmaking may miss some)."""
        from dedloc.rpc import JsonRpcClient

        joined: list[bool] = []
        try:
            async with asyncio.timeout(timeout):
                while True:
                    joined = []
                    for socket in self.sockets:
                        async with await JsonRpcClient.connect(socket) as client:
                            joined.append((await client.call("node.info"))["dht"]["joined"])
                    if all(joined):
                        return
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise RuntimeError(f"{joined.count(False)} of {self.peers} daemons had not joined the DHT "
                               f"within {timeout} s") from None

    async def round(self, key: str, buffers: list[shared_memory.SharedMemory], length: int,
                    compression: str, timeout: float) -> tuple[float, list[dict[str, Any] | BaseException]]:
        """The wall time and each peer's report, or the exception its call raised."""
        from dedloc.rpc import JsonRpcClient

        clients = [await JsonRpcClient.connect(s, default_timeout=timeout + 10) for s in self.sockets]
        try:
            started = time.perf_counter()
            reports = await asyncio.gather(*(
                client.call("averaging.average", {
                    "key": key, "buffer": shm.name, "length": length, "expected_peers": self.peers,
                    "compression": compression, "timeout": timeout, "window": 10.0})
                for client, shm in zip(clients, buffers, strict=True)), return_exceptions=True)
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


def check_round(index: int, wall: float, reports: list[dict[str, Any] | BaseException], peers: int,
                buffers: list[shared_memory.SharedMemory] | None, expected: np.ndarray) -> dict[str, Any]:
    """One round's record (see the module docstring); `buffers` to check the averages, else None."""
    answered = [r for r in reports if isinstance(r, dict)]
    errors = {str(i): f"{type(r).__name__}: {r}" for i, r in enumerate(reports)
              if isinstance(r, BaseException)}
    sizes = Counter(r["group_size"] for r in answered)
    failed_parts = sum(bool(r["failed_parts"]) for r in answered)
    excluded = sum(bool(r["senders_excluded"]) for r in answered)
    wrong = 0
    if buffers is not None and not errors and set(sizes) == {peers} and not failed_parts and not excluded:
        for shm in buffers:
            got = np.ndarray(len(expected), np.float32, shm.buf)
            wrong += not np.allclose(got, expected, rtol=1e-5, atol=1e-6)
    record: dict[str, Any] = {
        "round": index, "seconds": round(wall, 4),
        "allreduce_seconds_max": round(max((r["allreduce_seconds"] for r in answered), default=0.0), 4),
        "matchmaking_seconds_max": round(max((r["matchmaking_seconds"] for r in answered), default=0.0), 4),
        "group_sizes": {str(k): v for k, v in sorted(sizes.items())},
        "peers_with_failed_parts": failed_parts, "peers_with_senders_excluded": excluded,
        "wrong_averages": wrong, "errors": errors,
    }
    record["failed"] = bool(errors or set(sizes) != {peers} or failed_parts or excluded or wrong)
    if record["failed"]:  # the first few of what each peer said went wrong, for the log reader
        record["failures"] = [{"peer": i, "group_size": r["group_size"],
                               "failed_parts": r["failed_parts"][:4],
                               "senders_excluded": dict(list(r["senders_excluded"].items())[:4])}
                              for i, r in enumerate(reports)
                              if isinstance(r, dict) and (r["failed_parts"] or r["senders_excluded"])][:8]
    return record


async def run_dedloc(args: argparse.Namespace, lab: NetLab | None, workdir: Path,
                     profile_dir: Path | None) -> dict[str, Any]:
    length = args.mib * MIB // 4
    rng = np.random.default_rng(args.seed)
    originals = [rng.standard_normal(length, dtype=np.float32) for _ in range(args.peers)]
    expected = np.mean(originals, axis=0)
    profile = load_profile(args.netlab) if args.netlab else None
    guesses = [(p.upload_mbit, p.download_mbit) for p in profile] if profile and args.declare else None
    result: dict[str, Any] = {}
    modes = ["lp", "uniform"] if args.compare_uniform else ["lp"]
    for mode in modes:
        swarm = DedlocSwarm(args.peers, workdir, lab, mode, guesses, args.log_level, profile_dir)
        buffers = [shared_memory.SharedMemory(create=True, size=length * 4) for _ in range(args.peers)]
        records: list[dict[str, Any]] = []
        try:
            started = time.perf_counter()
            await swarm.start()
            result.setdefault("start_seconds", round(time.perf_counter() - started, 2))
            for index in range(args.warmup + args.rounds):
                for shm, original in zip(buffers, originals, strict=True):
                    np.ndarray(length, np.float32, shm.buf)[:] = original
                wall, reports = await swarm.round(f"bench/{mode}/{index}", buffers, length,
                                                  args.compression, args.timeout)
                record = check_round(index, wall, reports, args.peers,
                                     buffers if args.compression == "none" else None, expected)
                record["warmup"] = index < args.warmup
                records.append(record)
                if record["failed"]:
                    sys.stderr.write(f"{mode} round {index} failed: {orjson.dumps(record).decode()}\n")
            measured = await swarm.measured_bandwidth()
        finally:
            await swarm.close()
            for shm in buffers:
                shm.close()
                shm.unlink()
        prefix = "" if mode == "lp" else "uniform_"
        timed = [r for r in records if not r["warmup"] and not r["errors"]]
        result[f"{prefix}seconds_median"] = (round(statistics.median(r["seconds"] for r in timed), 4)
                                             if timed else None)
        result[f"{prefix}allreduce_seconds_median"] = (
            round(statistics.median(r["allreduce_seconds_max"] for r in timed), 4) if timed else None)
        result[f"{prefix}failed_rounds"] = sum(r["failed"] for r in records)
        result[f"{prefix}failed_timed_rounds"] = sum(r["failed"] for r in records if not r["warmup"])
        result[f"{prefix}per_round"] = records
        if mode == "lp":
            bandwidths = ([(p.upload_mbit * 1e6 / 8, p.download_mbit * 1e6 / 8) for p in profile]
                          if profile else measured)
            wire_bytes = length * WIRE_BYTES_PER_ELEMENT[args.compression]
            result["bound_seconds"] = round(bound_seconds(bandwidths, wire_bytes), 4)
            result["bandwidths_used_for_bound"] = "shaped" if profile else "measured"
    allreduce = result["allreduce_seconds_median"]
    result["ratio_to_bound"] = (round(allreduce / result["bound_seconds"], 3)
                                if allreduce and result.get("bound_seconds") else None)
    result["MBps_per_peer"] = round(args.mib * MIB / 1e6 / allreduce, 2) if allreduce else None
    if allreduce and result.get("uniform_allreduce_seconds_median"):
        result["adaptive_speedup_vs_uniform"] = round(
            result["uniform_allreduce_seconds_median"] / allreduce, 3)
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
    parser.add_argument("--log-level", default="warning", help="the daemons' log level")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' state dirs and logs")
    parser.add_argument("--profile", action="store_true",
                        help="run the daemons under cProfile; print daemon 0's top 15 to stderr")
    parser.add_argument("--profile-dir", type=Path, help="where the daemons' .prof files go (kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the only format)")
    args = parser.parse_args()
    profile_dir = None
    if args.profile:
        profile_dir = args.profile_dir or Path(tempfile.mkdtemp(prefix="dedloc-allreduce-prof-", dir="/tmp"))
        profile_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING)
    started = time.time()
    lab_context = NetLab(load_profile(args.netlab)) if args.netlab else contextlib.nullcontext()
    with lab_context as lab:
        if args.impl == "hivemind":
            from allreduce_hivemind import run_hivemind

            result = run_hivemind(args, lab)
        else:
            workdir = Path(tempfile.mkdtemp(prefix="dl-bench-", dir="/tmp"))
            try:
                result = asyncio.run(run_dedloc(args, lab, workdir, profile_dir))
            finally:
                if args.keep:
                    sys.stderr.write(f"the daemons' state and logs are in {workdir}\n")
                else:
                    shutil.rmtree(workdir, ignore_errors=True)
    summary = {"benchmark": "allreduce", "impl": args.impl, "peers": args.peers, "mib": args.mib,
               "compression": args.compression, "rounds": args.rounds, "netlab": args.netlab,
               "cpus": os.cpu_count(), **result, "total_seconds": round(time.time() - started, 1)}
    if profile_dir is not None:
        print_profile(profile_dir / "lp0.prof")
        sys.stderr.write(f"profiles of every daemon: {profile_dir}\n")
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")


if __name__ == "__main__":
    main()
