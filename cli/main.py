"""`dedloc`: the command-line client of a running dedlocd (a thin layer over its JSON-RPC API)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from dedloc import __version__
from dedloc.rpc import (
    TOKEN_FILE_NAME,
    AccessError,
    JsonRpcClient,
    RpcCallError,
    RpcConnectionError,
    RpcError,
    read_token,
)

from .render import render_info, render_peers, render_status, render_workloads

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
SYSTEMD_SOCKET = Path("/run/dedlocd/dedlocd.sock")
SYSTEMD_TOKEN_FILE = Path("/var/lib/dedloc") / TOKEN_FILE_NAME
ACTIVE_STATES = ("starting", "running", "stopping")
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, then erase the whole screen


def default_socket() -> Path:
    """$DEDLOC_SOCKET, else the system service's socket if it exists, else the per-user one."""
    if os.environ.get("DEDLOC_SOCKET"):
        return Path(os.environ["DEDLOC_SOCKET"])
    if SYSTEMD_SOCKET.exists():
        return SYSTEMD_SOCKET
    return _user_state_dir() / "dedlocd.sock"


def default_token_file() -> Path:
    """$DEDLOC_TOKEN_FILE, else the system service's token file if it exists, else the per-user one."""
    if os.environ.get("DEDLOC_TOKEN_FILE"):
        return Path(os.environ["DEDLOC_TOKEN_FILE"])
    if SYSTEMD_TOKEN_FILE.exists():
        return SYSTEMD_TOKEN_FILE
    return _user_state_dir() / TOKEN_FILE_NAME


def _user_state_dir() -> Path:
    return Path(os.environ.get("STATE_DIRECTORY") or Path.home() / ".local" / "state" / "dedloc")


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


