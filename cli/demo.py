"""`make demo`: a real local collaboration on the built-in defaults, end to end.

Starts three trainer daemons and one aux daemon on loopback (temporary state directories). The
trainers train the built-in `tiny` workload in one collaborative run: they average gradients at the
run's target batch and step together; the aux daemon has no worker, finds the run by its name in
the DHT and lends its bandwidth to every round as a reducer. Midway a fourth trainer joins by the
run's name only, downloads the run's state from a peer and takes part. The demo shows the run's
progress and what it still waits to see, stops everything it started, and prints a one-line JSON
summary as its last line. It ends when it has shown all of it, however fast this machine trains
(no fixed deadline); it gives up only when nothing moved for a while, and says what it waited for.
Exit code 0 only if the loss went down and the newcomer took part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import orjson

from dedloc.rpc import JsonRpcClient, RpcCallError, RpcConnectionError, RpcError

from .render import render_status

RUN = "demo"
# Per workload: its small preset, a target batch that makes an epoch take about a second on a
# laptop's CPU, and how far the epoch loss must fall (a fraction of the first epoch's) to finish.
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"config": {}, "target_batch_size": 512, "drop": 0.5},
    "albert": {"config": {"preset": "albert-tiny"}, "target_batch_size": 128, "drop": 0.9},
    "swav": {"config": {"preset": "resnet18", "crops": "2,2", "crop_sizes": "64,32", "batch_size": 8,
                        "synthetic_size": 80, "prototypes": 64, "feature_dim": 16,
                        "queue_length": 0, "freeze_prototypes_steps": 0, "warmup_steps": 0,
                        "total_steps": 2000},
             "target_batch_size": 32, "drop": 0.9},
}


class StallWatch:
    """When to give up: only when nothing moved for a while, never on a fixed deadline (the
    demo's epochs take 0.1 s on one machine and 20 s on another). The window is `minimum`
    seconds, or 5 times the longest gap between two moves seen so far, whichever is longer."""

    def __init__(self, minimum: float) -> None:
        self.minimum = minimum
        self._last: Any = None
        self._moved_at = time.monotonic()
        self._longest_gap = 0.0

    def observe(self, now: float, value: Any) -> None:
        if value != self._last:
            if self._last is not None:
                self._longest_gap = max(self._longest_gap, now - self._moved_at)
            self._last, self._moved_at = value, now

    def window(self, now: float) -> float:
        return now - self._moved_at

    def stalled(self, now: float) -> bool:
        return self.window(now) > max(self.minimum, 5 * self._longest_gap)


def waiting_for(status: dict[str, Any], late: dict[str, Any] | None, args: argparse.Namespace,
                drop: float) -> list[str]:
    """What the demo still waits to see, in words (empty: it has shown everything)."""
    waiting = []
    losses = status["epoch_losses"]
    if len(losses) < args.min_epochs:
        waiting.append(f"{args.min_epochs} epochs (at {len(losses)})")
    if not losses or losses[-1] > drop * losses[0]:
        now = f"{losses[-1] / losses[0]:.2f}" if losses and losses[0] else "-"
        waiting.append(f"the loss at {drop:g} of the first epoch's (now {now})")
    if late is None:
        waiting.append(f"epoch {args.join_epoch}, when a fourth trainer joins")
    else:
        if not late["state_downloads"]:
            waiting.append("the newcomer's state download")
        if (late["last_round"] or {}).get("senders") != args.peers + 1:
            waiting.append(f"a round of all {args.peers + 1} trainers with the newcomer in it")
    return waiting


class DemoPeer:
    def __init__(self, root: Path, process: asyncio.subprocess.Process, log: IO[bytes]) -> None:
        self.root = root
        self.process = process
        self.log = log

    @classmethod
    async def start(cls, root: Path, bootstrap: str | None, role: str = "trainer") -> DemoPeer:
        root.mkdir(parents=True)
        argv = [sys.executable, "-m", "dedloc.daemon", "--node.state_dir", str(root),
                "--log.format", "json", "--net.listen", "/ip4/127.0.0.1/tcp/0", "--node.role", role]
        if role == "aux":  # its operator states its link's speed (loopback here); see docs/collaboration.md
            argv += ["--averaging.upload_mbps", "10000", "--averaging.download_mbps", "10000"]
        if bootstrap:
            argv += ["--net.bootstrap", bootstrap]
        log = (root / "dedlocd.log").open("wb")
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        peer = cls(root, process, log)
        async with asyncio.timeout(60):
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"dedlocd exited with code {process.returncode} at start-up; "
                                       f"see {root / 'dedlocd.log'}")
                with contextlib.suppress(RpcConnectionError):
                    info = await peer.call("node.info")
                    if info["dht"]["joined"] or (bootstrap is None and info["dht"]["mode"] != "starting"):
                        return peer
                await asyncio.sleep(0.1)

    async def call(self, method: str, params: Any = None) -> Any:
        async with await JsonRpcClient.connect(self.root / "dedlocd.sock", default_timeout=300) as client:
            return await client.call(method, params)

    async def join(self, progress: StallWatch) -> dict[str, Any]:
        """run.start with only the run's name: the manifest comes from the peers, via the DHT
        (retried while the run's record is not there yet, until `progress` says it stalled)."""
        while True:
            try:
                return await self.call("run.start", {"name": RUN})
            except RpcCallError as exc:
                if "no peer publishes" not in exc.message or progress.stalled(time.monotonic()):
                    raise
            await asyncio.sleep(0.2)

    async def status(self) -> dict[str, Any]:
        (status,) = await self.call("run.status", {"name": RUN})
        return status

    async def stop(self) -> int:
        with contextlib.suppress(RpcError):
            await self.call("node.shutdown")
        try:
            async with asyncio.timeout(60):
                code = await self.process.wait()
        except TimeoutError:
            self.process.kill()
            code = await self.process.wait()
        self.log.close()
        return code


async def demo(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    started = time.monotonic()
    peers: list[DemoPeer] = []
    helpers: list[DemoPeer] = []
    newcomer: DemoPeer | None = None
    try:
        peers.append(await DemoPeer.start(workdir / "peer0", None))
        info = await peers[0].call("node.info")
        bootstrap = info["addresses"]["p2p"][0]
        peers += await asyncio.gather(*(DemoPeer.start(workdir / f"peer{i}", bootstrap)
                                        for i in range(1, args.peers)))
        helpers += await asyncio.gather(*(DemoPeer.start(workdir / f"aux{i}", bootstrap, role="aux")
                                          for i in range(args.aux)))
        sys.stdout.write(f"{args.peers} trainer daemons and {args.aux} aux daemon(s) up; "
                         f"bootstrap peer {bootstrap}\n")
        preset = WORKLOADS[args.workload]
        params = {"workload": args.workload, "config": preset["config"], "name": RUN,
                  "target_batch_size": args.target_batch_size or preset["target_batch_size"],
                  "collaborative": True, "min_peers": args.peers, "checkpoint_every": 0}
        # The first trainer publishes the run (it cannot step alone: min_peers), the aux daemons
        # join it by name, then the other trainers start: the aux is in the rounds from the first.
        await peers[0].call("run.start", params)
        joining = StallWatch(args.stall_seconds)
        await asyncio.gather(*(helper.join(joining) for helper in helpers))
        await asyncio.gather(*(peer.call("run.start", params) for peer in peers[1:]))
        tty = sys.stdout.isatty()
        drawn = 0
        progress = StallWatch(args.stall_seconds)
        drop = args.drop or preset["drop"]
        while True:
            status = await peers[0].status()
            late = await newcomer.status() if newcomer is not None else None
            if status["state"] != "running":
                raise RuntimeError(f"the run stopped: {status['state']} {status.get('error')}")
            waiting = waiting_for(status, late, args, drop)
            text = render_status(status)
            if late is not None:
                text += (f"\n  newcomer: epoch {late['epoch']}, {late['state_downloads']} state "
                         f"download(s), last round of {(late['last_round'] or {}).get('senders')} "
                         "trainers")
            text += "\n  waiting for: " + ("; ".join(waiting) or "nothing (done)") + "\n"
            sys.stdout.write((f"\x1b[{drawn}F\x1b[J" if tty and drawn else "") + text)
            sys.stdout.flush()
            drawn = text.count("\n")
            if not waiting:
                break
            if newcomer is None and status["epoch"] >= args.join_epoch:
                newcomer = await DemoPeer.start(workdir / "newcomer", bootstrap)
                await newcomer.join(progress)
                sys.stdout.write("a fourth trainer joined the run by its name\n")
                drawn = 0
            now = time.monotonic()
            progress.observe(now, (status["epoch"], late["epoch"] if late else -1,
                                   late["state_downloads"] if late else -1))
            if progress.stalled(now):
                raise RuntimeError(f"no progress for {progress.window(now):.0f} s while waiting for: "
                                   + "; ".join(waiting))
            if args.max_seconds and now - started > args.max_seconds:
                raise RuntimeError(f"--max-seconds {args.max_seconds:g} passed while waiting for: "
                                   + "; ".join(waiting))
            await asyncio.sleep(0.5)
        trainers = [*peers, newcomer]
        statuses = [await peer.status() for peer in trainers]
        aux_statuses = [await helper.status() for helper in helpers]
        await asyncio.gather(*(peer.call("run.stop", {"name": RUN}) for peer in [*trainers, *helpers]))
    finally:
        codes = [await peer.stop() for peer in [*peers, *helpers, *([newcomer] if newcomer else [])]]
    losses = statuses[0]["epoch_losses"]
    overheads = [e["overhead_seconds"] for s in statuses for e in s["epoch_history"]]
    return {
        "peers": len(trainers),
        "aux": len(helpers),
        "epochs": max(s["epoch"] for s in statuses),
        "samples": sum(s["samples"] for s in statuses),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "joined": 1 if statuses[-1]["state_downloads"] else 0,  # the newcomer caught up by download
        "resyncs": sum(s["state_downloads"] for s in statuses[:-1]),  # others after a failed round
        "aux_rounds": sum(s["rounds"] for s in aux_statuses),
        "median_epoch_overhead_seconds": (round(sorted(overheads)[len(overheads) // 2], 3)
                                          if overheads else None),
        "seconds": round(time.monotonic() - started, 1),
        "daemon_exit_codes": codes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc-demo", description=__doc__)
    parser.add_argument("--peers", type=int, default=3, help="trainers at the start")
    parser.add_argument("--aux", type=int, default=1, help="aux daemons (no worker; they reduce)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                        help="what to train (the small preset of each)")
    parser.add_argument("--target-batch-size", type=int, default=0, help="0: the workload's default")
    parser.add_argument("--join-epoch", type=int, default=4, help="when the fourth trainer joins")
    parser.add_argument("--min-epochs", type=int, default=8)
    parser.add_argument("--drop", type=float, default=0.0,
                        help="finish once the epoch loss is this fraction of the first epoch's")
    parser.add_argument("--stall-seconds", type=float, default=120,
                        help="give up when nothing moved for this long (or 5 times the longest "
                             "gap between two epochs so far, if longer)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="give up after this long in all (0: never; the demo ends when done)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dedloc-demo-", dir="/tmp"))
    try:
        summary = asyncio.run(demo(args, workdir))
    except (RuntimeError, TimeoutError, OSError, RpcError) as exc:
        sys.stderr.write(f"demo failed: {exc}\nthe daemons' logs are in {workdir}\n")
        return 1
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return 0 if all(code == 0 for code in summary["daemon_exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
