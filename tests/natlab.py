"""A small internet on this machine, built from network namespaces, for NAT traversal tests.

    lab = NatLab()                                   # or the `natlab` fixture (tests/conftest.py)
    stun = lab.add_public_host("stun")               # on the internet: 10.240.<lab>.10, default route
    home = lab.add_nat("home", NatKind.PORT_RESTRICTED, upload_mbit=50, delay_ms=20)
    alice = lab.add_host_behind(home, "alice")       # 10.241.1.10, default route via the router
    alice.exec("python3", "-c", "...")                # runs inside alice's namespace
    lab.close()                                      # or `await lab.aclose()`; also a context manager

Topology. The "internet" is a bridge in the lab's `inet` namespace (10.240.<lab>.0/24); it holds
the gateway address .1, which silently drops whatever is sent to addresses that do not exist
(so a relay sending to a private address sees a lost packet, as on the internet, and not
ENETUNREACH). Public hosts (.10 up) and routers' WAN ports (.100 up) hang on that bridge. Each
router has a LAN bridge `lan` (10.241.<router>.1/24) with its hosts (.10 up) behind it.

NAT kinds (nftables rules in the router's namespace, table `ip natlab`; see `_router_ruleset`):
  FULL_CONE        masquerade (port-preserving, endpoint-independent mapping) + a dynamic map
                   learned from outgoing packets (mapped port -> private address:port) that DNATs
                   any inbound packet to a mapped port: endpoint-independent filtering.
  PORT_RESTRICTED  masquerade: endpoint-independent mapping; only replies of an existing
                   connection come in (address- and port-dependent filtering), like a home router.
  SYMMETRIC        masquerade fully-random: a new random port for every new 5-tuple.
Every router drops unsolicited packets to its WAN address (no answer, no RST, no ICMP) and
forwards from the WAN only what belongs to an existing connection (or, FULL_CONE, a mapping).

Shaping: tc tbf on the router's WAN egress (upload) and on its LAN bridge's egress (download).
Delay/loss: every packet the router forwards is policy-routed into a TUN device `dly`, held by
natlab_delay.py (user space: this kernel has no netem) and routed onward. So `delay_ms` is
one-way: a round trip through one router takes 2 x delay_ms more, and `loss` applies once in
each direction. Packets on the LAN side of the stage are untracked (raw notrack) so that
connection tracking and NAT see each packet once, on the WAN side.
A public host can have a stage on its own link (`add_public_host(name, delay_ms=, loss=)`): its
cable then runs through a transparent hop, the namespace `<name>-link` (no NAT, no address in
the lab's ranges; proxy ARP on both sides, so the host keeps its public address and /24), whose
stage delays and drops that host's packets only, once in each direction.

Cuts: `host.disconnect()` drops every frame to or from the host where its cable plugs into the
lab (the internet's bridge, or its router's LAN bridge): no carrier loss, no error, no answer,
as in an outage upstream; `host.reconnect()` undoes it.

Nothing is done in the root namespace: no address, no route; veth pairs are created directly
inside the lab's namespaces. All names start with the lab's prefix `dl<6 hex>-`; close() kills
every process in the lab's namespaces and deletes them, and checks that nothing with the prefix
is left. Each lab records its owner (pid and start time) in /run/natlab/; the first lab of a
process removes what labs of dead owners left behind (`sweep_stale`).

Run as a program, this file is also the lab's probe tool (standard library only), see `TOOL`:
  echo --port P            UDP+TCP "what is my address" server (see `_serve_echo`)
  agent [--port P]         a UDP socket driven by stdin commands: whoami, punch, recv, send, rtt, burst
  tcp-send HOST PORT N     send N bytes to an echo server; prints JSON seen address, bytes, seconds
  tcp-fetch HOST PORT N    the same, the echo server sending N bytes (timed by the receiver)
  tcp-probe HOST PORT T    prints connected | refused | timeout
  udp-probe HOST PORT T    prints reply | refused | timeout
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import enum
import ipaddress
import itertools
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PREFIX_RE = re.compile(r"^dl[0-9a-f]{6}-")
NETNS_DIR = Path("/run/netns")
OWNER_DIR = Path("/run/natlab")
DELAY_PROGRAM = Path(__file__).resolve().with_name("natlab_delay.py")
TOOL: tuple[str, ...] = (sys.executable, str(Path(__file__).resolve()))
"""argv prefix of this file's probe tool, e.g. host.exec(*TOOL, "tcp-probe", ip, "80", "1")."""

PUBLIC_SUPERNET = ipaddress.ip_network("10.240.0.0/16")  # 10.240.<lab>.0/24
LAN_SUPERNET = ipaddress.ip_network("10.241.0.0/16")  # 10.241.<router>.0/24
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,19}$")
_INET = "inet"
_STAGE_TABLE = 100
_READY_TIMEOUT = 10.0


