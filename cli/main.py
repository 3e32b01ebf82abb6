"""`dedloc`: the command-line client of a running dedlocd (a thin layer over its JSON-RPC API)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from dedloc import __version__
from dedloc.rpc import JsonRpcClient, RpcCallError, RpcConnectionError, RpcError

from .render import render_info, render_peers, render_status, render_workloads

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
SYSTEMD_SOCKET = Path("/run/dedlocd/dedlocd.sock")
ACTIVE_STATES = ("starting", "running", "stopping")
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, then erase the whole screen


def default_socket() -> Path:
    """$DEDLOC_SOCKET, else the system service's socket if it exists, else the per-user one."""
    if os.environ.get("DEDLOC_SOCKET"):
        return Path(os.environ["DEDLOC_SOCKET"])
    if SYSTEMD_SOCKET.exists():
        return SYSTEMD_SOCKET
    state = Path(os.environ.get("STATE_DIRECTORY") or Path.home() / ".local" / "state" / "dedloc")
    return state / "dedlocd.sock"


def parse_assignment(text: str) -> tuple[str, Any]:
    """`key=value`; the value is read as JSON when it parses (numbers, true, lists), else text."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return key.strip(), value


DEVICE_HELP = '"auto", "cpu", "cuda", "cuda:N", a list like "cuda:0,cuda:1", or "cuda:all"'


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dedloc", description="Control a dedloc peer daemon.")
    parser.add_argument("--socket", type=Path, default=None,
                        help="the daemon's control socket (default: $DEDLOC_SOCKET, "
                             f"{SYSTEMD_SOCKET} if present, else ~/.local/state/dedloc/dedlocd.sock)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON answer")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for an answer")
    parser.add_argument("--version", action="version", version=f"dedloc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("info", help="this node: peer id, version, addresses, runs")
    commands.add_parser("peers", help="peers this node has a link to")
    connect = commands.add_parser("connect", help="open a link to a peer")
    connect.add_argument("address", help="/ip4/HOST/tcp/PORT/p2p/PEER_ID")
    commands.add_parser("workloads", help="installed workloads and their config")
    start = commands.add_parser("start", help="start training a workload")
    start.add_argument("workload")
    start.add_argument("--name", help="run name (default: the workload's name)")
    start.add_argument("--set", dest="config", action="append", type=parse_assignment, default=[],
                       metavar="KEY=VALUE", help="a workload config value (repeatable)")
    start.add_argument("--target-batch-size", type=int, help="samples per optimizer step")
    start.add_argument("--epochs", type=int, help="stop after this many epochs")
    start.add_argument("--checkpoint-every", type=int, help="checkpoint every N epochs")
    start.add_argument("--device", help=DEVICE_HELP)
    start.add_argument("--collaborative", action="store_true",
                       help="train together with the peers running the same run")
    start.add_argument("--min-peers", type=int, help="no step before this many trainers take part")
    start.add_argument("--average-state-every", type=int,
                       help="average parameters and optimizer state every K epochs (0: never)")
    start.add_argument("--compression", choices=("none", "fp16", "uint8", "quantile8"),
                       help="compression of the gradients in averaging rounds")
    join = commands.add_parser("join", help="join the collaborative run of that name (its manifest "
                                            "comes from the peers)")
    join.add_argument("name")
    join.add_argument("--aux", action="store_true",
                      help="as an aux peer: no worker, it reduces in the run's rounds")
    join.add_argument("--device", help=DEVICE_HELP)
    join.add_argument("--checkpoint-every", type=int, help="checkpoint every N epochs")
    status = commands.add_parser("status", help="progress of the runs")
    status.add_argument("name", nargs="?")
    status.add_argument("--watch", action="store_true",
                        help="keep showing live progress (until Ctrl-C, or until no run is active)")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    for verb, text in (("stop", "stop a run (checkpointed)"),
                       ("restart", "restart a stopped or crashed run")):
        sub = commands.add_parser(verb, help=text)
        sub.add_argument("name", nargs="?")
    commands.add_parser("shutdown", help="stop the daemon")
    call = commands.add_parser("call", help="call any JSON-RPC method (see `dedloc call rpc.discover`)")
    call.add_argument("method")
    call.add_argument("params", nargs="?", help="parameters as a JSON object or array")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    socket = args.socket or default_socket()
    try:
        return asyncio.run(_run(args, socket))
    except KeyboardInterrupt:
        return EXIT_OK
    except RpcConnectionError as exc:
        sys.stderr.write(
            f"dedloc: cannot reach the daemon at {socket}: {exc}.\n"
            "  Start it with `dedlocd` (or `systemctl start dedlocd` for the service), or point to "
            "its socket with --socket or $DEDLOC_SOCKET.\n")
        return EXIT_UNREACHABLE
    except RpcCallError as exc:
        if args.json:
            sys.stdout.write(orjson.dumps({"error": exc.to_json()}).decode() + "\n")
        else:
            sys.stderr.write(f"dedloc: {exc.message} (code {exc.code})\n")
            if exc.data is not None:
                sys.stderr.write(_format_data(exc.data))
        return EXIT_ERROR
    except RpcError as exc:
        sys.stderr.write(f"dedloc: {exc}\n")
        return EXIT_ERROR
    except ValueError as exc:
        sys.stderr.write(f"dedloc: {exc}\n")
        return EXIT_USAGE


async def _run(args: argparse.Namespace, socket: Path) -> int:
    async with await JsonRpcClient.connect(socket, default_timeout=args.timeout) as client:
        if args.command == "status" and args.watch:
            return await _watch(client, args)
        method, params = _request(args)
        result = await client.call(method, params)
        if args.json or args.command == "call":
            sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            sys.stdout.write(_render(args.command, result))
    return EXIT_OK


def _request(args: argparse.Namespace) -> tuple[str, dict[str, Any] | list[Any] | None]:
    if args.command == "info":
        return "node.info", None
    if args.command == "workloads":
        return "workloads.list", None
    if args.command == "peers":
        return "node.peers", None
    if args.command == "connect":
        return "node.connect", {"address": args.address}
    if args.command == "start":
        params: dict[str, Any] = {"workload": args.workload, "config": dict(args.config)}
        for option in ("name", "target_batch_size", "epochs", "checkpoint_every", "device", "min_peers",
                       "average_state_every", "compression"):
            if getattr(args, option) is not None:
                params[option] = getattr(args, option)
        if args.collaborative:
            params["collaborative"] = True
        return "run.start", params
    if args.command == "join":
        params = {"name": args.name, "collaborative": True}
        for option in ("device", "checkpoint_every"):
            if getattr(args, option) is not None:
                params[option] = getattr(args, option)
        if args.aux:
            params["role"] = "aux"
        return "run.start", params
    if args.command in ("status", "stop", "restart"):
        return f"run.{args.command}", {"name": args.name} if args.name else None
    if args.command == "shutdown":
        return "node.shutdown", None
    params_text = args.params
    if params_text is None:
        return args.method, None
    try:
        parsed = orjson.loads(params_text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"PARAMS is not JSON: {exc}") from exc
    if not isinstance(parsed, dict | list):
        raise ValueError("PARAMS must be a JSON object or array")
    return args.method, parsed


def _render(command: str, result: Any) -> str:
    if command == "info":
        return render_info(result)
    if command == "workloads":
        return render_workloads(result)
    if command == "peers":
        return render_peers(result)
    if command == "connect":
        return f"connected to {result['address']}\n"
    if command == "status":
        return _render_runs(result)
    if command in ("start", "join", "stop", "restart"):
        return render_status(result)
    if command == "shutdown":
        return "daemon is stopping\n"
    return orjson.dumps(result).decode() + "\n"


def _render_runs(runs: list[dict[str, Any]]) -> str:
    return "".join(render_status(run) for run in runs) or "no runs\n"


async def _watch(client: JsonRpcClient, args: argparse.Namespace) -> int:
    """Redraw the runs' progress every --interval seconds until Ctrl-C (which exits 0, see main) or
    until no run is active any more. On a terminal the screen is redrawn; otherwise (a pipe, a log)
    each update is printed as its own block, the blocks separated by a blank line."""
    params = {"name": args.name} if args.name else None
    tty = sys.stdout.isatty() and not args.json
    first = True
    while True:
        runs = await client.call("run.status", params)
        if args.json:
            sys.stdout.write(orjson.dumps({"time": time.time(), "runs": runs}).decode() + "\n")
        elif tty:
            sys.stdout.write(f"{CLEAR_SCREEN}dedloc status · {time.strftime('%H:%M:%S')} · every "
                             f"{args.interval:g} s · Ctrl-C to quit\n\n{_render_runs(runs)}")
        else:
            sys.stdout.write(("" if first else "\n") + _render_runs(runs))
        first = False
        sys.stdout.flush()
        if not any(run.get("state") in ACTIVE_STATES for run in runs):
            return EXIT_OK
        await asyncio.sleep(args.interval)


def _format_data(data: Any) -> str:
    if isinstance(data, dict):
        lines = []
        for key, value in data.items():
            if key == "last_log_lines" and isinstance(value, list):
                lines.append("  last log lines:\n" + "".join(f"    {line}\n" for line in value))
            else:
                lines.append(f"  {key}: {value}\n")
        return "".join(lines)
    return f"  {data}\n"


if __name__ == "__main__":
    sys.exit(main())
