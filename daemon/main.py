"""`dedlocd`: the peer daemon's command line.

Exit codes: 0 clean stop, 1 crash or failed start-up (the reason is logged), 2 bad configuration
or usage (the offending key is named on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
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
        keys.add_argument(f"--{key.dotted}", dest=f"key:{key.dotted}", metavar="VALUE",
                          help=key.doc.replace("%", "%%"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_default_config:
        sys.stdout.write(render_default_config())
        return EXIT_OK
    try:
        keys = {key.dotted: key for key in config_keys()}
        overrides = {
            dest[4:]: parse_text_value(keys[dest[4:]], value)
            for dest, value in vars(args).items() if dest.startswith("key:") and value is not None
        }
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        sys.stderr.write(f"dedlocd: {exc}\n")
        return EXIT_USAGE
    configure_logging(config.log.level, config.log.format)
    log = structlog.get_logger("dedloc.daemon")
    try:
        node = Node(config)
        asyncio.run(node.run())
    except DaemonError as exc:
        log.error("dedlocd_failed", error=str(exc))
        return EXIT_CRASH
    except OSError as exc:
        log.error("dedlocd_failed", error=str(exc), hint="check the paths and permissions in the config")
        return EXIT_CRASH
    except Exception:
        log.exception("dedlocd_crashed")
        return EXIT_CRASH
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