class NatLabError(RuntimeError):
    pass


class NatKind(enum.Enum):
    FULL_CONE = "full-cone"  # endpoint-independent mapping and filtering
    PORT_RESTRICTED = "port-restricted"  # EIM, address- and port-dependent filtering
    SYMMETRIC = "symmetric"  # a random mapped port per destination


# ---------------------------------------------------------------------------------------------
# Commands


_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _bin(tool: str) -> str:
    """The tool's full path (root's tools live in /usr/sbin, which a PATH may lack)."""
    return shutil.which(tool, path=_SEARCH_PATH) or tool


def _run(argv: Sequence[str], *, input: str | None = None, check: bool = True,
         timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([_bin(argv[0]), *argv[1:]], input=input, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        detail = f"\n--- input ---\n{input}" if input else ""
        raise NatLabError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}{detail}")
    return done


def _ip_batch(namespace: str | None, lines: Iterable[str]) -> None:
    argv = ["ip", *(["-n", namespace] if namespace else []), "-batch", "-"]
    _run(argv, input="".join(f"{line}\n" for line in lines))


def _sysctl(namespace: str, settings: Mapping[str, object]) -> None:
    # -e: keys this kernel lacks (bridge-nf-* without br_netfilter) are not an error
    _run(["ip", "netns", "exec", namespace, _bin("sysctl"), "-e", "-q", "-w",
          *(f"{key}={value}" for key, value in settings.items())])


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _root_link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(_run(["ip", "-j", "link", "show"]).stdout or "[]")]


def leftovers(prefix: str) -> list[str]:
    """Namespaces (and root-namespace links) whose name starts with the prefix."""
    found = [f"netns {name}" for name in list_namespaces() if name.startswith(prefix)]
    found += [f"link {name}" for name in _root_link_names() if name.startswith(prefix)]
    return found


def remove_prefix(prefix: str) -> None:
    """Kill every process in the prefix's namespaces, delete them and any root link so named."""
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"not a natlab prefix: {prefix!r}")
    for name in list_namespaces():
        if not name.startswith(prefix):
            continue
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", name], check=False)
    for link in _root_link_names():
        if link.startswith(prefix):
            _run(["ip", "link", "del", link], check=False)


def root_network_state() -> dict[str, Any]:
    """The root namespace's addresses, routes, rules and link names (to compare before/after)."""
    def get(*argv: str) -> Any:
        return json.loads(_run(["ip", "-j", *argv]).stdout or "[]")

    return {
        "addresses": sorted((a["ifname"], i["local"], i["prefixlen"])
                            for a in get("addr", "show") for i in a.get("addr_info", [])),
        "routes": sorted(json.dumps(r, sort_keys=True) for r in get("route", "show", "table", "all")),
        "rules": sorted(json.dumps(r, sort_keys=True) for r in get("rule", "show")),
        "links": sorted(_root_link_names()),
    }


# ---------------------------------------------------------------------------------------------
# Owners and the sweep of leftovers


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime


def _owner_file(prefix: str) -> Path:
    return OWNER_DIR / f"{prefix.rstrip('-')}.owner"


def _owner_alive(prefix: str) -> bool:
    try:
        pid_text, start = _owner_file(prefix).read_text().split()
    except (OSError, ValueError):
        return False  # written before the first namespace: none means a crashed creator
    return _start_time(int(pid_text)) == start


def sweep_stale() -> list[str]:
    """Remove what labs of dead processes left behind; returns the prefixes removed."""
    prefixes = {m.group(0) for name in list_namespaces() if (m := PREFIX_RE.match(name))}
    prefixes |= {m.group(0) for name in _root_link_names() if (m := PREFIX_RE.match(name))}
    with contextlib.suppress(FileNotFoundError):
        prefixes |= {path.name.removesuffix(".owner") + "-" for path in OWNER_DIR.glob("dl*.owner")}
    removed = []
    for prefix in sorted(prefixes):
        if PREFIX_RE.match(prefix) and not _owner_alive(prefix):
            remove_prefix(prefix)
            _owner_file(prefix).unlink(missing_ok=True)
            removed.append(prefix)
    return removed


_swept = False
_sweep_lock = threading.Lock()


def _sweep_once() -> None:
    global _swept
    with _sweep_lock:
        if not _swept:
            sweep_stale()
            _swept = True


_unavailable: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why a lab cannot be built on this machine (None: it can). Checked once per process."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    missing = [tool for tool in ("ip", "nft", "tc", "sysctl") if not shutil.which(tool, path=_SEARCH_PATH)]
    if missing:
        return f"missing {', '.join(missing)} (`make system-deps` installs them)"
    if not Path("/dev/net/tun").exists():
        return "no /dev/net/tun (the delay stage needs a TUN device)"
    name = f"dl{secrets.token_hex(3)}-probe"
    try:
        _run(["ip", "netns", "add", name])
        _run(["ip", "netns", "exec", name, _bin("nft"), "list", "ruleset"])
    except (NatLabError, OSError) as error:
        return f"`ip netns` does not work here: {error}"
    finally:
        _run(["ip", "netns", "del", name], check=False)
    return None