def _inner_lr_scale(text: str) -> float | str:
    """--inner-lr-scale: "auto" or a number (the daemon checks its bounds)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number such as 0.25, got {text!r}") \
            from None


DEVICE_HELP = '"auto", "cpu", "cuda", "cuda:N", a list like "cuda:0,cuda:1", or "cuda:all"'
# bytes per second per unit of a rate (decimal k/M/G; KiB/MiB/GiB binary; bit and bps: bits)
RATE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024**2,
              "gib": 1024**3, "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
              "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8}
RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*(?:/\s*s)?\s*", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """A bandwidth like 10MB/s, 500KB/s, 1.5MiB/s, 80Mbit/s, 80Mbps or 4000000 (bytes/s) in bytes
    per second; 0 or "off": no cap."""
    if text.strip().lower() in ("off", "none", "unlimited"):
        return 0.0
    match = RATE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in RATE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate like 10MB/s, 500KB/s, 80Mbit/s, "
                                         "0 or off")
    return float(match.group(1)) * RATE_UNITS[unit]


def format_rate(rate: float) -> str:
    """Like "10 MB/s (80 Mbit/s)"; 0: "no cap"."""
    if not rate:
        return "no cap"

    def scaled(value: float, unit: str) -> str:
        for prefix, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
            if value >= size:
                return f"{value / size:.4g} {prefix}{unit}"
        return f"{value:.4g} {unit}"

    return f"{scaled(rate, 'B/s')} ({scaled(rate * 8, 'bit/s')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dedloc", description="Control a dedloc peer daemon.")
    parser.add_argument("--socket", type=Path, default=None,
                        help="the daemon's control socket (default: $DEDLOC_SOCKET, "
                             f"{SYSTEMD_SOCKET} if present, else ~/.local/state/dedloc/dedlocd.sock)")
    parser.add_argument("--tcp", metavar="HOST:PORT", default=os.environ.get("DEDLOC_TCP") or None,
                        help="use the daemon's loopback TCP listener (rpc.tcp_listen) instead of "
                             "the socket, authenticating with the token file (default: $DEDLOC_TCP)")
    parser.add_argument("--token-file", type=Path, default=None,
                        help="the daemon's token file for --tcp (default: $DEDLOC_TOKEN_FILE, "
                             f"{SYSTEMD_TOKEN_FILE} if present, else "
                             f"~/.local/state/dedloc/{TOKEN_FILE_NAME})")
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
    add_sync_options(start)
    start.add_argument("--closed", action="store_true",
                       help="a closed run this daemon owns: only peers with its tokens take part "
                            "(dedloc token issue)")
    join = commands.add_parser("join", help="join the collaborative run of that name (its manifest "
                                            "comes from the peers)")
    join.add_argument("name", nargs="?", help="the run's name (not needed with --token)")
    join.add_argument("--token", help="the token the owner of a closed run issued to this peer")
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
    commands.add_parser("pause", help="stop training until `dedloc resume` (survives restarts)")
    commands.add_parser("resume", help="train again after `dedloc pause`")
    bandwidth = commands.add_parser("bandwidth", help="show the caps on peer traffic, or set them "
                                                      "(until the daemon restarts)")
    for direction in ("upload", "download"):
        bandwidth.add_argument(f"--{direction}", type=parse_rate, metavar="RATE",
                               help=f"cap the {direction}, like 10MB/s, 500KB/s or 80Mbit/s "
                                    "(0 or off: no cap)")
    token = commands.add_parser("token", help="a closed run's membership tokens (its owner only)")
    token_verbs = token.add_subparsers(dest="token_command", required=True)
    issue = token_verbs.add_parser("issue", help="sign a token for one peer; prints the token")
    issue.add_argument("name", help="the closed run's name")
    issue.add_argument("peer", help="the volunteer's peer id (their `dedloc info` shows it)")
    issue.add_argument("--role", choices=("trainer", "aux"), default="trainer")
    issue.add_argument("--days", type=float, default=30.0, help="validity (default 30 days)")
    revoke = token_verbs.add_parser("revoke", help="revoke a token, or every token of a peer")
    revoke.add_argument("name")
    revoke.add_argument("--serial", help="the token's serial (dedloc token list)")
    revoke.add_argument("--peer", help="a peer id: all its tokens")
    listing = token_verbs.add_parser("list", help="the tokens issued for a run")
    listing.add_argument("name")
    call = commands.add_parser("call", help="call any JSON-RPC method (see `dedloc call rpc.discover`)")
    call.add_argument("method")
    call.add_argument("params", nargs="?", help="parameters as a JSON object or array")
    from .run_create import add_run_commands
    from .service import add_service_commands

    add_run_commands(commands)
    add_service_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "service":  # no daemon involved
        from .service import main as service_main

        return service_main(args)
    socket = args.socket or default_socket()
    where = f"tcp:{args.tcp}" if args.tcp else str(socket)
    try:
        return asyncio.run(_run(args, socket))
    except KeyboardInterrupt:
        return EXIT_OK
    except RpcConnectionError as exc:
        sys.stderr.write(
            f"dedloc: cannot reach the daemon at {where}: {exc}.\n"
            "  Start it with `dedlocd` (or `systemctl start dedlocd` for the service), or point to "
            + ("its TCP listener with --tcp or $DEDLOC_TCP (rpc.tcp_listen; `dedloc info` shows "
               "it).\n" if args.tcp else "its socket with --socket or $DEDLOC_SOCKET.\n"))
        return EXIT_UNREACHABLE
    except AccessError as exc:
        sys.stderr.write(f"dedloc: {exc}.\n  --tcp needs the token of the daemon's TCP "
                         "listener: give its file with --token-file or $DEDLOC_TOKEN_FILE (it is "
                         f"<state_dir>/{TOKEN_FILE_NAME}, readable by the daemon's user).\n")
        return EXIT_USAGE
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


async def _connect(args: argparse.Namespace, socket: Path) -> JsonRpcClient:
    if args.tcp:
        token_file = args.token_file or default_token_file()
        try:
            token = read_token(token_file)
        except FileNotFoundError:
            raise AccessError(f"the token file {token_file} does not exist") from None
        return await JsonRpcClient.connect_tcp(args.tcp, token, default_timeout=args.timeout)
    return await JsonRpcClient.connect(socket, default_timeout=args.timeout)


async def _run(args: argparse.Namespace, socket: Path) -> int:
    async with await _connect(args, socket) as client:
        if args.command == "status" and args.watch:
            return await _watch(client, args)
        if args.command == "run":
            from .run_create import run_create

            return await run_create(client, args)
        method, params = _request(args)
        result = await client.call(method, params)
        if args.json or args.command == "call":
            sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            sys.stdout.write(_render(args.command, result))
    return EXIT_OK


def add_sync_options(parser: argparse.ArgumentParser) -> None:
    """How a run syncs (`dedloc start`, `dedloc run create`): compression, aggregation and local
    updates."""
    parser.add_argument("--compression", choices=("none", "fp16", "uint8", "quantile8", "topk"),
                        help="compression of the gradients in averaging rounds (topk: --sync "
                             "local only)")
    parser.add_argument("--aggregation", choices=("norm_clip", "mean"),
                        help="how the reducers combine contributions: norm_clip (the default "
                             "of gradient rounds: each clipped to 4 times its chunk's median "
                             "norm, then the weighted mean) or mean (the default of --sync local)")
    parser.add_argument("--sync", choices=("gradients", "local"),
                        help="how the run syncs: gradients (DeDLOC, the default) or local "
                             "(DiLoCo: inner steps, then an outer step; needs --inner-steps)")
    parser.add_argument("--inner-steps", type=int,
                        help="a local run's target batches of inner steps per outer step (H)")
    parser.add_argument("--outer-lr", type=_finite,
                        help="a local run's outer learning rate (0.7; with --compression topk 1.5)")
    parser.add_argument("--outer-momentum", type=_finite,
                        help="a local run's outer Nesterov momentum (0.9; with --compression "
                             "topk 0)")
    parser.add_argument("--feedback-decay", type=_finite,
                        help="a local run with a lossy codec: its error-feedback residual times "
                             "this before each exchange (1; with --compression topk 0.95)")
    parser.add_argument("--overlap", action="store_true", default=None,
                        help="a local run trains on while its pseudo-gradient is averaged "
                             "(a one-step-delayed outer step)")
    parser.add_argument("--outer-clip", type=_finite,
                        help="a local run's outer-step guard: at most this many times the "
                             "recent steps' norm (4; 0: none)")
    parser.add_argument("--inner-lr-scale", type=_inner_lr_scale,
                        help="a local run's inner learning rate: the workload's lr times this "
                             "number, or auto (the default): times batch size / target batch size")


def _finite(text: str) -> float:
    """A finite number (NaN would travel as JSON null: the daemon's default, silently)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


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
                       "average_state_every", "compression", "aggregation", "sync", "inner_steps",
                       "outer_lr", "outer_momentum", "overlap", "outer_clip", "inner_lr_scale",
                       "feedback_decay"):
            if getattr(args, option) is not None:
                params[option] = getattr(args, option)
        if args.collaborative:
            params["collaborative"] = True
        if args.closed:
            params["closed"] = True
        return "run.start", params
    if args.command == "join":
        if args.name is None and args.token is None:
            raise ValueError("join needs the run's name, or --token for a closed run")
        params = {"collaborative": True}
        if args.name is not None:
            params["name"] = args.name
        if args.token is not None:
            params["token"] = args.token
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
    if args.command in ("pause", "resume"):
        return f"node.{args.command}", None
    if args.command == "bandwidth":
        if args.upload is None and args.download is None:
            return "node.bandwidth", None
        return "node.set_bandwidth", {"upload_bytes_per_second": args.upload,
                                      "download_bytes_per_second": args.download}
    if args.command == "token":
        if args.token_command == "issue":
            return "token.issue", {"name": args.name, "peer": args.peer, "role": args.role,
                                   "days": args.days}
        if args.token_command == "revoke":
            if args.serial is None and args.peer is None:
                raise ValueError("token revoke needs --serial or --peer")
            return "token.revoke", {"name": args.name, "serial": args.serial, "peer": args.peer}
        return "token.list", {"name": args.name}
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
    if command in ("pause", "resume"):
        blocked = result.get("blocked")
        return f"training {'waits: ' + blocked if blocked else 'goes on'}\n"
    if command == "token":
        return _render_tokens(result)
    if command == "bandwidth":
        return (f"upload: {format_rate(result['upload_bytes_per_second'])}\n"
                f"download: {format_rate(result['download_bytes_per_second'])}\n"
                f"held back so far: {result['throttled_seconds_up']:g} s sending, "
                f"{result['throttled_seconds_down']:g} s receiving\n")
    return orjson.dumps(result).decode() + "\n"


