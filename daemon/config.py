"""The daemon's configuration: one typed object, parsed once at start-up.

Sources, later ones winning: built-in defaults, one TOML file (`--config`), command-line options
(`--section.key value`, one per key). An unknown key or a value of the wrong type is refused with
the key's name. `dedlocd --print-default-config` prints the documented defaults as TOML.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dedloc.rpc import TOKEN_FILE_NAME, loopback_address

from .errors import ConfigError
from .net.addresses import PeerAddress
from .net.ratelimit import check_rate


def _doc(text: str, **kwargs: Any) -> Any:
    return field(metadata={"doc": text}, **kwargs)


@dataclass(frozen=True)
class NodeSection:
    state_dir: str = _doc(
        "Directory for the identity key, checkpoints and run state. Empty: $STATE_DIRECTORY "
        "(set by systemd), else ~/.local/state/dedloc.", default="")
    runtime_dir: str = _doc(
        "Directory for sockets. Empty: $RUNTIME_DIRECTORY (set by systemd), else the state "
        "directory.", default="")
    role: Literal["trainer", "aux"] = _doc(
        "What this daemon's collaborative runs are by default: trainer (a worker trains the "
        "model) or aux (no worker: it lends its bandwidth to the run's averaging rounds).",
        default="trainer")


@dataclass(frozen=True)
class LogSection:
    level: Literal["debug", "info", "warning", "error"] = _doc("Least severe level logged.",
                                                              default="info")
    format: Literal["auto", "json", "console"] = _doc(
        "auto: JSON lines when stderr is not a terminal (journald), coloured text when it is.",
        default="auto")


@dataclass(frozen=True)
class RpcSection:
    socket: str = _doc("Control socket path. Empty: <runtime_dir>/dedlocd.sock.", default="")
    socket_mode: int = _doc(
        "Permissions of the control socket (octal in TOML: 0o660). The owner needs rw (0o600). "
        "Whatever the mode, only root, the daemon's user and members of its group are served "
        "(checked by their kernel credentials).", default=0o660)
    max_request_bytes: int = _doc("Longest request line accepted; longer ones are refused "
                                  "and the connection closed.", default=1 << 20)
    max_connections: int = _doc("Most control connections served at once.", default=64)
    idle_timeout: float = _doc("Seconds a control connection may stay silent before it is "
                               "closed.", default=3600.0)
    tcp_listen: str = _doc(
        "Also serve the control API on this loopback TCP address (127.0.0.1:PORT or [::1]:PORT; "
        "port 0 picks a free one, node.info shows it). Each connection must first send "
        "rpc.authenticate with the token in <state_dir>/rpc-token (made on first use, mode 0600). "
        "Empty: no TCP listener. Other addresses are refused.", default="")


@dataclass(frozen=True)
class WorkersSection:
    command: list[str] = _doc(
        "Command that starts a worker; the daemon appends --socket PATH --parent-pid PID. "
        "Empty: this Python running dedloc.plugins.worker.", default_factory=list)
    start_timeout: float = _doc("Seconds a worker may take to start and load its workload.",
                                default=180.0)
    call_timeout: float = _doc("Seconds one worker call (train, export, ...) may take.",
                               default=600.0)
    stop_timeout: float = _doc("Seconds a worker may take to stop before it is killed.",
                               default=20.0)
    threads: int = _doc("CPU threads a worker may use for compute; 0: the library's default.",
                        default=0)
    device: str = _doc('Device for workers: "auto" (a GPU if there is one), "cpu", "cuda", '
                       '"cuda:N", several comma-separated ("cuda:0,cuda:1") or "cuda:all": one '
                       "worker process per device, data-parallel, still one peer.", default="auto")
    log_lines: int = _doc("Lines of each worker's output kept for run.status.", default=50)
    list_cache_seconds: float = _doc("Seconds the list of installed workloads is cached.",
                                     default=60.0)
    gpu_memory_fraction: float = _doc("Most of each GPU's memory a worker may take, as a fraction "
                                      "(torch's per-process cap); 0: no cap.", default=0.0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ConfigError("workers.gpu_memory_fraction", "must be between 0 (no cap) and 1")


@dataclass(frozen=True)
class LimitsSection:
    hours: str = _doc("Train only in these windows of local time, like 22:00-07:00 or "
                      "12:00-13:30,19:00-24:00; empty: always. Outside them runs leave their "
                      "rounds and wait.", default="")
    idle_only: bool = _doc("Train only while other programs leave the CPU idle (see idle_cpu_share "
                           "and idle_seconds).", default=False)
    idle_cpu_share: float = _doc("idle_only: the machine is busy while other programs use more "
                                 "than this share of its CPU time.", default=0.25)
    idle_seconds: float = _doc("idle_only: how long the machine must stay idle before training "
                               "starts again.", default=300.0)

    def __post_init__(self) -> None:
        from .collab.availability import TrainingHours

        try:
            TrainingHours.parse(self.hours)
        except ValueError as exc:
            raise ConfigError("limits.hours", str(exc)) from None
        if not 0.0 < self.idle_cpu_share <= 1.0:
            raise ConfigError("limits.idle_cpu_share", "must be in (0, 1]")
        if self.idle_seconds < 0:
            raise ConfigError("limits.idle_seconds", "must be 0 or more")


@dataclass(frozen=True)
class NetSection:
    listen: list[str] = _doc(
        "Addresses to listen on for peers, like /ip4/0.0.0.0/tcp/4100. Port 0 picks a free port; "
        "a peer that others bootstrap from, or whose port is forwarded, wants a fixed one.",
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = _doc(
        "Addresses to tell other peers instead of the listening ones (e.g. a forwarded public "
        "address). Empty: the listening addresses.", default_factory=list)
    bootstrap: list[str] = _doc(
        "Peers to join through, like /ip4/203.0.113.5/tcp/4100/p2p/<peer-id> (repeat "
        "--net.bootstrap or give a comma-separated list). Unreachable ones are retried in the "
        "background; start-up never fails because of them.", default_factory=list)
    handshake_timeout: float = _doc("Seconds a peer may take for the TLS and identity handshake.",
                                    default=10.0)
    call_timeout: float = _doc("Default deadline of one peer-to-peer call, in seconds.", default=10.0)
    max_frame_bytes: int = _doc("Largest frame payload a peer may send.", default=16 << 20)
    max_streams_per_peer: int = _doc("Most concurrent calls and streams one peer may open.",
                                     default=256)
    idle_timeout: float = _doc("Seconds an unused link to a peer stays open.", default=600.0)
    stun: bool = _doc(
        "Answer STUN binding requests on a UDP port so that peers behind NATs learn their public "
        "address from this daemon (no outside STUN server is ever used).", default=True)
    ice_servers: list[str] = _doc(
        "Extra STUN/TURN servers for WebRTC, e.g. stun:host:3478 or "
        "turn:user:password@host:3478?transport=udp (a coturn the run's owner operates). The "
        "daemon never uses a server that is not listed here or a peer of the run.",
        default_factory=list)
    webrtc: bool = _doc("Try WebRTC (ICE hole punching) when a peer is only reachable through a "
                        "relay.", default=True)
    holepunch: bool = _doc("Try TCP hole punching (before WebRTC) when a peer is only reachable "
                           "through a relay.", default=True)
    stun_port: int = _doc(
        "UDP port for STUN; 0: the same number as the TCP listen port if free, else any free port.",
        default=0)
    upload_bytes_per_second: float = _doc(
        "Cap on the bytes per second this daemon sends to all its peers together (every link and "
        "path; frame bytes, not counting TLS/TCP overhead). 0: no cap; else at least 16384. "
        "`dedloc bandwidth` changes it at run time (until the daemon restarts); averaging "
        "advertises at most this upload to its groups.", default=0.0)
    download_bytes_per_second: float = _doc(
        "Cap on the bytes per second this daemon reads from all its peers together (reading slows, "
        "so senders back off). 0: no cap; else at least 16384.", default=0.0)

    def __post_init__(self) -> None:
        for name in ("upload_bytes_per_second", "download_bytes_per_second"):
            try:
                check_rate(name, getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"net.{name}", str(exc)) from None


@dataclass(frozen=True)
class DhtSection:
    client_mode: Literal["auto", "yes", "no"] = _doc(
        "Serve the DHT (no), only query it (yes), or decide from whether other peers can dial us "
        "(auto).", default="auto")
    k: int = _doc("Bucket size: how many peers per distance range the routing table keeps.",
                  default=20)
    replicas: int = _doc("How many of the closest peers hold each record (and a read asks).",
                         default=8)
    alpha: int = _doc("Parallel requests per lookup step.", default=3)
    lookup_timeout: float = _doc("Deadline of one lookup, in seconds.", default=10.0)
    max_value_bytes: int = _doc("Largest value accepted for storage.", default=64 << 10)
    max_records: int = _doc("Most entries this node stores for others.", default=100_000)
    refresh_interval: float = _doc("Seconds between refreshes of an idle bucket.", default=600.0)
    republish_interval: float = _doc("Seconds between republishing records to the closest peers.",
                                     default=300.0)


@dataclass(frozen=True)
class AveragingSection:
    upload_mbps: float = _doc("Starting guess of this machine's upload bandwidth in Mbit/s; "
                              "replaced by what transfers measure.", default=100.0)
    download_mbps: float = _doc("Starting guess of the download bandwidth in Mbit/s.", default=100.0)
    chunk_bytes: int = _doc("Size of the chunks a vector is streamed in (1-4 MiB is best).",
                            default=4 << 20)
    window: float = _doc("Seconds matchmaking gathers peers for a round.", default=5.0)
    max_group_size: int = _doc("Most peers averaging in one group.", default=64)
    balancing: Literal["lp", "uniform"] = _doc(
        "How the vector is split among reducers: lp (by measured bandwidth, DeDLOC) or uniform "
        "(equal parts; for comparison).", default="lp")
    history: int = _doc("How many past rounds averaging.status keeps.", default=50)
    # Data hygiene (docs/averaging.md, "Bad contributions"); NaN/Inf and wrong lengths are always
    # rejected.
    max_value: float = _doc("A received contribution holding a value of larger magnitude is "
                            "rejected.", default=1e12)
    max_norm_ratio: float = _doc(
        "With 3 or more senders, a sender whose chunk's L2 norm is over this many times the median "
        "of the other senders' is rejected (0: no such rule; else at least 1).", default=1000.0)
    robust_aggregation: Literal["none", "centered_clip"] = _doc(
        "none: weighted mean; centered_clip: centered clipping around the coordinate-wise median "
        "(for open runs; every contribution of a chunk is kept until it is averaged).",
        default="none")
    clip_radius: float = _doc("centered_clip: the clipping radius, in median distances of the "
                              "contributions to the median.", default=2.0)
    clip_iterations: int = _doc("centered_clip: clipping iterations per chunk.", default=3)
    ban_after: int = _doc("Rounds with a rejected contribution (within offence_window) after which "
                          "a peer is banned (0: never).", default=3)
    offence_window: float = _doc("Seconds an offence counts towards a ban.", default=3600.0)
    ban_seconds: float = _doc("How long a ban lasts: the peer is not admitted to groups led here and "
                              "its streams are refused.", default=600.0)

    def __post_init__(self) -> None:
        for name in ("max_value", "clip_radius", "offence_window", "ban_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"averaging.{name}", "must be positive")
        if self.max_value > 1e30:
            raise ConfigError("averaging.max_value", "must be at most 1e30 (sums must not overflow)")
        if not (self.max_norm_ratio == 0 or self.max_norm_ratio >= 1):
            raise ConfigError("averaging.max_norm_ratio", "must be 0 (off) or at least 1")
        if self.clip_iterations < 1:
            raise ConfigError("averaging.clip_iterations", "must be at least 1")
        if self.ban_after < 0:
            raise ConfigError("averaging.ban_after", "must be 0 (never ban) or more")


@dataclass(frozen=True)
class RelaySection:
    serve: bool = _doc("Relay links for peers that nobody can dial, when this node is reachable "
                       "(bounded by the limits below).", default=True)
    reserve: int = _doc("When nobody can dial this node: on how many reachable peers it keeps a "
                        "relay slot (its circuit addresses).", default=2)
    max_reservations: int = _doc("Most peers that may hold a slot on this relay.", default=128)
    max_circuits_per_peer: int = _doc("Most relayed links at once per relayed peer.", default=8)
    bytes_per_second_per_peer: float = _doc(
        "Bytes per second this relay carries for one relayed peer (all its circuits together).",
        default=4 * 1024 * 1024)
    max_circuit_seconds: float = _doc("Longest life of one relayed link, in seconds.", default=3600.0)
    members_only: bool = _doc("Relay only for members of the closed runs this node takes part in "
                              "(they present their tokens); false: for any peer.", default=False)


@dataclass(frozen=True)
class DashboardSection:
    listen: str = _doc(
        "Serve a read-only web dashboard (/), its data (/api/snapshot) and Prometheus metrics "
        "(/metrics) on this loopback address (127.0.0.1:PORT or [::1]:PORT; port 0 picks a free "
        "one, node.info shows it). Empty: off. Other addresses are refused.", default="")


@dataclass(frozen=True)
class RunSection:
    join: str = _doc(
        "Join the collaborative run of this name whenever the daemon starts (as `dedloc join NAME` "
        "does), retrying with backoff until a peer publishes it. A run the volunteer stops "
        "(dedloc stop) stays stopped, restarts included, until it is started again. Empty: none.",
        default="")
    token: str = _doc("The membership token of a closed run (from its owner's `dedloc token "
                      "issue`): join that run at start. token_file keeps it private.", default="")
    token_file: str = _doc("A file holding that token (mode 0600, readable by the daemon's user); "
                           "`dedloc service install --token` writes /etc/dedloc/run-token.",
                           default="")
    aux: bool = _doc("Join that run as an aux peer (no worker: it reduces in the run's rounds).",
                     default=False)
    device: str = _doc("Device for that run's worker; empty: workers.device.", default="")
    manifest: str = _doc(
        "The run owner's side: a manifest file written by `dedloc run create`; the run it "
        "describes is started (resumed from its checkpoint) whenever the daemon starts. Empty: "
        "none.", default="")
    retry_max_seconds: float = _doc("Longest wait between two attempts to join (the waits grow "
                                    "from 2 s, with jitter).", default=60.0)

    def __post_init__(self) -> None:
        from .collab.autojoin import check_run_section

        try:
            check_run_section(self)
        except ValueError as exc:
            raise ConfigError(f"run.{exc.args[0]}", exc.args[1]) from None


@dataclass(frozen=True)
class Config:
    node: NodeSection = field(default_factory=NodeSection)
    log: LogSection = field(default_factory=LogSection)
    rpc: RpcSection = field(default_factory=RpcSection)
    net: NetSection = field(default_factory=NetSection)
    dht: DhtSection = field(default_factory=DhtSection)
    relay: RelaySection = field(default_factory=RelaySection)
    averaging: AveragingSection = field(default_factory=AveragingSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    run: RunSection = field(default_factory=RunSection)
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
        return list(self.workers.command) or [sys.executable, "-m", "dedloc.plugins.worker"]


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
