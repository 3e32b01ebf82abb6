"""`dedloc service install|uninstall`: dedlocd as a systemd service on a volunteer's machine.

install writes the unit (the packaged systemd/dedlocd.service, its ExecStart pointing at this
environment's dedlocd), /etc/dedloc/dedlocd.toml with the volunteer's choices and the run to join
(checked by loading it as the daemon does), a closed run's token (mode 0600, the service user's),
creates the system user, then reloads systemd, enables the service and (re)starts it. --dry-run
changes nothing: it prints every step and writes the unit and the config into a directory where
they can be checked (systemd-analyze verify). docs/service.md describes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
import textwrap
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from dedloc import __version__
from dedloc.rpc import JsonRpcClient, RpcError

from .main import DEVICE_HELP, EXIT_ERROR, EXIT_OK, SYSTEMD_SOCKET, parse_rate
from .service_steps import (
    Command,
    EnsureNoUser,
    EnsureUser,
    Remove,
    ServiceError,
    Step,
    WriteFile,
    apply_steps,
    describe_steps,
)

SERVICE = "dedlocd"
UNIT_PATH = Path("etc/systemd/system/dedlocd.service")  # under --prefix
CONFIG_DIR = Path("etc/dedloc")
CONFIG_NAME, TOKEN_NAME, MANIFEST_NAME = "dedlocd.toml", "run-token", "run.manifest.json"
STATE_DIR = "/var/lib/dedloc"  # the unit's StateDirectory=dedloc, the user's home
START_TIMEOUT = 180.0  # the unit's TimeoutStartSec=120, and some
HIDDEN = ("/home/", "/root/", "/run/user/")  # ProtectHome=yes hides them from the service
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def add_service_commands(commands: Any) -> None:
    service = commands.add_parser("service", help="install dedlocd as a systemd service (root)",
                                  description="Run dedlocd as a systemd service (docs/service.md).")
    verbs = service.add_subparsers(dest="service_command", required=True, metavar="VERB")
    install = verbs.add_parser(
        "install", help="write the unit and config, create the user, enable and start dedlocd",
        description="Install dedlocd as a systemd service: the unit, /etc/dedloc/dedlocd.toml with "
                    "these choices, the system user; then enable and (re)start it. Run as root; "
                    "--dry-run shows every step without changing anything.")
    install.add_argument("--join", metavar="NAME", help="the collaborative run to join at every start")
    install.add_argument("--token", help="a closed run's token (its owner's `dedloc token issue`); "
                                         "kept in /etc/dedloc/run-token, mode 0600")
    install.add_argument("--aux", action="store_true",
                         help="join as an aux peer: no worker, it reduces in the run's rounds")
    install.add_argument("--manifest", type=Path, metavar="FILE",
                         help="the run owner's side: start the run of this `dedloc run create` "
                              "manifest file at every start (copied to /etc/dedloc)")
    install.add_argument("--bootstrap", action="append", default=[], metavar="ADDR",
                         help="a peer to join the network through, /ip4/HOST/tcp/PORT/p2p/PEER_ID "
                              "(repeatable)")
    install.add_argument("--device", help=DEVICE_HELP)
    install.add_argument("--threads", type=int, help="CPU threads a worker may use (0: the default)")
    install.add_argument("--duty-cycle", type=float, metavar="SHARE",
                         help="the share of the time a worker computes, 0.05 to 1 (it rests "
                              "after each batch for the rest; 1: no rest)")
    for direction in ("upload", "download"):
        install.add_argument(f"--{direction}", type=parse_rate, metavar="RATE",
                             help=f"cap the {direction}, like 10MB/s or 80Mbit/s")
    install.add_argument("--hours", help="train only in these hours, like 22:00-07:00")
    install.add_argument("--idle-only", action="store_true",
                         help="train only while other programs leave the CPU idle")
    install.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                         help="any other dedlocd config key, like net.listen=/ip4/0.0.0.0/tcp/4100 "
                              "(`dedlocd --print-default-config` lists them; repeatable)")
    install.add_argument("--no-start", action="store_true", help="enable the service, do not start it")
    install.add_argument("--dedlocd", type=Path, metavar="PATH",
                         help="the dedlocd the service runs (default: this environment's)")
    uninstall = verbs.add_parser("uninstall", help="stop and disable dedlocd, remove its unit "
                                                   "(and with --purge its config, state and user)")
    uninstall.add_argument("--purge", action="store_true",
                           help="also remove /etc/dedloc, /var/lib/dedloc (identity key, "
                                "checkpoints) and the user")
    for sub in (install, uninstall):
        sub.add_argument("--user", default="dedloc", help="the service's user and group (default dedloc)")
        sub.add_argument("--prefix", type=Path, default=Path("/"),
                         help="install into this root instead of / (an image being built): files "
                              "go under it, the user into its /etc/passwd, nothing is started")
        sub.add_argument("--dry-run", action="store_true",
                         help="change nothing: print each step; install writes the unit and "
                              "config into a directory for checking")
    install.add_argument("--dry-run-dir", type=Path, metavar="DIR",
                         help="where --dry-run writes them (default: a new temporary directory)")


def main(args: argparse.Namespace) -> int:
    try:
        if not args.dry_run and os.geteuid() != 0:
            raise ServiceError(
                f"`dedloc service {args.service_command}` must run as root: it writes to /etc and "
                "runs useradd and systemctl",
                f"run it with sudo (sudo dedloc service {args.service_command} ...), or add "
                "--dry-run to see what it would do")
        if not USER_NAME.match(args.user):
            raise ServiceError(f"--user {args.user!r} is not a user name (like dedloc)")
        args.prefix = args.prefix.absolute()
        if args.service_command == "install":
            return _install(args)
        return _uninstall(args)
    except ServiceError as exc:
        sys.stderr.write(f"dedloc: {exc}\n" + (f"  {exc.hint}\n" if exc.hint else ""))
        return EXIT_ERROR
    except OSError as exc:
        sys.stderr.write(f"dedloc: {exc}\n  nothing after this step was done; fix it and run "
                         "the command again\n")
        return EXIT_ERROR


# install ---------------------------------------------------------------------------------------


def _install(args: argparse.Namespace) -> int:
    prefix: Path = args.prefix
    live = prefix == Path("/")
    token = _check_token(args)
    dedlocd = _find_dedlocd(args.dedlocd, strict=not args.dry_run and live)
    unit = render_unit(unit_template(), dedlocd, args.user)
    config = render_config(install_settings(args, token))
    _check_config(config)
    config_dir = prefix / CONFIG_DIR
    steps: list[Step] = [
        EnsureUser(args.user, STATE_DIR, prefix),
        WriteFile(prefix / UNIT_PATH, unit, 0o644),
        WriteFile(config_dir / CONFIG_NAME, config, 0o644, keep_old=True),
        (WriteFile(config_dir / TOKEN_NAME, token + "\n", 0o600, owner=args.user, prefix=prefix,
                   secret=True) if token else Remove(config_dir / TOKEN_NAME, missing_ok=True))]
    if args.manifest is not None:
        from dedloc.daemon.collab.autojoin import read_manifest_file

        try:
            read_manifest_file(args.manifest)
            manifest_text = args.manifest.read_text()
        except (ValueError, OSError) as exc:
            raise ServiceError(f"--manifest: {exc}", "give the file `dedloc run create` "
                               "wrote") from None
        steps.append(WriteFile(config_dir / MANIFEST_NAME, manifest_text, 0o644))
    if live:
        steps += [Command(["systemctl", "daemon-reload"]), Command(["systemctl", "enable", SERVICE])]
        if not args.no_start:
            steps.append(Command(["systemctl", "restart", SERVICE], timeout=START_TIMEOUT,
                                 hint="`journalctl -u dedlocd -e` and `systemctl status dedlocd` "
                                      "show why"))
    else:
        steps.append(Command(["systemctl", f"--root={prefix}", "enable", SERVICE]))
    if args.join and not args.bootstrap and not any(s.startswith("net.bootstrap=") for s in args.settings):
        sys.stderr.write("dedloc: warning: no --bootstrap: a fresh machine knows no peer to find "
                         "the run through\n")
    if args.dry_run:
        where = args.dry_run_dir or Path(tempfile.mkdtemp(prefix="dedloc-service-"))
        where.mkdir(parents=True, exist_ok=True)
        (where / UNIT_PATH.name).write_text(unit)
        (where / CONFIG_NAME).write_text(config)
        sys.stdout.write(describe_steps("install", steps))
        sys.stdout.write(f"The unit and the config are written for checking:\n"
                         f"  {where / UNIT_PATH.name}\n  {where / CONFIG_NAME}\n"
                         f"Check the unit with: systemd-analyze verify {where / UNIT_PATH.name}\n")
        return EXIT_OK
    apply_steps(steps)
    if live and not args.no_start:
        _print_peer_id()
    sys.stdout.write("dedlocd is installed" + ("" if live and not args.no_start else
                                                " (not started)") + ".\n")
    return EXIT_OK


def unit_template() -> str:
    """The unit shipped with the package (cli/dedlocd.service links to systemd/dedlocd.service)."""
    return resources.files("dedloc.cli").joinpath("dedlocd.service").read_text()


def render_unit(template: str, dedlocd: Path, user: str) -> str:
    """The template with ExecStart running `dedlocd` and User/Group set to `user`."""
    program = str(dedlocd).replace("%", "%%")
    if re.search(r'[\s"\\]', program):
        program = '"' + program.replace("\\", "\\\\").replace('"', '\\"') + '"'
    text, count = re.subn(r"^ExecStart=\S+", lambda _: f"ExecStart={program}", template, flags=re.M)
    if count != 1:
        raise ServiceError("the packaged unit has no single ExecStart= line (a broken install?)")
    text = re.sub(r"^User=.*$", f"User={user}", text, flags=re.M)
    text = re.sub(r"^Group=.*$", f"Group={user}", text, flags=re.M)
    return (f"# Written by `dedloc service install` (dedloc {__version__}); `dedloc service "
            f"uninstall` removes it.\n{text}")


def install_settings(args: argparse.Namespace, token: str | None) -> dict[str, Any]:
    """The config keys (dotted) the volunteer chose, checked one by one."""
    from dedloc.daemon.config import ConfigError, config_keys, parse_text_value  # (slow to import)

    chosen: dict[str, Any] = {"log.format": "json"}  # journald keeps JSON lines
    for key, value in (("net.bootstrap", args.bootstrap or None), ("workers.device", args.device),
                       ("workers.threads", args.threads),
                       ("workers.duty_cycle", args.duty_cycle),
                       ("net.upload_bytes_per_second", args.upload),
                       ("net.download_bytes_per_second", args.download),
                       ("limits.hours", args.hours), ("limits.idle_only", args.idle_only or None),
                       ("run.join", args.join), ("run.aux", args.aux or None)):
        if value is not None:
            chosen[key] = value
    if token:
        chosen["run.token_file"] = f"/{CONFIG_DIR / TOKEN_NAME}"
    if args.manifest is not None:
        chosen["run.manifest"] = f"/{CONFIG_DIR / MANIFEST_NAME}"
    keys = {key.dotted: key for key in config_keys()}
    for text in args.settings:
        dotted, sep, raw = text.partition("=")
        if not sep or dotted.strip() not in keys:
            raise ServiceError(f"--set {text!r}: expected SECTION.KEY=VALUE with a known key",
                               "`dedlocd --print-default-config` lists the keys")
        try:
            chosen[dotted.strip()] = parse_text_value(keys[dotted.strip()], raw)
        except ConfigError as exc:
            raise ServiceError(str(exc)) from None
    return chosen


def render_config(chosen: dict[str, Any]) -> str:
    """A TOML file with the chosen keys, each under its documentation."""
    from dedloc.daemon.config import config_keys

    lines = [f"# /etc/dedloc/dedlocd.toml, written by `dedloc service install` (dedloc {__version__}):",
             "# the choices made then. `dedlocd --print-default-config` lists every key; after an",
             "# edit: systemctl restart dedlocd."]
    section = None
    for key in config_keys():
        if key.dotted not in chosen:
            continue
        if key.section != section:
            section = key.section
            lines += ["", f"[{section}]"]
        lines += [*textwrap.wrap(key.doc, 98, initial_indent="# ", subsequent_indent="# "),
                  f"{key.name} = {_toml(chosen[key.dotted])}"]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}"
                             for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return f"{value:.1f}"
    return repr(value)


def _check_config(text: str) -> None:
    """Load the config as the daemon will (ConfigError names the key); before anything is written."""
    from dedloc.daemon.config import ConfigError, load_config

    with tempfile.TemporaryDirectory(prefix="dedloc-config-") as folder:
        path = Path(folder) / CONFIG_NAME
        path.write_text(text)
        try:
            tomllib.loads(text)
            load_config(path)
        except ConfigError as exc:
            raise ServiceError(f"the config would be refused: {exc}") from None


def _check_token(args: argparse.Namespace) -> str | None:
    from dedloc.daemon.collab.errors import MembershipError
    from dedloc.daemon.collab.tokens import MembershipToken

    if args.token is None:
        if args.join is None and args.manifest is None:
            sys.stderr.write("dedloc: warning: no --join, --token or --manifest: the daemon will "
                             "not take part in any run by itself\n")
        return None
    try:
        token = MembershipToken.decode(args.token)
    except MembershipError as exc:
        raise ServiceError(f"--token: {exc}", "paste the whole token the run's owner sent") from None
    if args.join is not None and args.join != token.run:
        raise ServiceError(f"the token is for run {token.run!r}, not {args.join!r}")
    if token.role == "aux" and not args.aux:
        raise ServiceError("this token admits an aux peer only", "add --aux, or ask the run's "
                                                                 "owner for a trainer token")
    return args.token.strip()


def _find_dedlocd(given: Path | None, strict: bool) -> Path:
    """This environment's dedlocd (next to the running Python, else on PATH), as an absolute path."""
    found = given
    if found is None:
        sibling = Path(sys.executable).with_name("dedlocd")
        found = sibling if sibling.is_file() else (Path(p) if (p := shutil.which("dedlocd")) else None)
    if found is None or not found.is_file():
        raise ServiceError("cannot find dedlocd", "install dedloc (pip install dedloc) into an "
                           "environment outside /home, or name it with --dedlocd PATH")
    found = found.absolute()
    if str(found).startswith(HIDDEN):
        message = (f"{found} is under {'/'.join(found.parts[:2])}, which the service cannot see "
                   "(ProtectHome=yes)")
        hint = ("install dedloc outside /home and /root, e.g. `python3 -m venv /opt/dedloc && "
                "/opt/dedloc/bin/pip install dedloc`, then run `sudo /opt/dedloc/bin/dedloc service "
                "install ...`")
        if strict:
            raise ServiceError(message, hint)
        sys.stderr.write(f"dedloc: warning: {message}; {hint}\n")
    return found