# ---------------------------------------------------------------------------------------------
# The lab


class Node:
    """A namespace of the lab; processes run in it through `ip netns exec`."""

    def __init__(self, lab: NatLab, name: str) -> None:
        self.lab = lab
        self.name = name
        self.namespace = lab.prefix + name

    def argv(self, *argv: object) -> list[str]:
        return [_bin("ip"), "netns", "exec", self.namespace, *map(str, argv)]

    def run(self, *argv: object, env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen:
        """Start a process in the namespace (killed at the lab's close). `env` is added to ours."""
        self.lab._check_open()
        popen.setdefault("start_new_session", True)
        process = subprocess.Popen(self.argv(*argv), env=_environ(env), **popen)
        self.lab._processes.append(process)
        return process

    def exec(self, *argv: object, env: Mapping[str, str] | None = None, input: str | None = None,
             timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command to completion (text output captured); NatLabError if it fails and check."""
        self.lab._check_open()
        done = subprocess.run(self.argv(*argv), env=_environ(env), input=input, capture_output=True,
                              text=True, timeout=timeout, start_new_session=True)
        if check and done.returncode != 0:
            raise NatLabError(f"in {self.name}: {' '.join(map(str, argv))} exited {done.returncode}\n"
                              f"stdout: {done.stdout}\nstderr: {done.stderr}")
        return done

    async def spawn(self, *argv: object, env: Mapping[str, str] | None = None,
                    **kwargs: Any) -> asyncio.subprocess.Process:
        """Start an asyncio subprocess in the namespace (killed and reaped by `aclose`)."""
        self.lab._check_open()
        kwargs.setdefault("start_new_session", True)
        process = await asyncio.create_subprocess_exec(*self.argv(*argv), env=_environ(env), **kwargs)
        self.lab._async_processes.append(process)
        return process

    def start_echo_server(self, port: int = 3478) -> subprocess.Popen:
        """The probe tool's UDP+TCP "what is my address" server on `port`, once it listens."""
        process = self.run(*TOOL, "echo", "--port", port, stdout=subprocess.PIPE, text=True)
        _wait_ready(process, f"echo server in {self.name}")
        return process

    async def start_agent(self, port: int = 0) -> Agent:
        """The probe tool's UDP agent (see `_agent`), its socket bound to `port`."""
        process = await self.spawn(*TOOL, "agent", "--port", port, stdin=asyncio.subprocess.PIPE,
                                   stdout=asyncio.subprocess.PIPE)
        agent = Agent(self, process)
        line = await agent._line(_READY_TIMEOUT)
        if not line.startswith("bound "):
            raise NatLabError(f"agent in {self.name} did not start: {line!r}")
        agent.port = int(line.split()[1])
        return agent

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.namespace}>"


class Agent:
    """A running UDP agent: `await agent.ask("whoami 10.240.1.10 3478")` -> "mapped ..."."""

    def __init__(self, node: Node, process: asyncio.subprocess.Process) -> None:
        self.node = node
        self.process = process
        self.port = 0

    async def _line(self, timeout: float) -> str:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise NatLabError(f"agent in {self.node.name} exited ({self.process.returncode})")
        return line.decode().strip()

    async def ask(self, command: str, timeout: float = 30.0) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        await self.process.stdin.drain()
        return await self._line(timeout)


def _wait_ready(process: subprocess.Popen, what: str) -> None:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], _READY_TIMEOUT)
    line = process.stdout.readline() if ready else ""
    if line.strip() != "ready":
        raise NatLabError(f"{what} did not start (exit {process.poll()})")


class Host(Node):
    """A machine: on the internet (`router` None) or behind a router."""

    def __init__(self, lab: NatLab, name: str, address: str, router: Router | None,
                 uplink: tuple[str, str]) -> None:
        super().__init__(lab, name)
        self.address = address
        self.router = router
        self.uplink = uplink  # (namespace, bridge port) where the host's cable plugs in
        self.connected = True

    @property
    def public_address(self) -> str:
        """Where the internet sees this host's packets come from."""
        return self.router.wan_address if self.router else self.address

    def _cut_table(self) -> str:
        return "cut_" + self.uplink[1].removeprefix(self.lab.prefix)

    def disconnect(self) -> None:
        """Drop every frame to or from this host at its bridge port (see the module's docstring)."""
        self.lab._check_open()
        if not self.connected:
            return
        namespace, port = self.uplink
        ruleset = "\n".join([
            f"table bridge {self._cut_table()} {{",
            "  chain from_host { type filter hook prerouting priority filter; policy accept;",
            f'    iifname "{port}" drop',
            "  }",
            "  chain to_host { type filter hook postrouting priority filter; policy accept;",
            f'    oifname "{port}" drop',
            "  }",
            "}",
        ]) + "\n"
        _run(["ip", "netns", "exec", namespace, _bin("nft"), "-f", "-"], input=ruleset)
        self.connected = False

    def reconnect(self) -> None:
        """Undo `disconnect()`."""
        self.lab._check_open()
        if self.connected:
            return
        _run(["ip", "netns", "exec", self.uplink[0], _bin("nft"), "delete", "table", "bridge",
              self._cut_table()])
        self.connected = True


