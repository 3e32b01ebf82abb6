"""A small shaped network for benchmarks: one network namespace per peer on a bridge, `tc`
token-bucket shaping of each peer's upload and download. Needs root, iproute2 and tc.

Addresses 10.231.0.0/24 on a bridge that exists only inside this machine; nothing is routed
anywhere else. `NetLab` creates everything with unique names and removes it on close.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

PROFILES = Path(__file__).with_name("netlab_profiles.toml")
SUBNET = "10.231.0"


@dataclass(frozen=True)
class LinkProfile:
    upload_mbit: float
    download_mbit: float


def load_profile(name: str) -> list[LinkProfile]:
    profiles = tomllib.loads(PROFILES.read_text())
    if name not in profiles:
        raise SystemExit(f"unknown netlab profile {name!r}; known: {', '.join(profiles)}")
    return [LinkProfile(float(p["upload"]), float(p["download"])) for p in profiles[name]["peers"]]


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def _shape(device: str, mbit: float, namespace: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    burst = max(32, int(mbit * 1000 / 8 / 100))  # ~10 ms of traffic, in KiB
    _run(*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
         "burst", f"{burst}kb", "latency", "50ms")


class NetLab:
    def __init__(self, profile: list[LinkProfile]) -> None:
        if os.geteuid() != 0:
            raise SystemExit("--netlab needs root (network namespaces and tc)")
        self.tag = secrets.token_hex(2)
        self.bridge = f"dlbr{self.tag}"
        self.namespaces: list[str] = []
        self.addresses: list[str] = []
        self.profile = profile

    def __enter__(self) -> NetLab:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for index, link in enumerate(self.profile):
                namespace = f"dl{self.tag}p{index}"
                host_side, peer_side = f"dlh{self.tag}{index}", f"dlp{self.tag}{index}"
                address = f"{SUBNET}.{index + 10}"
                _run("ip", "netns", "add", namespace)
                self.namespaces.append(namespace)
                _run("ip", "link", "add", host_side, "type", "veth", "peer", "name", peer_side)
                _run("ip", "link", "set", peer_side, "netns", namespace)
                _run("ip", "link", "set", host_side, "master", self.bridge)
                _run("ip", "link", "set", host_side, "up")
                _run("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{address}/24", "dev", peer_side)
                _run("ip", "netns", "exec", namespace, "ip", "link", "set", peer_side, "up")
                _run("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")
                _shape(peer_side, link.upload_mbit, namespace)  # what the peer sends
                _shape(host_side, link.download_mbit)  # what the bridge delivers to the peer
                self.addresses.append(address)
        except BaseException:
            self.close()
            raise
        return self

    def command(self, index: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index], *argv]

    def close(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        self.namespaces.clear()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
