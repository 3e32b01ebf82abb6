"""`dedloc run create`: the run owner's side of a collaboration.

On the owner's running daemon it starts the collaborative run (run.start, as `dedloc start
--collaborative` does), writes the run's manifest to a JSON file (which `[run] manifest` in the
daemon's config, or `dedloc service install --manifest`, starts again at every daemon start) and
prints, as its last line, the one line volunteers paste to install a service that joins the run.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from dedloc import __version__
from dedloc.rpc import JsonRpcClient

from .main import DEVICE_HELP, EXIT_OK, _request, add_sync_options, parse_assignment

# Address kinds, best first: what a volunteer elsewhere on the internet can most likely dial.
PUBLIC, UNKNOWN, PRIVATE, RELAYED, LOOPBACK = range(5)


def add_run_commands(commands: Any) -> None:
    run = commands.add_parser("run", help="the owner's side of a collaborative run (create)")
    verbs = run.add_subparsers(dest="run_command", required=True, metavar="VERB")
    create = verbs.add_parser(
        "create", help="start a collaborative run here, write its manifest, print the line "
                       "volunteers paste",
        description="Start a collaborative run on this daemon (its owner), write the run's "
                    "manifest to a JSON file and print, as the last line, the command volunteers "
                    "paste: sudo dedloc service install --join NAME --bootstrap ADDR.")
    create.add_argument("workload", help="an installed workload (dedloc workloads)")
    create.add_argument("--name", help="the run's name (default: the workload's name)")
    create.add_argument("--set", dest="config", action="append", type=parse_assignment, default=[],
                        metavar="KEY=VALUE", help="a workload config value (repeatable)")
    create.add_argument("--target-batch-size", type=int, help="samples per optimizer step")
    create.add_argument("--epochs", type=int, help="stop after this many epochs")
    create.add_argument("--min-peers", type=int, help="no step before this many trainers take part")
    create.add_argument("--average-state-every", type=int,
                        help="average parameters and optimizer state every K epochs (0: never)")
    add_sync_options(create)
    create.add_argument("--closed", action="store_true",
                        help="only peers holding a token this daemon issues take part")
    create.add_argument("--checkpoint-every", type=int, help="checkpoint every N epochs (here)")
    create.add_argument("--device", help=f"this daemon's worker device: {DEVICE_HELP}")
    create.add_argument("--output", type=Path, metavar="FILE",
                        help="where to write the manifest (default: ./NAME.manifest.json)")


async def run_create(client: JsonRpcClient, args: argparse.Namespace) -> int:
    start = argparse.Namespace(**{**vars(args), "command": "start", "collaborative": True})
    method, params = _request(start)  # exactly what `dedloc start --collaborative` sends
    status = await client.call(method, params)
    info = await client.call("node.info")
    name, closed = status["name"], bool(args.closed)
    bootstrap, kind = bootstrap_addresses(info["addresses"]["p2p"])
    line = join_line(name, bootstrap, closed)
    output: Path = args.output or Path(f"{name}.manifest.json")
    document = {"name": name, "fingerprint": status["fingerprint"], "manifest": status["manifest"],
                "owner": info["peer_id"], "closed": closed, "bootstrap": bootstrap,
                "created_at": time.time(), "dedloc": __version__, "join": line}
    _write(output, orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
    if kind in (PRIVATE, LOOPBACK, RELAYED) or not bootstrap:
        sys.stderr.write(
            f"dedloc: warning: this daemon's addresses are {_KIND_WORDS[kind] if bootstrap else 'none'}"
            ": volunteers elsewhere may not reach them. Give the daemon a fixed port (net.listen "
            "/ip4/0.0.0.0/tcp/4100), forward it, and announce the public address (net.announce "
            "/ip4/PUBLIC_IP/tcp/4100); docs/service.md.\n")
    if args.json:
        sys.stdout.write(orjson.dumps({"run": status, "manifest_file": str(output), "join": line},
                                      option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_OK
    manifest = status["manifest"]
    sys.stdout.write(
        f"started run {name}: workload {manifest['workload']}, target batch "
        f"{manifest['target_batch_size']}, fingerprint {status['fingerprint']}"
        f"{', closed' if closed else ''}; owner {info['peer_id']}\n"
        f"manifest written to {output}\n")
    if closed:
        sys.stdout.write(
            "a closed run: each volunteer first installs without --token (the install prints "
            "their peer id), you issue their token with `dedloc token issue "
            f"{name} PEER_ID`, and they install again with it in place of TOKEN:\n")
    else:
        sys.stdout.write("volunteers join with:\n")
    sys.stdout.write(line + "\n")
    return EXIT_OK


def join_line(name: str, bootstrap: list[str], closed: bool) -> str:
    """The command a volunteer pastes (it parses as `dedloc service install ...`)."""
    argv = ["sudo", "dedloc", "service", "install", "--join", name]
    for address in bootstrap:
        argv += ["--bootstrap", address]
    if closed:
        argv += ["--token", "TOKEN"]
    return shlex.join(argv)


_KIND_WORDS = {PUBLIC: "public", UNKNOWN: "of unknown reach", PRIVATE: "private (LAN) ones",
               RELAYED: "relayed only", LOOPBACK: "loopback only"}


def address_kind(text: str) -> int | None:
    from dedloc.daemon.net.addresses import PeerAddress  # (the daemon package is slow to import)

    try:
        address = PeerAddress.parse(text)
    except ValueError:
        return None
    if address.peer_id is None:
        return None
    if address.circuit is not None:
        return RELAYED
    if address.host_kind not in ("ip4", "ip6"):
        return PUBLIC  # a DNS name: meant to be found
    ip = ipaddress.ip_address(address.host)
    if ip.is_loopback:
        return LOOPBACK
    if ip.is_global:
        return PUBLIC
    if ip.is_private or ip.is_link_local:
        return PRIVATE
    return UNKNOWN


def bootstrap_addresses(addresses: list[str]) -> tuple[list[str], int]:
    """The daemon's addresses of the best kind (public before private, loopback last) and the kind."""
    ranked = [(kind, text) for text in addresses if (kind := address_kind(text)) is not None]
    if not ranked:
        return [], LOOPBACK
    best = min(kind for kind, _ in ranked)
    return [text for kind, text in ranked if kind == best], best


def _write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
