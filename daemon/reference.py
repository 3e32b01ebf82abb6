"""Regenerate docs/rpc-reference.md, the control API's reference, from `rpc.discover`.

    python -m dedloc.daemon.reference                 # print the Markdown
    python -m dedloc.daemon.reference --output docs/rpc-reference.md   # (what `make docs` runs)
    python -m dedloc.daemon.reference --check docs/rpc-reference.md    # exit 1 if it is stale
    python -m dedloc.daemon.reference --socket PATH   # from a running daemon instead

By default the OpenRPC document comes from a daemon built in this process (a `Node` in a temporary
state directory that is never started: no socket, no network), so it is exactly what `dedlocd`
would answer to `rpc.discover`, without starting one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from dedloc.rpc import JsonRpcClient, RpcError
from dedloc.rpc.reference import render_reference

from .config import build_config
from .logs import configure_logging

REGENERATE = "make docs"
REGENERATE_LONG = "python -m dedloc.daemon.reference --output docs/rpc-reference.md"

PREAMBLE = f"""\
<!-- Generated from rpc.discover by `{REGENERATE}` ({REGENERATE_LONG}); do not edit by hand. -->

Generated from the daemon's own OpenRPC document (`rpc.discover`); after changing a method,
regenerate it with `{REGENERATE}` (a test fails while it is stale).

The daemon answers JSON-RPC 2.0 on its unix socket (`dedloc info` shows it, `addresses.control`),
one JSON message per line, batches allowed. Parameters go by name (an object) or by position (an
array, in the order listed). Who may connect, and the loopback TCP listener whose first request
must be `rpc.authenticate` with the token file, are in [control-api.md](control-api.md).
From a shell: [`examples/dedloc-client.sh`](../examples/dedloc-client.sh) (socat and jq); from the
command line: `dedloc call METHOD '{{"param": value}}'`.
"""

# The methods a newcomer looks for first; the rest follow by name.
ORDER = ("node.info", "run.start", "run.status", "run.stop", "workloads.list")


def openrpc_in_process() -> dict[str, Any]:
    """The OpenRPC document of a daemon built here (never started) in a temporary state dir."""
    from .node import Node  # the whole daemon: imported only when asked for

    with tempfile.TemporaryDirectory(prefix="dedloc-reference-") as state_dir:
        node = Node(build_config({"node": {"state_dir": state_dir}}))
        document: dict[str, Any] = orjson.loads(orjson.dumps(node.registry.openrpc()))  # as sent
        return document


async def openrpc_from_socket(socket: Path, timeout: float = 30.0) -> dict[str, Any]:
    """The OpenRPC document a running daemon answers to `rpc.discover`."""
    async with await JsonRpcClient.connect(socket, default_timeout=timeout) as client:
        result: dict[str, Any] = await client.call("rpc.discover")
        return result


def render(doc: dict[str, Any]) -> str:
    return render_reference(doc, title="dedlocd control API reference", preamble=PREAMBLE,
                            order=ORDER)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dedloc.daemon.reference",
                                     description="Render the control API's reference (Markdown) "
                                                 "from rpc.discover.")
    parser.add_argument("--socket", type=Path,
                        help="ask this running daemon (default: a daemon built in this process)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", type=Path, help="write the reference to this file")
    where.add_argument("--check", type=Path, metavar="FILE",
                       help="exit 1 if FILE differs from what would be generated now")
    args = parser.parse_args(argv)
    configure_logging("warning", "console")  # stderr: stdout may be the reference itself
    try:
        doc = asyncio.run(openrpc_from_socket(args.socket)) if args.socket else openrpc_in_process()
    except (OSError, RpcError) as exc:
        sys.stderr.write(f"reference: cannot get rpc.discover: {exc}\n")
        return 1
    text = render(doc)
    if args.check:
        current = args.check.read_text() if args.check.exists() else ""
        if current != text:
            sys.stderr.write(f"{args.check} is stale: regenerate it with `{REGENERATE}` "
                             f"({REGENERATE_LONG})\n")
            return 1
        return 0
    if args.output:
        args.output.write_text(text)
        sys.stderr.write(f"wrote {args.output} ({len(doc.get('methods', []))} methods)\n")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
