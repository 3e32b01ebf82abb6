"""`dedlocd`: the peer daemon's command line.

Exit codes: 0 clean stop, 1 crash or failed start-up (the reason is logged), 2 bad configuration
or usage (the offending key is named on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import signal
import sys
import typing
from pathlib import Path

import structlog

from dedloc import __version__

from .config import ConfigError, config_keys, load_config, parse_text_value, render_default_config
from .errors import DaemonError
from .logs import configure_logging
from .node import Node

EXIT_OK, EXIT_CRASH, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedlocd", description="dedloc peer daemon: collaborative training over the internet.",
        epilog="Every configuration key can be given as --section.key VALUE; "
               "--print-default-config lists them with their documentation.")
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--print-default-config", action="store_true",
                        help="print the documented default configuration and exit")
    parser.add_argument("--version", action="version", version=f"dedlocd {__version__}")
    keys = parser.add_argument_group("configuration keys (override the file)")
    for key in config_keys():
        repeatable = typing.get_origin(key.hint) is list
        keys.add_argument(f"--{key.dotted}", dest=f"key:{key.dotted}", metavar="VALUE",
                          action="append" if repeatable else "store",
                          help=key.doc.replace("%", "%%"))
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict[str, typing.Any]:
    """The configuration keys given on the command line, parsed; repeated list keys add up."""
    keys = {key.dotted: key for key in config_keys()}
    overrides = {}
    for dest, value in vars(args).items():
        if dest.startswith("key:") and value is not None:
            text = ",".join(value) if isinstance(value, list) else value
            overrides[dest[4:]] = parse_text_value(keys[dest[4:]], text)
    return overrides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_default_config:
        sys.stdout.write(render_default_config())
        return EXIT_OK
    try:
        config = load_config(args.config, overrides_from_args(args))
    except ConfigError as exc:
        sys.stderr.write(f"dedlocd: {exc}\n")
        return EXIT_USAGE
    configure_logging(config.log.level, config.log.format)
    log = structlog.get_logger("dedloc.daemon")
    stacks = _dump_stacks_on_sigusr1(config.runtime_dir() / STACKS_FILE)
    try:
        node = Node(config)
        asyncio.run(node.run())
        if node.failed is not None:  # stopped cleanly, but because part of it failed
            log.error("dedlocd_failed", error=node.failed)
            return EXIT_CRASH
    except DaemonError as exc:
        log.error("dedlocd_failed", error=str(exc))
        return EXIT_CRASH
    except OSError as exc:
        log.error("dedlocd_failed", error=str(exc), hint="check the paths and permissions in the config")
        return EXIT_CRASH
    except Exception:
        log.exception("dedlocd_crashed")
        return EXIT_CRASH
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        if stacks is not None:
            stacks.close()
    return EXIT_OK


#: `kill -USR1 <pid>` writes every thread's stack here (in `node.runtime_dir`): what a daemon
#: that stopped answering is doing, even when its event loop is blocked (a bug report's best
#: evidence; the log may be what blocks).
STACKS_FILE = "stacks.txt"


def _dump_stacks_on_sigusr1(path: Path) -> typing.TextIO | None:
    try:  # (a directory that does not exist yet is the control socket's to create, with its mode)
        file = open(path, "w")  # noqa: SIM115  (held open for the process's life)
    except OSError:  # to the log's stream instead (SIGUSR1 must never end the daemon)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        return None
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
    return file


if __name__ == "__main__":
    sys.exit(main())