class Router(Node):
    def __init__(self, lab: NatLab, name: str, kind: NatKind, wan_address: str,
                 lan_network: ipaddress.IPv4Network, *, upload_mbit: float | None,
                 download_mbit: float | None, delay_ms: float, loss: float) -> None:
        super().__init__(lab, name)
        self.kind = kind
        self.wan_address = wan_address
        self.public_address = wan_address
        self.lan_network = lan_network
        self.lan_address = str(lan_network[1])
        self.upload_mbit = upload_mbit
        self.download_mbit = download_mbit
        self.delay_ms = delay_ms
        self.loss = loss
        self.hosts: list[Host] = []

    @property
    def has_stage(self) -> bool:
        return bool(self.delay_ms or self.loss)


def _environ(env: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if env is None else {**os.environ, **env}


_lab_numbers = itertools.count()
_open_labs: set[NatLab] = set()


@atexit.register
def _close_open_labs() -> None:  # a Ctrl-C that skipped the fixture's teardown
    for lab in list(_open_labs):
        with contextlib.suppress(Exception):
            lab.close()


class NatLab:
    """See the module's docstring. Build with add_*; close() (or aclose()) removes everything."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise NatLabError(reason)
        _sweep_once()
        self.prefix = f"dl{secrets.token_hex(3)}-"
        self.index = next(_lab_numbers) % 250 + 1
        self.public_network = ipaddress.ip_network(f"10.240.{self.index}.0/24")
        self.gateway = str(self.public_network[1])
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, Router] = {}
        self._names: set[str] = set()
        self._links = itertools.count(1)
        self._processes: list[subprocess.Popen] = []
        self._async_processes: list[asyncio.subprocess.Process] = []
        self._closed = False
        _check_no_overlap()
        OWNER_DIR.mkdir(parents=True, exist_ok=True)
        _owner_file(self.prefix).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        _open_labs.add(self)
        try:
            self._add_namespace(_INET, {})
            _ip_batch(self.prefix + _INET, [
                "link add name br type bridge",
                f"addr add {self.gateway}/24 dev br",
                "link set dev br up",
            ])
        except BaseException:
            self.close()
            raise

    # -- building ----------------------------------------------------------------------------

    def add_public_host(self, name: str, *, delay_ms: float = 0, loss: float = 0.0) -> Host:
        """A host on the internet with its own public address and a default route. With
        `delay_ms` or `loss`, its link has its own delay/loss stage (see the module's docstring)."""
        self._check_open()
        if not 0.0 <= loss < 1.0 or delay_ms < 0:
            raise ValueError("need 0 <= loss < 1 and delay_ms >= 0")
        public = [h for h in self.hosts.values() if h.router is None]
        if len(public) >= 90:
            raise NatLabError("at most 90 public hosts")
        address = str(self.public_network[10 + len(public)])
        self._add_namespace(name, {})
        if delay_ms or loss:
            uplink = self._add_link_stage(name, address, delay_ms, loss)
        else:
            uplink = (self.prefix + _INET, self._plug_into_internet(name, "eth0"))
        _ip_batch(self.prefix + name, [
            f"addr add {address}/24 dev eth0",
            "link set dev eth0 up",
            f"route add default via {self.gateway}",
        ])
        host = Host(self, name, address, None, uplink)
        self.hosts[name] = host
        return host

    def _add_link_stage(self, name: str, address: str, delay_ms: float, loss: float) -> tuple[str, str]:
        """The transparent hop `<name>-link` between the host's eth0 (its `lan`) and the internet
        (its `wan`), with a delay/loss stage; returns the host's uplink (namespace, port)."""
        link = f"{name}-link"
        self._add_namespace(link, {
            "net.ipv4.ip_forward": 1,
            "net.ipv4.conf.all.rp_filter": 0,
            "net.ipv4.conf.default.rp_filter": 0,
        }, internal=True)
        _run(["ip", "link", "add", "name", "eth0", "netns", self.prefix + name, "type", "veth",
              "peer", "name", "lan", "netns", self.prefix + link])
        port = self._plug_into_internet(link, "wan")
        _ip_batch(self.prefix + link, [
            # an address of its own (outside the lab's ranges) is the source of its ARP requests:
            # a proxy answers none from 0.0.0.0 (two staged hosts would not find each other)
            f"addr add 169.254.{self.index}.{address.rsplit('.', 1)[1]}/32 dev wan",
            "link set dev lan up",
            "link set dev wan up",
            f"route add {address}/32 dev lan",
            f"route add {self.public_network} dev wan",
            "tuntap add dev dly mode tun",
            "link set dev dly up",
            f"route add default dev dly table {_STAGE_TABLE}",
            # only the host's packets enter the stage (and so only its address is proxied on the
            # internet's side: an ARP request is answered where its route leaves by another device)
            f"rule add iif lan from {address} lookup {_STAGE_TABLE}",
            f"rule add iif wan to {address} lookup {_STAGE_TABLE}",
        ])
        _sysctl(self.prefix + link, {
            "net.ipv4.conf.lan.proxy_arp": 1,
            "net.ipv4.conf.wan.proxy_arp": 1,
            "net.ipv4.neigh.lan.proxy_delay": 0,
            "net.ipv4.neigh.wan.proxy_delay": 0,
        })
        self._start_stage(Node(self, link), delay_ms, loss)
        return self.prefix + _INET, port

    def add_nat(self, name: str, kind: NatKind, *, upload_mbit: float | None = None,
                download_mbit: float | None = None, delay_ms: float = 0, loss: float = 0.0) -> Router:
        """A NAT router: WAN on the internet, an empty LAN behind it (see add_host_behind)."""
        self._check_open()
        if len(self.routers) >= 150:
            raise NatLabError("at most 150 routers")
        if not 0.0 <= loss < 1.0 or delay_ms < 0:
            raise ValueError("need 0 <= loss < 1 and delay_ms >= 0")
        for rate in (upload_mbit, download_mbit):
            if rate is not None and rate <= 0:
                raise ValueError("rates are positive Mbit/s (or None: unshaped)")
        router = Router(self, name, NatKind(kind), str(self.public_network[100 + len(self.routers)]),
                        ipaddress.ip_network(f"10.241.{len(self.routers) + 1}.0/24"),
                        upload_mbit=upload_mbit, download_mbit=download_mbit, delay_ms=delay_ms,
                        loss=loss)
        ns = router.namespace
        self._add_namespace(name, {
            "net.ipv4.ip_forward": 1,
            "net.ipv4.conf.all.rp_filter": 0,
            "net.ipv4.conf.default.rp_filter": 0,
        })
        self.routers[name] = router
        self._plug_into_internet(name, "wan")
        lines = [
            "link add name lan type bridge",
            f"addr add {router.lan_address}/{router.lan_network.prefixlen} dev lan",
            "link set dev lan up",
            f"addr add {router.wan_address}/24 dev wan",
            "link set dev wan up",
            f"route add default via {self.gateway}",
        ]
        if router.has_stage:
            lines += [
                "tuntap add dev dly mode tun",
                "link set dev dly up",
                f"route add default dev dly table {_STAGE_TABLE}",
                f"rule add iif lan lookup {_STAGE_TABLE}",
                f"rule add iif wan lookup {_STAGE_TABLE}",
            ]
        _ip_batch(ns, lines)
        _run(["ip", "netns", "exec", ns, _bin("nft"), "-f", "-"], input=_router_ruleset(router))
        for device, rate in (("wan", upload_mbit), ("lan", download_mbit)):
            if rate is not None:
                burst = max(32 * 1024, int(rate * 1e6 / 8 * 0.004))  # >= 4 ms of traffic
                _run(["tc", "-n", ns, "qdisc", "add", "dev", device, "root", "tbf",
                      "rate", f"{rate}mbit", "burst", str(burst), "latency", "50ms"])
        if router.has_stage:
            self._start_stage(router, router.delay_ms, router.loss)
        return router

    def add_host_behind(self, router: Router, name: str) -> Host:
        """A private host on the router's LAN, its default route via the router."""
        self._check_open()
        if self.routers.get(router.name) is not router:
            raise NatLabError(f"{router!r} is not a router of this lab")
        if len(router.hosts) >= 200:
            raise NatLabError("at most 200 hosts behind a router")
        address = str(router.lan_network[10 + len(router.hosts)])
        self._add_namespace(name, {})
        port = f"{self.prefix}h{next(self._links)}"
        _run(["ip", "link", "add", "name", "eth0", "netns", self.prefix + name, "type", "veth",
              "peer", "name", port, "netns", router.namespace])
        _ip_batch(router.namespace, [f"link set dev {port} master lan", f"link set dev {port} up"])
        _ip_batch(self.prefix + name, [
            f"addr add {address}/{router.lan_network.prefixlen} dev eth0",
            "link set dev eth0 up",
            f"route add default via {router.lan_address}",
        ])
        host = Host(self, name, address, router, (router.namespace, port))
        router.hosts.append(host)
        self.hosts[name] = host
        return host

    def _add_namespace(self, name: str, settings: Mapping[str, object], *, internal: bool = False) -> None:
        """`internal`: a name the lab makes itself (with a dash, so no node's name can take it)."""
        if not (internal or _NAME_RE.match(name)) or (name == _INET and self._names):
            raise ValueError(f"node names are [a-z][a-z0-9]{{0,19}}, not {name!r}")
        if name in self._names:
            raise ValueError(f"{name!r} is taken in this lab")
        self._names.add(name)
        namespace = self.prefix + name
        _run(["ip", "netns", "add", namespace])
        _sysctl(namespace, {
            "net.ipv6.conf.all.disable_ipv6": 1,  # the lab is IPv4: no link-local chatter
            "net.ipv6.conf.default.disable_ipv6": 1,
            "net.bridge.bridge-nf-call-iptables": 0,  # bridges switch frames, nothing more
            "net.bridge.bridge-nf-call-arptables": 0,
            **settings,
        })
        _ip_batch(namespace, ["link set dev lo up"])

    def _plug_into_internet(self, name: str, device: str) -> str:
        """A veth from the node's `device` to a port of the internet's bridge; returns the port."""
        port = f"{self.prefix}p{next(self._links)}"  # <= 15 characters
        _run(["ip", "link", "add", "name", device, "netns", self.prefix + name, "type", "veth",
              "peer", "name", port, "netns", self.prefix + _INET])
        _ip_batch(self.prefix + _INET, [f"link set dev {port} master br", f"link set dev {port} up"])
        return port

    def _start_stage(self, node: Node, delay_ms: float, loss: float) -> None:
        # rp_filter is off (the stage re-injects packets from a device they were not routed to)
        _sysctl(node.namespace, {"net.ipv4.conf.dly.rp_filter": 0})
        process = node.run(sys.executable, DELAY_PROGRAM, "--dev", "dly",
                           "--delay-ms", delay_ms, "--loss", loss, stdout=subprocess.PIPE, text=True)
        _wait_ready(process, f"the delay stage of {node.name}")

    # -- closing -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise NatLabError("this lab is closed")

    def namespaces(self) -> list[str]:
        return [name for name in list_namespaces() if name.startswith(self.prefix)]

    def close(self) -> None:
        """Kill every process the lab started or that runs in its namespaces; delete them all."""
        if self._closed:
            return
        self._closed = True
        _open_labs.discard(self)
        for process in [*self._processes, *self._async_processes]:
            if process.returncode is None and (not isinstance(process, subprocess.Popen)
                                               or process.poll() is None):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        remove_prefix(self.prefix)
        left = leftovers(self.prefix)
        if left:
            raise NatLabError(f"natlab {self.prefix} left behind: {', '.join(left)}")
        _owner_file(self.prefix).unlink(missing_ok=True)

    async def aclose(self) -> None:
        """close(), after killing and reaping the asyncio processes in this event loop."""
        if self._closed:
            return
        for process in self._async_processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), 5)
        await asyncio.to_thread(self.close)

    def __enter__(self) -> NatLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> NatLab:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<NatLab {self.prefix} {self.public_network}>"