def _print_peer_id() -> None:
    """The started daemon's peer id: what a closed run's owner issues a token for."""
    async def ask() -> str:
        async with await JsonRpcClient.connect(SYSTEMD_SOCKET, default_timeout=15.0) as client:
            return str((await client.call("node.info"))["peer_id"])

    try:
        peer_id = asyncio.run(ask())
    except (RpcError, OSError, KeyError, TypeError) as exc:
        sys.stdout.write(f"(this machine's peer id is not known yet: {exc}; `dedloc info` shows it)\n")
        return
    sys.stdout.write(f"this machine's peer id: {peer_id} (the owner of a closed run issues your "
                     "token for it)\n")


# uninstall -------------------------------------------------------------------------------------


def _uninstall(args: argparse.Namespace) -> int:
    prefix: Path = args.prefix
    live = prefix == Path("/")
    steps: list[Step] = []
    if live:
        steps.append(Command(["systemctl", "disable", "--now", SERVICE], required=False))
    else:
        steps.append(Command(["systemctl", f"--root={prefix}", "disable", SERVICE], required=False))
    steps.append(Remove(prefix / UNIT_PATH, missing_ok=True))
    if live:
        steps.append(Command(["systemctl", "daemon-reload"], required=False))
    if args.purge:
        steps += [Remove(prefix / CONFIG_DIR, missing_ok=True),
                  Remove(prefix / STATE_DIR.lstrip("/"), missing_ok=True),
                  EnsureNoUser(args.user, prefix)]
    if args.dry_run:
        sys.stdout.write(describe_steps("uninstall", steps))
        return EXIT_OK
    apply_steps(steps)
    sys.stdout.write("dedlocd is uninstalled" + ("" if args.purge else " (config, state and user "
                                                                       "kept; --purge removes them)")
                     + ".\n")
    return EXIT_OK
