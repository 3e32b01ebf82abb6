"""The daemon's configuration: one typed object, parsed once at start-up.

Each subsystem owns the settings type of its section (daemon/net/settings.py for [net] and
[relay], daemon/dht/settings.py, daemon/averaging/settings.py, daemon/workers/settings.py,
daemon/collab/settings.py for [limits] and [run]); this module composes them with the node's own
sections ([node], [log], [rpc], [dashboard]) into `Config`, and only the composition root
(daemon/node.py, daemon/network.py, daemon/main.py, the CLI) imports it.

Sources, later ones winning: built-in defaults, one TOML file (`--config`), command-line options
(`--section.key value`, one per key). An unknown key or a value of the wrong type is refused with
the key's name. `dedlocd --print-default-config` prints the documented defaults as TOML.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dedloc.rpc import TOKEN_FILE_NAME, loopback_address

from .averaging.settings import AveragingSettings
from .collab.settings import LimitsSettings, RunSettings
from .dht.settings import DhtSettings
from .errors import ConfigError
from .net.addresses import PeerAddress
from .net.settings import NetSettings, RelaySettings
from .settings import documented
from .workers.settings import WorkerSettings


@dataclass(frozen=True)
class NodeSection:
    state_dir: str = documented(
        "Directory for the identity key, checkpoints and run state. Empty: $STATE_DIRECTORY "
        "(set by systemd), else ~/.local/state/dedloc.", default="")
    runtime_dir: str = documented(
        "Directory for sockets. Empty: $RUNTIME_DIRECTORY (set by systemd), else the state "
        "directory.", default="")
    role: Literal["trainer", "aux"] = documented(
        "What this daemon's collaborative runs are by default: trainer (a worker trains the "
        "model) or aux (no worker: it lends its bandwidth to the run's averaging rounds).",
        default="trainer")


@dataclass(frozen=True)
class LogSection:
    level: Literal["debug", "info", "warning", "error"] = documented("Least severe level logged.",
                                                                    default="info")
    format: Literal["auto", "json", "console"] = documented(
        "auto: JSON lines when stderr is not a terminal (journald), coloured text when it is.",
        default="auto")


@dataclass(frozen=True)
class RpcSection:
    socket: str = documented("Control socket path. Empty: <runtime_dir>/dedlocd.sock.", default="")
    socket_mode: int = documented(
        "Permissions of the control socket (octal in TOML: 0o660). The owner needs rw (0o600). "
        "Whatever the mode, only root, the daemon's user and members of its group are served "
        "(checked by their kernel credentials).", default=0o660)
    max_request_bytes: int = documented("Longest request line accepted; longer ones are refused "
                                        "and the connection closed.", default=1 << 20)
    max_connections: int = documented("Most control connections served at once.", default=64)
    idle_timeout: float = documented("Seconds a control connection may stay silent before it is "
                                     "closed.", default=3600.0)
    tcp_listen: str = documented(
        "Also serve the control API on this loopback TCP address (127.0.0.1:PORT or [::1]:PORT; "
        "port 0 picks a free one, node.info shows it). Each connection must first send "
        "rpc.authenticate with the token in <state_dir>/rpc-token (made on first use, mode 0600). "
        "Empty: no TCP listener. Other addresses are refused.", default="")


@dataclass(frozen=True)
class DashboardSection:
    listen: str = documented(
        "Serve a read-only web dashboard (/), its data (/api/snapshot) and Prometheus metrics "
        "(/metrics) on this loopback address (127.0.0.1:PORT or [::1]:PORT; port 0 picks a free "
        "one, node.info shows it). Empty: off. Other addresses are refused.", default="")


@dataclass(frozen=True)
class Config:
    node: NodeSection = field(default_factory=NodeSection)
    log: LogSection = field(default_factory=LogSection)
    rpc: RpcSection = field(default_factory=RpcSection)
    net: NetSettings = field(default_factory=NetSettings)
    dht: DhtSettings = field(default_factory=DhtSettings)
    relay: RelaySettings = field(default_factory=RelaySettings)
    averaging: AveragingSettings = field(default_factory=AveragingSettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    run: RunSettings = field(default_factory=RunSettings)
    dashboard: DashboardSection = field(default_factory=DashboardSection)

    # Derived paths (environment applied) -------------------------------------------------

    def state_dir(self, env: typing.Mapping[str, str] = os.environ) -> Path:
        if self.node.state_dir:
            return Path(self.node.state_dir).expanduser()
        if env.get("STATE_DIRECTORY"):
            return Path(env["STATE_DIRECTORY"].split(":")[0])
        return Path.home() / ".local" / "state" / "dedloc"

    def runtime_dir(self, env: typing.Mapping[str, str] = os.environ) -> Path:
        if self.node.runtime_dir:
            return Path(self.node.runtime_dir).expanduser()
        if env.get("RUNTIME_DIRECTORY"):
            return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
        return self.state_dir(env)

    def socket_path(self, env: typing.Mapping[str, str] = os.environ) -> Path:
        if self.rpc.socket:
            return Path(self.rpc.socket).expanduser()
        return self.runtime_dir(env) / "dedlocd.sock"

    def rpc_token_path(self, env: typing.Mapping[str, str] = os.environ) -> Path:
        """The token that TCP control clients authenticate with (rpc.tcp_listen)."""
        return self.state_dir(env) / TOKEN_FILE_NAME

    def worker_command(self) -> list[str]:
        return self.workers.command_line()


# Keys --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigKey:
    section: str
    name: str
    hint: Any
    default: Any
    doc: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def config_keys() -> list[ConfigKey]:
    """Every configuration key, in documentation order."""
    keys = []
    for section in dataclasses.fields(Config):
        section_type = typing.get_type_hints(Config)[section.name]
        hints = typing.get_type_hints(section_type)
        for item in dataclasses.fields(section_type):
            default = (item.default_factory() if item.default_factory is not dataclasses.MISSING
                       else item.default)
            keys.append(ConfigKey(section.name, item.name, hints[item.name], default,
                                  item.metadata.get("doc", "")))
    return keys


def check_value(key: ConfigKey, value: Any) -> Any:
    """The value if it fits the key's type (ints are accepted for floats); else ConfigError."""
    hint = key.hint
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(key.dotted, f"must be one of {', '.join(map(repr, choices))}, "
                                          f"got {value!r}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list) or not all(isinstance(v, item_type) for v in value):
            raise ConfigError(key.dotted, f"must be a list of {item_type.__name__}, got {value!r}")
        return list(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(key.dotted, f"must be of type {hint.__name__}, got {value!r} "
                                      f"({type(value).__name__})")
    return value


def parse_text_value(key: ConfigKey, text: str) -> Any:
    """Parse a command-line string for `key` with TOML's syntax, falling back to a bare string."""
    hint = key.hint
    if hint is str or typing.get_origin(hint) is Literal:
        return check_value(key, text)
    if typing.get_origin(hint) is list and not text.lstrip().startswith("["):
        return check_value(key, [part for part in text.split(",") if part])
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return check_value(key, value)


def build_config(file_values: typing.Mapping[str, Any] | None = None,
                 overrides: typing.Mapping[str, Any] | None = None) -> Config:
    """A Config from TOML data (nested tables) and dotted overrides; every key checked."""
    keys = {key.dotted: key for key in config_keys()}
    sections = {key.section for key in keys.values()}
    values: dict[str, Any] = {}
    for section, table in (file_values or {}).items():
        if section not in sections:
            raise ConfigError(section, f"unknown section; known sections: {', '.join(sorted(sections))}")
        if not isinstance(table, dict):
            raise ConfigError(section, "must be a table ([section])")
        for name, value in table.items():
            dotted = f"{section}.{name}"
            if dotted not in keys:
                known = ", ".join(k.name for k in keys.values() if k.section == section)
                raise ConfigError(dotted, f"unknown key; known keys in [{section}]: {known}")
            values[dotted] = check_value(keys[dotted], value)
    for dotted, value in (overrides or {}).items():
        if dotted not in keys:
            raise ConfigError(dotted, "unknown key; `dedlocd --print-default-config` lists them")
        values[dotted] = check_value(keys[dotted], value)
    per_section: dict[str, dict[str, Any]] = {s: {} for s in sections}
    for dotted, value in values.items():
        section, name = dotted.split(".", 1)
        per_section[section][name] = value
    hints = typing.get_type_hints(Config)
    config = Config(**{s: hints[s](**per_section[s]) for s in sections})
    _check_addresses(config)
    _check_rpc(config)
    _check_dashboard(config)
    return config


def _check_rpc(config: Config) -> None:
    mode = config.rpc.socket_mode
    if not 0 <= mode <= 0o777:
        raise ConfigError("rpc.socket_mode", f"{mode} is not a permission mode; write it in octal, "
                                             "like 0o660 (--rpc.socket_mode 0o660)")
    if mode & 0o600 != 0o600:
        raise ConfigError("rpc.socket_mode", f"0o{mode:o} does not let the daemon's own user read "
                                             "and write the socket; include 0o600 (e.g. 0o660)")
    if config.rpc.tcp_listen:
        try:
            loopback_address(config.rpc.tcp_listen)
        except ValueError as exc:
            raise ConfigError("rpc.tcp_listen", str(exc)) from None


def _check_dashboard(config: Config) -> None:
    if config.dashboard.listen:
        from .web.server import loopback_listen_address

        try:
            loopback_listen_address(config.dashboard.listen)
        except ValueError as exc:
            raise ConfigError("dashboard.listen", str(exc)) from None


def _check_addresses(config: Config) -> None:
    for name in ("listen", "announce", "bootstrap"):
        for text in getattr(config.net, name):
            try:
                address = PeerAddress.parse(text)
            except ValueError as exc:
                raise ConfigError(f"net.{name}", str(exc)) from None
            if name == "bootstrap" and address.peer_id is None:
                raise ConfigError("net.bootstrap", f"{text!r} names no peer: append /p2p/<peer-id> "
                                                   "(dedloc info prints a peer's addresses)")


def load_config(path: Path | None, overrides: typing.Mapping[str, Any] | None = None) -> Config:
    file_values: dict[str, Any] = {}
    if path is not None:
        try:
            file_values = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError("--config", f"{path} does not exist") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
    return build_config(file_values, overrides)


def render_default_config() -> str:
    """The defaults as a commented TOML document that `load_config` reads back unchanged."""
    lines = ["# dedlocd configuration. Every key can also be set on the command line as",
             "# --section.key VALUE (for example --log.level debug).", ""]
    section = None
    for key in config_keys():
        if key.section != section:
            if section is not None:
                lines.append("")
            section = key.section
            lines.append(f"[{section}]")
        lines.append(f"# {key.doc}")
        lines.append(f"{key.name} = {_toml_value(key)}")
    return "\n".join(lines) + "\n"


def _toml_value(key: ConfigKey) -> str:
    value = key.default
    if key.name == "socket_mode":
        return f"0o{value:o}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    return repr(value)