def _check_no_overlap() -> None:
    """The lab's ranges must not be the root namespace's (they never meet, but logs would lie)."""
    ours = (PUBLIC_SUPERNET, LAN_SUPERNET)
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "default")
        if dst == "default":
            continue
        with contextlib.suppress(ValueError):
            network = ipaddress.ip_network(dst, strict=False)
            if any(network.overlaps(own) for own in ours):
                raise NatLabError(f"the root namespace routes {dst}, inside the lab's {ours}")


def _router_ruleset(router: Router) -> str:
    """The router's nftables ruleset (one table, loaded atomically)."""
    wan, lan = router.wan_address, router.lan_network
    cone = router.kind is NatKind.FULL_CONE
    masquerade = "masquerade fully-random" if router.kind is NatKind.SYMMETRIC else "masquerade"
    out = ["table ip natlab {"]
    if cone:
        for proto in ("udp", "tcp"):
            out.append(f"  map cone_{proto} {{ type inet_service : ipv4_addr . inet_service; "
                       "flags dynamic,timeout; timeout 10m; }")
        out += [
            "  chain dstnat { type nat hook prerouting priority dstnat; policy accept;",
            f'    iifname "wan" ip daddr {wan} dnat ip to udp dport map @cone_udp',
            f'    iifname "wan" ip daddr {wan} dnat ip to tcp dport map @cone_tcp',
            "  }",
            # after srcnat (priority 100) the packet carries its mapped port: remember the mapping
            "  chain learn { type filter hook postrouting priority srcnat + 10; policy accept;",
            '    oifname "wan" ct direction original ct status snat meta l4proto udp '
            "update @cone_udp { udp sport : ct original ip saddr . ct original proto-src }",
            '    oifname "wan" ct direction original ct status snat meta l4proto tcp '
            "update @cone_tcp { tcp sport : ct original ip saddr . ct original proto-src }",
            "  }",
        ]
    if router.has_stage:
        out += [  # the LAN side of the delay stage is untracked: conntrack sees WAN-side packets
            "  chain raw { type filter hook prerouting priority raw; policy accept;",
            '    iifname "lan" notrack',
            f'    iifname "dly" ip daddr {lan} notrack',
            "  }",
        ]
    out += [
        "  chain srcnat { type nat hook postrouting priority srcnat; policy accept;",
        f'    oifname "wan" {masquerade}',
        "  }",
        "  chain forward { type filter hook forward priority filter; policy drop;",
        '    iifname { "lan", "dly" } accept',
        '    iifname "wan" ct state established,related accept',
        *(['    iifname "wan" ct status dnat accept'] if cone else []),
        "  }",
        # like a home router: unsolicited packets to the WAN address get no answer at all
        "  chain input { type filter hook input priority filter; policy accept;",
        '    iifname "wan" ct state established,related accept',
        '    iifname "wan" drop',
        "  }",
        "}",
    ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The probe tool (runs inside the lab's namespaces)


async def _serve_echo(host: str, port: int) -> None:
    """UDP: answer each datagram with b"<ip>:<port> " + the datagram. TCP: send "<ip>:<port>\\n";
    then, when the client's first line is "get N", send N bytes and close; otherwise count what
    comes until EOF and send "<bytes> <seconds from first to last byte>\\n"."""
    loop = asyncio.get_running_loop()

    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            self.transport.sendto(f"{addr[0]}:{addr[1]} ".encode() + data, addr)

    async def on_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ip, peer_port = writer.get_extra_info("peername")[:2]
        writer.write(f"{ip}:{peer_port}\n".encode())
        total, first, last = 0, 0.0, 0.0
        head = await reader.read(4)
        if head == b"get ":
            size = int(await reader.readline())
            block = b"\0" * (1 << 16)
            while size > 0:
                writer.write(block[:size])
                size -= len(block)
                await writer.drain()
            writer.close()
            return
        if head:
            total, first = len(head), time.monotonic()
        while chunk := await reader.read(1 << 18):
            last = time.monotonic()
            if not total:
                first = last
            total += len(chunk)
        writer.write(f"{total} {last - first:.6f}\n".encode())
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    await loop.create_datagram_endpoint(Echo, local_addr=(host, port))
    server = await asyncio.start_server(on_tcp, host, port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _agent(port: int) -> None:
    """A UDP socket driven by stdin lines; prints one result line per command:
    whoami IP PORT       -> "mapped IP:PORT" (asks an echo server) | "timeout"
    punch IP PORT SECS   -> "punched" | "timeout": send b"punch" every 50 ms to IP:PORT, answer
                            its punches with b"ack", until both a punch and an ack came from it
    recv SECS            -> "got IP:PORT PAYLOAD" | "timeout"
    send IP PORT TEXT    -> "sent"
    rtt IP PORT COUNT    -> JSON {"sent", "received", "min_ms", "median_ms", "max_ms"} (echo server)
    burst IP PORT COUNT  -> JSON {"sent", "received"}: COUNT datagrams 2 ms apart, replies in 0.5 s
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    print(f"bound {sock.getsockname()[1]}", flush=True)

    def receive(deadline: float) -> tuple[bytes, tuple[str, int]] | None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
            return None
        try:
            return sock.recvfrom(65536)
        except OSError:  # an ICMP error for an earlier datagram
            return b"", ("", 0)

    def whoami(target: tuple[str, int]) -> str:
        for attempt in range(3):
            sock.sendto(f"whoami {attempt}".encode(), target)
            deadline = time.monotonic() + 1.0
            while got := receive(deadline):
                if got[1] == target and got[0].split()[1:2] == [b"whoami"]:
                    return f"mapped {got[0].split()[0].decode()}"
        return "timeout"

    def punch(target: tuple[str, int], seconds: float) -> str:
        deadline = time.monotonic() + seconds
        got_punch = got_ack = False
        next_send = time.monotonic()
        while not (got_punch and got_ack) and time.monotonic() < deadline:
            if time.monotonic() >= next_send:
                sock.sendto(b"punch", target)
                next_send += 0.05
            got = receive(min(next_send, deadline))
            if got and got[1] == target:
                if got[0] == b"punch":
                    got_punch = True
                    sock.sendto(b"ack", target)
                elif got[0] == b"ack":
                    got_ack = True
        return "punched" if got_punch and got_ack else "timeout"

    def rtt(target: tuple[str, int], count: int) -> str:
        samples = []
        for seq in range(count):
            sent = time.monotonic()
            sock.sendto(f"ping {seq}".encode(), target)
            deadline = sent + 1.0
            while got := receive(deadline):
                if got[1] == target and got[0].split()[1:] == [b"ping", str(seq).encode()]:
                    samples.append((time.monotonic() - sent) * 1000)
                    break
        stats = {"sent": count, "received": len(samples)}
        if samples:
            stats |= {"min_ms": min(samples), "median_ms": statistics.median(samples),
                      "max_ms": max(samples)}
        return json.dumps(stats)

    def burst(target: tuple[str, int], count: int) -> str:
        seen = set()
        for seq in range(count):
            sock.sendto(f"burst {seq}".encode(), target)
            while got := receive(time.monotonic() + 0.002):
                if got[1] == target:
                    seen.add(got[0].split()[-1])
        deadline = time.monotonic() + 0.5
        while got := receive(deadline):
            if got[1] == target:
                seen.add(got[0].split()[-1])
        return json.dumps({"sent": count, "received": len(seen)})

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        command, args = words[0], words[1:]
        if command == "whoami":
            result = whoami((args[0], int(args[1])))
        elif command == "punch":
            result = punch((args[0], int(args[1])), float(args[2]))
        elif command == "recv":
            got = receive(time.monotonic() + float(args[0]))
            result = f"got {got[1][0]}:{got[1][1]} {got[0].decode(errors='replace')}" if got else "timeout"
        elif command == "send":
            sock.sendto(" ".join(args[2:]).encode(), (args[0], int(args[1])))
            result = "sent"
        elif command == "rtt":
            result = rtt((args[0], int(args[1])), int(args[2]))
        elif command == "burst":
            result = burst((args[0], int(args[1])), int(args[2]))
        elif command == "quit":
            return
        else:
            result = f"error unknown command {command}"
        print(result, flush=True)


def _tcp_send(host: str, port: int, size: int) -> str:
    with socket.create_connection((host, port), timeout=30) as sock:
        stream = sock.makefile("rb")
        seen = stream.readline().decode().strip()
        block = b"\0" * (1 << 16)
        left = size
        while left > 0:
            left -= sock.send(block[:left])
        sock.shutdown(socket.SHUT_WR)
        received, seconds = stream.readline().split()
    return json.dumps({"seen": seen, "bytes": int(received), "seconds": float(seconds)})


def _tcp_fetch(host: str, port: int, size: int) -> str:
    with socket.create_connection((host, port), timeout=30) as sock:
        stream = sock.makefile("rb")
        seen = stream.readline().decode().strip()
        sock.sendall(f"get {size}\n".encode())
        total, first, last = 0, 0.0, 0.0
        while chunk := stream.read1(1 << 18):
            last = time.monotonic()
            if not total:
                first = last
            total += len(chunk)
    return json.dumps({"seen": seen, "bytes": total, "seconds": last - first})


def _tcp_probe(host: str, port: int, timeout: float) -> str:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    return "connected"


def _udp_probe(host: str, port: int, timeout: float) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        sock.settimeout(timeout)
        sock.send(b"probe")
        try:
            sock.recv(65536)
        except ConnectionRefusedError:  # ICMP port unreachable
            return "refused"
        except TimeoutError:
            return "timeout"
    return "reply"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="natlab probe tool (see natlab.py's docstring)")
    sub = parser.add_subparsers(dest="command", required=True)
    echo = sub.add_parser("echo")
    echo.add_argument("--host", default="0.0.0.0")
    echo.add_argument("--port", type=int, default=3478)
    agent = sub.add_parser("agent")
    agent.add_argument("--port", type=int, default=0)
    for name, last in (("tcp-send", "size"), ("tcp-fetch", "size"), ("tcp-probe", "timeout"),
                       ("udp-probe", "timeout")):
        command = sub.add_parser(name)
        command.add_argument("host")
        command.add_argument("port", type=int)
        command.add_argument(last, type=float)
    args = parser.parse_args(argv)
    if args.command == "echo":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_echo(args.host, args.port))
    elif args.command == "agent":
        _agent(args.port)
    elif args.command == "tcp-send":
        print(_tcp_send(args.host, args.port, int(args.size)), flush=True)
    elif args.command == "tcp-fetch":
        print(_tcp_fetch(args.host, args.port, int(args.size)), flush=True)
    elif args.command == "tcp-probe":
        print(_tcp_probe(args.host, args.port, args.timeout), flush=True)
    else:
        print(_udp_probe(args.host, args.port, args.timeout), flush=True)


if __name__ == "__main__":
    main()
