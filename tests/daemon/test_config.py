"""Configuration: one typed object; unknown keys and wrong types are refused by name."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dedloc.daemon.config import (
    Config,
    ConfigError,
    build_config,
    config_keys,
    load_config,
    render_default_config,
)


def test_defaults_round_trip_through_the_printed_file(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text(render_default_config())
    assert load_config(path) == Config()
    documented = tomllib.loads(path.read_text())
    assert {f"{s}.{k}" for s, table in documented.items() for k in table} == {
        key.dotted for key in config_keys()}


def test_values_and_overrides() -> None:
    config = build_config({"rpc": {"max_connections": 5, "idle_timeout": 3}},
                          {"log.level": "debug", "rpc.max_connections": 7})
    assert config.rpc.max_connections == 7
    assert config.rpc.idle_timeout == 3.0 and isinstance(config.rpc.idle_timeout, float)
    assert config.log.level == "debug"


def test_limit_loopback_reaches_the_transport() -> None:
    assert not build_config().net.transport_limits().limit_loopback
    config = build_config(None, {"net.limit_loopback": True})
    assert config.net.transport_limits().limit_loopback


@pytest.mark.parametrize(("values", "key", "reason"), [
    ({"rpc": {"sockett": "x"}}, "rpc.sockett", "unknown key"),
    ({"rcp": {}}, "rcp", "unknown section"),
    ({"rpc": {"max_connections": "many"}}, "rpc.max_connections", "must be of type int"),
    ({"rpc": {"max_connections": True}}, "rpc.max_connections", "must be of type int"),
    ({"log": {"level": "loud"}}, "log.level", "must be one of"),
    ({"workers": {"command": "python"}}, "workers.command", "must be a list of str"),
    ({"rpc": 3}, "rpc", "must be a table"),
    ({"net": {"listen": ["/ip4/1.2.3/tcp/1"]}}, "net.listen", "1.2.3"),
    ({"net": {"bootstrap": ["/ip4/127.0.0.1/tcp/4100"]}}, "net.bootstrap", "names no peer"),
])
def test_bad_values_name_the_key(values: dict, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(values)
    assert caught.value.key == key
    assert reason in str(caught.value)


def test_environment_paths() -> None:
    config = Config()
    env = {"STATE_DIRECTORY": "/var/lib/dedloc", "RUNTIME_DIRECTORY": "/run/dedlocd"}
    assert config.state_dir(env) == Path("/var/lib/dedloc")
    assert config.socket_path(env) == Path("/run/dedlocd/dedlocd.sock")
    assert config.socket_path({"STATE_DIRECTORY": "/s"}) == Path("/s/dedlocd.sock")
    assert Config().state_dir({}).parts[-3:] == (".local", "state", "dedloc")


def dedlocd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dedloc.daemon", *args], capture_output=True,
                          text=True, timeout=60)


def test_command_line_refuses_bad_keys_with_their_name(tmp_path: Path) -> None:
    bad_file = tmp_path / "bad.toml"
    bad_file.write_text('[rpc]\nmax_connections = "lots"\n')
    result = dedlocd("--config", str(bad_file))
    assert result.returncode == 2
    assert "rpc.max_connections" in result.stderr and "int" in result.stderr
    result = dedlocd("--log.level", "loud")
    assert result.returncode == 2 and "log.level" in result.stderr
    unknown_file = tmp_path / "unknown.toml"
    unknown_file.write_text("[node]\ncolour = 'blue'\n")
    result = dedlocd("--config", str(unknown_file))
    assert result.returncode == 2 and "node.colour" in result.stderr
    result = dedlocd("--config", str(tmp_path / "missing.toml"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_list_keys_repeat_or_take_commas() -> None:
    from dedloc.daemon.main import build_parser, overrides_from_args

    args = build_parser().parse_args(["--net.listen", "/ip4/127.0.0.1/tcp/1,/ip4/127.0.0.1/tcp/2",
                                      "--net.listen", "/ip4/127.0.0.1/tcp/3", "--log.level", "debug"])
    overrides = overrides_from_args(args)
    assert overrides == {"net.listen": ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2",
                                        "/ip4/127.0.0.1/tcp/3"], "log.level": "debug"}
    assert build_config(overrides=overrides).net.listen[2] == "/ip4/127.0.0.1/tcp/3"


def test_print_default_config() -> None:
    result = dedlocd("--print-default-config")
    assert result.returncode == 0
    assert tomllib.loads(result.stdout)["rpc"]["socket_mode"] == 0o660
