"""Collaborative-run benchmark: N real dedlocd daemons train the built-in `tiny` workload together.

    python benchmarks/collab.py --peers 4 [--aux M] --json [--epochs 15] [--target-batch-size 512]
                                [--batch-size 64] [--profile [--profile-dir DIR]]

Starts N daemons on 127.0.0.1 only (temporary state directories), waits until every one has joined
the DHT, starts the same collaborative run on all of them at once (min_peers N, no checkpoints, no
state averaging), waits until every run is "finished" and reads each daemon's `run.status`.

From each peer's `epoch_history` (the last 20 epochs; keep --epochs <= 20) it computes, for every
epoch that all peers stepped, the epoch overhead: max over peers of applied_at - min over peers of
target_reached_at (from the run reaching its target to every trainer having applied the step; one
machine, one clock). Epoch 0 (workers warming up) is reported apart (`first_epoch_*`) and left out
of the statistics ({p50, p90, max, mean}) of:
  epoch_overhead_seconds         the epoch overhead above
  peer_overhead_seconds          each peer's own overhead_seconds (applied_at - its target_reached_at)
  round_seconds                  each peer's averaging round, matchmaking included
  matchmaking_seconds            ... of which matchmaking (includes waiting for the last peer)
  allreduce_seconds              round_seconds - matchmaking_seconds
  local_step_seconds             overhead_seconds - round_seconds (gradient export, check, apply)
  target_reached_spread_seconds  max - min over peers of target_reached_at
`epochs_with_full_group` counts the epochs (0 included) in which every peer's round had all N
peers; `epochs_without_full_group` lists the others. `epoch_samples_over_target` is the mean of an
epoch's samples (all peers) over the target batch size (overshoot). `seconds` is the wall time from
the run.start calls to the last run finished (`run_start_seconds` of it until every run.start
answered: worker start-up); `run_samples_per_second` is every peer's samples over `seconds`, and
`steady_samples_per_second` the samples of epochs 1.. over the time from epoch 0 applied to the
last epoch applied. If a daemon's run.status lacks a field this needs, it fails naming the field.
With --aux M, M aux daemons (no worker) join the run by name and reduce in its rounds: a full
group is then N + M. `daemon_peak_rss_mb` and `worker_peak_rss_mb` ({max, mean}) are the peak
resident memory of each daemon and of each trainer's worker process, sampled every 0.5 s. A
worker's RSS counts torch's library pages, which all workers share (about 450 MB of ~900 MB);
`worker_peak_pss_mb` counts a worker's share of them instead, and
`total_peak_daemon_rss_worker_pss_mb` adds those to the daemons' RSS (nearer what N workers cost
together than `total_peak_rss_mb`).

Prints one JSON object (with --json, only that; without it a per-epoch table first).

--profile runs each daemon as `python -m cProfile -o DIR/dN.prof -m dedloc.daemon ...` (cProfile
writes the file when the daemon returns from main, after node.shutdown or SIGTERM; it profiles the
daemon's main thread only, not the worker processes that train, and it makes every exit code 0)
and prints daemon 0's top 15 functions by cumulative and by own time to stderr. The files are kept
in DIR (default: a new /tmp/dedloc-collab-prof-* directory); read them with `python -m pstats`.

Every daemon started is stopped (run.stop, node.shutdown, then its process group killed after
--stop-timeout), also on errors, Ctrl-C and SIGTERM, and the temporary directories are removed
(--keep keeps the daemons' state and logs).

--impl hivemind runs the same problem with hivemind.Optimizer instead (collab_hivemind.py, started
with the Python of .venv-hivemind: see --hivemind-python; its process group is stopped the same
way); --impl both runs dedloc, then hivemind, with the same settings and prints one object
{"benchmark", "peers", ..., "dedloc": {...}, "hivemind": {...}, "ratio_overhead",
"ratio_epoch_seconds", "ratio_epoch_seconds_p50"} (hivemind / dedloc). --epochs defaults to 15
for dedloc alone and to 10 otherwise. hivemind's run stops at --hivemind-max-seconds and then
reports what it recorded, with `timed_out` and `partial` set.

Metrics common to both (from each peer's applied epochs: dedloc's epoch_history, hivemind's
records), in both outputs:
  epoch_seconds                  {p50, p90, max, mean} over epochs >= 1 of the median over peers of
                                 the time between the peer's applications of epochs e-1 and e
  epoch_seconds_full_rounds      the same over the epochs e where every peer stepped e-1 and e in
                                 a round of all N trainers (`epochs_full_rounds_timed` of them)
  samples_per_epoch              mean samples of an epoch (all peers), over the epochs timed
  accumulate_samples_per_second  the steady throughput while accumulating: the sum over peers of a
                                 peer's samples in epochs >= 1 over its time spent accumulating
                                 them (from its step of e-1 to the end of its accumulation for e:
                                 dedloc's target_reached_at, hivemind's start of the opt.step()
                                 call that advanced the epoch)
  accumulate_seconds             samples_per_epoch / accumulate_samples_per_second
  overhead_seconds               epoch_seconds mean - accumulate_seconds: the part of an epoch not
                                 spent accumulating
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import pstats
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from dedloc.rpc import JsonRpcClient, RpcConnectionError, RpcError

RUN = "bench"
HOST = "127.0.0.1"
HISTORY = 20  # run.status keeps the last 20 epochs of epoch_history
STATUS_FIELDS = ("state", "epoch", "samples", "state_downloads", "failed_rounds", "epoch_history")
EPOCH_FIELDS = ("epoch", "samples", "stepped", "target_reached_at", "applied_at", "overhead_seconds",
                "group_size", "trainers", "round_seconds", "matchmaking_seconds")
ROOT = Path(__file__).resolve().parent.parent
HIVEMIND_SCRIPT = Path(__file__).resolve().with_name("collab_hivemind.py")
HIVEMIND_VENV_HINT = ("python -m venv .venv-hivemind && .venv-hivemind/bin/pip install hivemind==1.1.12 "
                      "torch==2.14.1 orjson")


class BenchmarkError(RuntimeError):
    """The benchmark cannot go on (a daemon died, the swarm did not form, a bad argument)."""


class Daemon:
    """One dedlocd process with its own state directory, listening on `host` (loopback, or a
    network namespace's address: `prefix` then wraps its command line, e.g. `ip netns exec`)."""

    def __init__(self, index: int, root: Path, process: asyncio.subprocess.Process, log: IO[bytes],
                 profile: Path | None, host: str = HOST) -> None:
        self.index = index
        self.root = root
        self.process = process
        self.log = log
        self.profile = profile
        self.host = host
        self.socket = root / "dedlocd.sock"

    @classmethod
    async def start(cls, index: int, root: Path, bootstrap: str | None, log_level: str,
                    profile_dir: Path | None = None, extra: tuple[str, ...] = (),
                    env: Mapping[str, str] | None = None, host: str = HOST,
                    prefix: Callable[[list[str]], list[str]] | None = None) -> Daemon:
        """`env`: variables added to this script's environment for the daemon (and its workers);
        `root` may exist already (e.g. holding the identity.key to start with)."""
        root.mkdir(parents=True, exist_ok=True)
        profile = profile_dir / f"d{index}.prof" if profile_dir else None
        argv = [sys.executable]
        if profile:
            argv += ["-m", "cProfile", "-o", str(profile)]
        argv += ["-m", "dedloc.daemon", "--node.state_dir", str(root), "--log.format", "json",
                 "--log.level", log_level, "--net.listen", f"/ip4/{host}/tcp/0"]
        if bootstrap:
            argv += ["--net.bootstrap", bootstrap]
        argv += extra
        if prefix is not None:
            argv = prefix(argv)
        log = (root / "dedlocd.log").open("wb")
        try:
            # A session of its own: a Ctrl-C in the terminal reaches only this script, which then
            # stops the daemons in order; a daemon that will not stop is killed with its workers.
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                env={**os.environ, **env} if env else None)
        except BaseException:
            log.close()
            raise
        return cls(index, root, process, log, profile, host)

    async def call(self, method: str, params: Any = None, timeout: float = 300.0) -> Any:
        async with await JsonRpcClient.connect(self.socket, default_timeout=timeout) as client:
            return await client.call(method, params)

    async def wait_serving(self, timeout: float = 60.0) -> dict[str, Any]:
        """node.info once the control socket answers and the DHT has started."""
        async with asyncio.timeout(timeout):
            while True:
                self.check_alive()
                with contextlib.suppress(RpcConnectionError):
                    info = await self.call("node.info")
                    if info["dht"]["mode"] != "starting":
                        return info
                await asyncio.sleep(0.1)

    def check_alive(self) -> None:
        if self.process.returncode is not None:
            raise BenchmarkError(f"daemon {self.index} exited with code {self.process.returncode}; "
                                 f"log:\n{self.log_tail()}")

    def p2p_address(self, info: dict[str, Any]) -> str:
        addresses = [a for a in info["addresses"]["p2p"] if f"/ip4/{self.host}/" in a]
        if not addresses:
            raise BenchmarkError(f"daemon {self.index} has no {self.host} address: "
                                 f"{info['addresses']['p2p']}")
        return addresses[0]

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = (self.root / "dedlocd.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self, timeout: float) -> int:
        """run.stop, node.shutdown, wait; kill the daemon's process group after the timeout."""
        if self.process.returncode is None:
            with contextlib.suppress(RpcError, OSError, TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.call("run.stop", {"name": RUN}, timeout=timeout)
            with contextlib.suppress(RpcError, OSError, TimeoutError):
                async with asyncio.timeout(10):
                    await self.call("node.shutdown", timeout=10)
            try:
                async with asyncio.timeout(timeout):
                    await self.process.wait()
            except TimeoutError:
                sys.stderr.write(f"daemon {self.index} did not stop within {timeout} s: killed\n")
        return await self.kill()

    async def kill(self) -> int:
        """Kill the daemon's process group at once (no orderly stop), wait for it."""
        # Its own session: whatever is left of its group (a worker) goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        self.log.close()
        assert self.process.returncode is not None
        return self.process.returncode


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "max": None, "mean": None}
    array = np.asarray(values, dtype=float)
    return {"p50": round(float(np.percentile(array, 50)), 4),
            "p90": round(float(np.percentile(array, 90)), 4),
            "max": round(float(array.max()), 4), "mean": round(float(array.mean()), 4)}


def check_fields(index: int, status: dict[str, Any]) -> None:
    for field in STATUS_FIELDS:
        if field not in status:
            raise BenchmarkError(f"daemon {index}: run.status has no field {field!r} "
                                 "(this benchmark needs a daemon that reports it)")
    for entry in status["epoch_history"]:
        for field in EPOCH_FIELDS:
            if field not in entry:
                raise BenchmarkError(f"daemon {index}: run.status epoch_history entry for epoch "
                                     f"{entry.get('epoch')} has no field {field!r}")


def summarize(statuses: list[dict[str, Any]], peers: int,
              target: int, group: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The result's numbers, and one row per epoch (for the table). `group`: the full round's
    size, trainers and aux peers; default `peers`."""
    group = peers if group is None else group
    for index, status in enumerate(statuses):
        check_fields(index, status)
    by_peer = [{e["epoch"]: e for e in s["epoch_history"]} for s in statuses]
    common = sorted(set.intersection(*(set(h) for h in by_peer)))
    if not common:
        raise BenchmarkError("no epoch is in every peer's epoch_history")
    rows = []
    for epoch in common:
        entries = [h[epoch] for h in by_peer]
        rows.append({
            "epoch": epoch,
            "overhead": max(e["applied_at"] for e in entries) - min(e["target_reached_at"] for e in entries),
            "target_spread": (max(e["target_reached_at"] for e in entries)
                              - min(e["target_reached_at"] for e in entries)),
            "peer_overheads": [e["overhead_seconds"] for e in entries],
            "rounds": [e["round_seconds"] for e in entries],
            "matchmaking": [e["matchmaking_seconds"] for e in entries],
            "allreduce": [e["round_seconds"] - e["matchmaking_seconds"] for e in entries],
            "local": [e["overhead_seconds"] - e["round_seconds"] for e in entries],
            "groups": [e["group_size"] for e in entries],
            "trainers": [e["trainers"] for e in entries],
            "stepped": all(e["stepped"] for e in entries),
            "samples": sum(e["samples"] for e in entries),
            "applied_last": max(e["applied_at"] for e in entries),
        })
    steady = [r for r in rows if r["epoch"] != 0]
    first = next((r for r in rows if r["epoch"] == 0), None)
    full = [r["epoch"] for r in rows if all(g == group for g in r["groups"])]
    steady_seconds = (steady[-1]["applied_last"] - first["applied_last"]) if first and steady else None
    result = {
        "epoch_overhead_seconds": stats([r["overhead"] for r in steady]),
        "peer_overhead_seconds": stats([v for r in steady for v in r["peer_overheads"]]),
        "round_seconds": stats([v for r in steady for v in r["rounds"]]),
        "matchmaking_seconds": stats([v for r in steady for v in r["matchmaking"]]),
        "allreduce_seconds": stats([v for r in steady for v in r["allreduce"]]),
        "local_step_seconds": stats([v for r in steady for v in r["local"]]),
        "target_reached_spread_seconds": stats([r["target_spread"] for r in steady]),
        "peer_overhead_mean_by_peer": [
            round(float(np.mean([h[e]["overhead_seconds"] for e in common if e != 0])), 4)
            if steady else None for h in by_peer],
        "epoch_samples_over_target": (round(float(np.mean([r["samples"] for r in steady])) / target, 3)
                                      if steady else None),
        "epochs_compared": len(rows),
        "epochs_with_full_group": len(full),
        "epochs_without_full_group": [r["epoch"] for r in rows if r["epoch"] not in full],
        "epochs_not_stepped": [r["epoch"] for r in rows if not r["stepped"]],
        "state_downloads": sum(s["state_downloads"] for s in statuses),
        "failed_rounds": sum(s["failed_rounds"] for s in statuses),
        "steady_samples_per_second": (round(sum(r["samples"] for r in steady) / steady_seconds, 1)
                                      if steady_seconds else None),
        "first_epoch_overhead_seconds": round(first["overhead"], 4) if first else None,
        "first_epoch_round_seconds": round(max(first["rounds"]), 4) if first else None,
    }
    return result, rows


def epoch_metrics(histories: list[list[dict[str, Any]]], peers: int) -> dict[str, Any]:
    """The metrics common to dedloc and hivemind (see the module docstring). `histories` holds, per
    peer, one entry per epoch it applied: epoch, applied_at, accumulate_end_at, samples, full (the
    step used a round of all `peers` trainers)."""
    by_peer = [{e["epoch"]: e for e in history} for history in histories]
    epochs = sorted({e for h in by_peer for e in h if e >= 1 and e - 1 in h})
    seconds, full_seconds, samples = [], [], []
    for epoch in epochs:
        timed = [h for h in by_peer if epoch in h and epoch - 1 in h]
        seconds.append(float(np.median([h[epoch]["applied_at"] - h[epoch - 1]["applied_at"] for h in timed])))
        samples.append(sum(h[epoch]["samples"] for h in by_peer if epoch in h))
        if len(timed) == peers and all(h[epoch]["full"] and h[epoch - 1]["full"] for h in timed):
            full_seconds.append(seconds[-1])
    rate = 0.0
    for h in by_peer:
        spans = [(h[e]["samples"], h[e]["accumulate_end_at"] - h[e - 1]["applied_at"])
                 for e in epochs if e in h and e - 1 in h]
        busy = sum(span for _, span in spans)
        if busy > 0:
            rate += sum(n for n, _ in spans) / busy
    epoch_seconds = stats(seconds)
    per_epoch = float(np.mean(samples)) if samples else None
    accumulate = per_epoch / rate if per_epoch is not None and rate > 0 else None
    overhead = (epoch_seconds["mean"] - accumulate
                if accumulate is not None and epoch_seconds["mean"] is not None else None)
    return {"epoch_seconds": epoch_seconds, "epochs_timed": len(seconds),
            "epoch_seconds_full_rounds": stats(full_seconds), "epochs_full_rounds_timed": len(full_seconds),
            "samples_per_epoch": round(per_epoch, 1) if per_epoch is not None else None,
            "accumulate_samples_per_second": round(rate, 1) if rate > 0 else None,
            "accumulate_seconds": round(accumulate, 4) if accumulate is not None else None,
            "overhead_seconds": round(overhead, 4) if overhead is not None else None}


def dedloc_histories(statuses: list[dict[str, Any]], peers: int) -> list[list[dict[str, Any]]]:
    return [[{"epoch": e["epoch"], "applied_at": e["applied_at"], "accumulate_end_at": e["target_reached_at"],
              "samples": e["samples"], "full": e["group_size"] == peers} for e in s["epoch_history"]]
            for s in statuses]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'epoch':>5} {'overhead':>9} {'spread':>7} {'peer max':>9} {'round max':>10} "
             f"{'mm max':>7} {'samples':>7}  groups"]
    for r in rows:
        lines.append(f"{r['epoch']:>5} {r['overhead']:>9.3f} {r['target_spread']:>7.3f} "
                     f"{max(r['peer_overheads']):>9.3f} {max(r['rounds']):>10.3f} "
                     f"{max(r['matchmaking']):>7.3f} {r['samples']:>7}  "
                     f"{','.join(str(g) for g in r['groups'])}")
    return "\n".join(lines) + "\n"


async def wait_finished(daemons: list[Daemon], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for daemon in daemons:
            daemon.check_alive()
            (status,) = await daemon.call("run.status", {"name": RUN})
            if status.get("state") in ("crashed", "failed", "stopped"):
                raise BenchmarkError(f"daemon {daemon.index}: the run is {status['state']}: "
                                     f"{status.get('error')}\nlog:\n{daemon.log_tail()}")
            states.append((status.get("state"), status.get("epoch")))
        if all(state == "finished" for state, _ in states):
            return
        if time.monotonic() > deadline:
            raise BenchmarkError(f"the runs did not finish within {timeout} s: (state, epoch) {states}")
        await asyncio.sleep(0.25)


AUX_ARGS = ("--node.role", "aux", "--averaging.upload_mbps", "10000", "--averaging.download_mbps",
            "10000")  # an aux peer states its link (loopback): it has measured nothing yet


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _pss_bytes(pid: int) -> int:
    """Proportional set size: private pages plus a share of those mapped by others too (a
    worker's RSS counts all of torch's shared library pages, which every worker maps)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


class MemorySampler:
    """The peak resident memory of each daemon and of its worker processes (its children),
    sampled every `interval` seconds while the run goes on."""

    def __init__(self, daemons: list[Daemon], interval: float = 0.5) -> None:
        self.daemons = daemons
        self.interval = interval
        self.daemon_peak = [0] * len(daemons)
        self.worker_peak = [0] * len(daemons)
        self.worker_peak_pss = [0] * len(daemons)

    def sample(self) -> None:
        for index, daemon in enumerate(self.daemons):
            pid = daemon.process.pid
            self.daemon_peak[index] = max(self.daemon_peak[index], _rss_bytes(pid))
            children = _children(pid)
            workers = [_rss_bytes(child) for child in children]
            if workers:
                self.worker_peak[index] = max(self.worker_peak[index], max(workers))
                pss = max(_pss_bytes(child) for child in children)
                self.worker_peak_pss[index] = max(self.worker_peak_pss[index], pss)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def result(self, trainers: int) -> dict[str, Any]:
        mib = 1024 * 1024
        daemons = [v / mib for v in self.daemon_peak if v]
        workers = [v / mib for v in self.worker_peak[:trainers] if v]
        pss = [v / mib for v in self.worker_peak_pss[:trainers] if v]
        return {
            "daemon_peak_rss_mb": {"max": round(max(daemons), 1) if daemons else None,
                                   "mean": round(float(np.mean(daemons)), 1) if daemons else None},
            "worker_peak_rss_mb": {"max": round(max(workers), 1) if workers else None,
                                   "mean": round(float(np.mean(workers)), 1) if workers else None},
            "worker_peak_pss_mb": {"max": round(max(pss), 1) if pss else None,
                                   "mean": round(float(np.mean(pss)), 1) if pss else None},
            "total_peak_rss_mb": round(sum(daemons) + sum(workers), 1),
            "total_peak_daemon_rss_worker_pss_mb": round(sum(daemons) + sum(pss), 1),
        }


async def _start_aux(daemon: Daemon, timeout: float = 120.0) -> None:
    """run.start by name on an aux daemon, once the trainers' manifest is in the DHT."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await daemon.call("run.start", {"name": RUN})
            return
        except RpcError as exc:
            if "no peer publishes" not in str(exc) or time.monotonic() > deadline:
                raise BenchmarkError(f"aux daemon {daemon.index} could not join: {exc}") from None
        await asyncio.sleep(0.5)


async def benchmark(args: argparse.Namespace, workdir: Path, profile_dir: Path | None) -> dict[str, Any]:
    daemons: list[Daemon] = []
    codes: list[int] = []
    sampler: asyncio.Task[None] | None = None
    memory = MemorySampler(daemons)
    try:
        daemons.append(await Daemon.start(0, workdir / "d0", None, args.log_level, profile_dir))
        bootstrap = daemons[0].p2p_address(await daemons[0].wait_serving())
        daemons += await asyncio.gather(*(
            Daemon.start(i, workdir / f"d{i}", bootstrap, args.log_level, profile_dir,
                         AUX_ARGS if i >= args.peers else ())
            for i in range(1, args.peers + args.aux)))
        await asyncio.gather(*(d.wait_serving() for d in daemons[1:]))
        memory = MemorySampler(daemons)
        sampler = asyncio.create_task(memory.run())
        trainers, aux = daemons[:args.peers], daemons[args.peers:]
        infos: list[dict[str, Any]] = []
        try:
            async with asyncio.timeout(60):
                while True:
                    infos = await asyncio.gather(*(d.call("node.info") for d in daemons))
                    if all(info["dht"]["joined"] for info in infos):
                        break
                    for d in daemons:
                        d.check_alive()
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise BenchmarkError(f"not every daemon joined the DHT within 60 s: "
                                 f"{[info['dht'] for info in infos]}") from None
        params = {"workload": "tiny", "name": RUN, "collaborative": True, "min_peers": args.peers,
                  "epochs": args.epochs, "target_batch_size": args.target_batch_size,
                  "config": {"batch_size": args.batch_size}, "checkpoint_every": 0,
                  "average_state_every": 0}
        started = time.time()
        if aux:  # the aux peers first follow the run (min_peers keeps one trainer from stepping)
            await trainers[0].call("run.start", params)
            await asyncio.gather(*(_start_aux(d) for d in aux))
            await asyncio.gather(*(d.call("run.start", params) for d in trainers[1:]))
        else:
            await asyncio.gather(*(d.call("run.start", params) for d in trainers))
        start_seconds = time.time() - started
        await wait_finished(trainers, args.max_seconds)
        seconds = time.time() - started
        statuses = [(await d.call("run.status", {"name": RUN}))[0] for d in trainers]
        result, rows = summarize(statuses, args.peers, args.target_batch_size,
                                 group=args.peers + args.aux)
        result.update(epoch_metrics(dedloc_histories(statuses, args.peers + args.aux), args.peers))
        samples = sum(s["samples"] for s in statuses)
    finally:
        if sampler is not None:
            sampler.cancel()
        codes = list(await asyncio.shield(asyncio.gather(*(d.stop(args.stop_timeout) for d in daemons))))
    if not args.json:
        sys.stdout.write(table(rows))
    return {**result, "samples": samples, "seconds": round(seconds, 2),
            "run_start_seconds": round(start_seconds, 2),
            "run_samples_per_second": round(samples / seconds, 1), "daemon_exit_codes": codes,
            "aux": args.aux, **memory.result(args.peers)}


def hivemind_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'epoch':>5} {'seconds':>8} {'spread':>7} {'step max':>9} {'samples':>7}  "
             "stepped(group) alone skipped"]
    for r in rows:
        stepped = ",".join(f"{i}({g})" for i, g in zip(r["stepped"], r["group_sizes"], strict=True))
        seconds = f"{r['seconds']:>8.3f}" if r["seconds"] is not None else f"{'-':>8}"
        spread = f"{r['applied_spread']:>7.3f}" if r["applied_spread"] is not None else f"{'-':>7}"
        step = f"{r['step_seconds_max']:>9.3f}" if r["step_seconds_max"] is not None else f"{'-':>9}"
        lines.append(f"{r['epoch']:>5} {seconds} {spread} {step} {r['samples']:>7}  {stepped or '-'} "
                     f"{','.join(map(str, r['alone'])) or '-'} {','.join(map(str, r['skipped'])) or '-'}")
    return "\n".join(lines) + "\n"


async def stop_driver(process: asyncio.subprocess.Process, timeout: float) -> None:
    """SIGTERM the hivemind driver (it stops its peers), wait, then kill what is left of its group."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                await process.wait()
        except TimeoutError:
            sys.stderr.write(f"the hivemind driver did not stop within {timeout} s: killed\n")
    # The driver runs in a session of its own: anything left in its process group is ours.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


async def benchmark_hivemind(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """collab_hivemind.py under .venv-hivemind's Python; its result plus the common metrics."""
    out, log_path = workdir / "hivemind.json", workdir / "hivemind.log"
    argv = [str(args.hivemind_python), str(HIVEMIND_SCRIPT), "--peers", str(args.peers),
            "--epochs", str(args.epochs), "--target-batch-size", str(args.target_batch_size),
            "--batch-size", str(args.batch_size), "--max-seconds", str(args.hivemind_max_seconds),
            "--out", str(out)]
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    try:
        # DHTs and optimizers starting, training, stopping: give the first and the last 5 minutes.
        async with asyncio.timeout(args.hivemind_max_seconds + 300):
            code = await process.wait()
    except TimeoutError:
        raise BenchmarkError(f"the hivemind run did not end within {args.hivemind_max_seconds + 300} s; "
                             f"log:\n{tail(log_path)}") from None
    finally:
        await asyncio.shield(stop_driver(process, args.stop_timeout))
    if code != 0 or not out.exists():
        raise BenchmarkError(f"the hivemind run failed (exit code {code}); log:\n{tail(log_path)}")
    raw = orjson.loads(out.read_bytes())
    histories = [[{**e, "full": e["round"] == "full"} for e in h] for h in raw.pop("histories")]
    raw.pop("downloads")
    rows = raw.pop("rows")
    if not args.json:
        sys.stdout.write("hivemind:\n" + hivemind_table(rows))
    per_epoch = [{k: r[k] for k in ("epoch", "seconds", "stepped", "group_sizes", "rounds", "alone",
                                    "skipped", "samples")} for r in rows]
    return {**raw, **epoch_metrics(histories, args.peers), "per_epoch": per_epoch}


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 2)


def print_profile(path: Path, top: int = 15) -> None:
    if not path.exists():
        sys.stderr.write(f"no profile was written at {path}\n")
        return
    out = io.StringIO()
    profile = pstats.Stats(str(path), stream=out)
    profile.sort_stats("cumulative").print_stats(top)
    profile.sort_stats("tottime").print_stats(top)
    sys.stderr.write(f"daemon 0's profile ({path}), top {top} by cumulative and by own time:\n"
                     f"{out.getvalue()}")


async def main_async(args: argparse.Namespace, workdir: Path,
                     profile_dir: Path | None) -> dict[str, dict[str, Any]]:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # stop the daemons as on Ctrl-C
    results: dict[str, dict[str, Any]] = {}
    try:
        if args.impl in ("dedloc", "both"):
            results["dedloc"] = await benchmark(args, workdir, profile_dir)
        if args.impl in ("hivemind", "both"):
            results["hivemind"] = await benchmark_hivemind(args, workdir)
        return results
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["dedloc", "hivemind", "both"], default="dedloc",
                        help="dedloc daemons, hivemind.Optimizer (collab_hivemind.py), or both in turn")
    parser.add_argument("--peers", type=int, default=4, help="trainers")
    parser.add_argument("--aux", type=int, default=0,
                        help="aux daemons (no worker: they only reduce), besides the trainers")
    parser.add_argument("--epochs", type=int,
                        help=f"default 15 (dedloc), 10 (hivemind, both); run.status keeps the last "
                             f"{HISTORY} epochs: more leave out the first")
    parser.add_argument("--target-batch-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64, help="the tiny workload's batch_size")
    parser.add_argument("--max-seconds", type=float, default=600.0,
                        help="give up on the dedloc run after this long")
    parser.add_argument("--hivemind-max-seconds", type=float, default=300.0,
                        help="stop the hivemind run after this long and report what it recorded")
    parser.add_argument("--hivemind-python", type=Path, default=ROOT / ".venv-hivemind" / "bin" / "python",
                        help="a Python with hivemind 1.1.12 (default: .venv-hivemind's)")
    parser.add_argument("--stop-timeout", type=float, default=60.0,
                        help="seconds to wait for a daemon to stop before killing it")
    parser.add_argument("--log-level", default="warning", help="the daemons' log level")
    parser.add_argument("--profile", action="store_true",
                        help="run the daemons under cProfile; print daemon 0's top 15 to stderr")
    parser.add_argument("--profile-dir", type=Path, help="where dN.prof go (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' state dirs and logs")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    # Each worker's memory is measured here: a worker forked from a zygote (plugins/worker/
    # zygote.py) would be measured through its stand-in and share the zygote's pages.
    os.environ.pop("DEDLOC_WORKER_ZYGOTE", None)
    if args.epochs is None:
        args.epochs = 15 if args.impl == "dedloc" else 10
    if args.peers < 1 or args.epochs < 1:
        parser.error("--peers and --epochs must be at least 1")
    if args.impl == "hivemind" and args.profile:
        parser.error("--profile profiles dedloc's daemons: not with --impl hivemind")
    if args.impl != "dedloc" and not args.hivemind_python.exists():
        sys.stderr.write(f"collab benchmark: no Python for hivemind at {args.hivemind_python}; create "
                         f"the environment (in {ROOT}) with\n  {HIVEMIND_VENV_HINT}\n"
                         "or pass --hivemind-python\n")
        return 2
    if args.epochs > HISTORY and args.impl != "hivemind":
        sys.stderr.write(f"note: run.status keeps the last {HISTORY} epochs; epoch 0 and the first "
                         f"{args.epochs - HISTORY} will be missing\n")
    profile_dir = None
    if args.profile:
        profile_dir = args.profile_dir or Path(tempfile.mkdtemp(prefix="dedloc-collab-prof-", dir="/tmp"))
        profile_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="dl-collab-", dir="/tmp"))
    try:
        results = asyncio.run(main_async(args, workdir, profile_dir))
    except (BenchmarkError, RpcError, OSError, TimeoutError) as exc:
        sys.stderr.write(f"collab benchmark failed: {exc}\n")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.stderr.write("collab benchmark interrupted; the daemons were stopped\n")
        return 130
    finally:
        if args.keep:
            sys.stderr.write(f"the daemons' state and logs are in {workdir}\n")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    common = {"benchmark": "collab", "peers": args.peers, "epochs": args.epochs,
              "target_batch_size": args.target_batch_size, "batch_size": args.batch_size,
              "cpus": os.cpu_count()}
    if args.impl == "both":
        dedloc, hivemind = results["dedloc"], results["hivemind"]
        summary = {**common, "profiled": args.profile, "dedloc": dedloc, "hivemind": hivemind,
                   "hivemind_partial": hivemind["partial"],
                   "ratio_overhead": ratio(hivemind["overhead_seconds"], dedloc["overhead_seconds"]),
                   "ratio_epoch_seconds": ratio(hivemind["epoch_seconds"]["mean"],
                                                dedloc["epoch_seconds"]["mean"]),
                   "ratio_epoch_seconds_p50": ratio(hivemind["epoch_seconds"]["p50"],
                                                    dedloc["epoch_seconds"]["p50"])}
    elif args.impl == "hivemind":
        summary = {**common, "impl": "hivemind", **results["hivemind"]}
    else:
        summary = {**common, "impl": "dedloc", "profiled": args.profile, **results["dedloc"]}
    if profile_dir is not None:
        print_profile(profile_dir / "d0.prof")
        sys.stderr.write(f"profiles of every daemon: {profile_dir}\n")
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
