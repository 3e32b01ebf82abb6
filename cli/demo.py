"""`make demo`: a real local run on the built-in defaults, end to end.

Starts a dedlocd on a temporary state directory, starts the built-in `tiny` workload through the
control API, shows its progress until the loss has clearly dropped, stops everything, and prints
a one-line JSON summary as its last line. Exit code 0 only if the loss dropped.
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

from dedloc.rpc import JsonRpcClient, RpcConnectionError, RpcError

from .render import render_status


async def _connect(socket: Path, daemon: asyncio.subprocess.Process, timeout: float) -> JsonRpcClient:
    async with asyncio.timeout(timeout):
        while True:
            if daemon.returncode is not None:
                raise RuntimeError(f"dedlocd exited with code {daemon.returncode} during start-up")
            try:
                return await JsonRpcClient.connect(socket, default_timeout=300)
            except RpcConnectionError:
                await asyncio.sleep(0.1)


async def demo(args: argparse.Namespace, workdir: Path, log_file: IO[bytes]) -> dict[str, Any]:
    log_path = Path(log_file.name)
    started = time.monotonic()
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dedloc.daemon", "--node.state_dir", str(workdir / "state"),
        "--node.runtime_dir", str(workdir), "--log.format", "json",
        "--net.listen", "/ip4/127.0.0.1/tcp/0",
        stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    try:
        client = await _connect(workdir / "dedlocd.sock", daemon, timeout=60)
        async with client:
            info = await client.call("node.info")
            sys.stdout.write(f"dedlocd {info['version']} is up: peer {info['peer_id']}\n"
                             f"  log: {log_path}\n")
            status = await client.call("run.start", {
                "workload": args.workload, "target_batch_size": args.target_batch_size,
                "checkpoint_every": 0})
            sys.stdout.write(f"started run {status['name']!r}: {status['parameters']} parameters "
                             f"on {status['device']}\n")
            status = await _follow(client, status["name"], args)
            await client.call("run.stop", {"name": status["name"]})
            await client.call("node.shutdown")
        async with asyncio.timeout(60):
            code = await daemon.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            daemon.kill()
        await daemon.wait()
        raise
    losses = status["epoch_losses"]
    return {
        "peers": 1,
        "samples": status["samples"],
        "epochs": status["epoch"],
        "loss_first": round(losses[0] if losses else status["loss_first"], 4),
        "loss_last": round(losses[-1] if losses else status["loss"], 4),
        "seconds": round(time.monotonic() - started, 1),
        "daemon_exit_code": code,
    }


async def _follow(client: JsonRpcClient, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Show progress until the per-epoch loss has fallen to `args.drop` of its first value."""
    deadline = time.monotonic() + args.max_seconds
    tty = sys.stdout.isatty()
    while True:
        (status,) = await client.call("run.status", {"name": name})
        text = render_status(status)
        sys.stdout.write(("\x1b[2F\x1b[J" if tty and status["samples"] else "") + text)
        sys.stdout.flush()
        losses = status["epoch_losses"]
        if status["state"] != "running":
            raise RuntimeError(f"the run stopped: {status['state']} {status.get('error')}")
        if len(losses) >= args.min_epochs and losses[-1] <= args.drop * losses[0]:
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"the loss did not drop to {args.drop:.0%} within {args.max_seconds} s")
        await asyncio.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc-demo", description=__doc__)
    parser.add_argument("--workload", default="tiny")
    parser.add_argument("--target-batch-size", type=int, default=128)
    parser.add_argument("--drop", type=float, default=0.5,
                        help="stop when the epoch loss is this fraction of the first epoch's")
    parser.add_argument("--min-epochs", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=300)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dedloc-demo-", dir="/tmp"))
    log_path = workdir / "dedlocd.log"
    try:
        with open(log_path, "wb") as log_file:
            summary = asyncio.run(demo(args, workdir, log_file))
    except (RuntimeError, TimeoutError, OSError, RpcError) as exc:
        tail = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.exists() else []
        sys.stderr.write(f"demo failed: {exc}\nthe daemon's log ({log_path}) ends with:\n"
                         + "".join(f"  {line}\n" for line in tail))
        return 1
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return 0 if summary["daemon_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