def _render_tokens(result: dict[str, Any]) -> str:
    if "token" in result:  # issued: the line the volunteer pastes
        expires = time.strftime("%Y-%m-%d %H:%M", time.localtime(result["expires"]))
        return (f"token for {result['peer']} ({result['role']}, serial {result['serial']}, "
                f"expires {expires}); the volunteer runs:\n"
                f"  dedloc join --token {result['token']}\n")
    if "tokens" in result:
        lines = [f"{t['serial']}  {t['role']:7}  {t['peer']}  "
                 f"{'revoked' if t['revoked'] else 'expired' if t['expired'] else 'valid'}"
                 for t in result["tokens"]]
        return "\n".join(lines) + "\n" if lines else f"no tokens issued for {result['run']}\n"
    return (f"revoked in {result['run']}: serials {', '.join(result['revoked_serials']) or '-'}; "
            f"peers {', '.join(result['revoked_peers']) or '-'}"
            f"{'' if result['published'] else ' (not yet published: no DHT peers)'}\n")


def _render_runs(runs: list[dict[str, Any]]) -> str:
    return "".join(render_status(run) for run in runs) or "no runs\n"


async def _watch(client: JsonRpcClient, args: argparse.Namespace) -> int:
    """Redraw the runs' progress every --interval seconds until Ctrl-C (which exits 0, see main) or
    until no run is active any more. On a terminal the screen is redrawn; otherwise (a pipe, a log)
    each update is printed as its own block, the blocks separated by a blank line."""
    params = {"name": args.name} if args.name else None
    tty = sys.stdout.isatty() and not args.json
    # Ctrl-C (or SIGTERM) ends the watch at its next wait, on an event of our own: cancelling
    # the main task (asyncio.run's way) once left a watch running after SIGINT
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    try:
        return await _watch_until(client, args, params, tty, interrupted)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _watch_until(client: JsonRpcClient, args: argparse.Namespace,
                       params: dict[str, Any] | None, tty: bool, interrupted: asyncio.Event) -> int:
    first = True
    while not interrupted.is_set():
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
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.interval):
                await interrupted.wait()
    return EXIT_OK


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
