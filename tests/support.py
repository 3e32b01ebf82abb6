"""Helpers for the tests: real dedlocd processes, a stand-in for systemd's notify socket, polling."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import sys
from multiprocessing import shared_memory
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import orjson

from dedloc.rpc import JsonRpcClient

START_TIMEOUT = 60.0
LOG_LINE_LIMIT = 1 << 20  # bytes of one log line the tests read whole (asyncio: 64 KiB)


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET; collects what it is sent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[str] = []
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path.unlink(missing_ok=True)  # left by an earlier daemon in the same directory
        self._socket.bind(str(path))
        self._socket.setblocking(False)
        self._arrived = asyncio.Event()
        asyncio.get_running_loop().add_reader(self._socket.fileno(), self._receive)

    def _receive(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.messages.append(self._socket.recv(4096).decode())
                self._arrived.set()

    def assignments(self) -> list[str]:
        return [line for message in self.messages for line in message.splitlines()]

    async def wait_for(self, line: str, timeout: float = START_TIMEOUT) -> None:
        async with asyncio.timeout(timeout):
            while line not in self.assignments():
                self._arrived.clear()
                await self._arrived.wait()

    def close(self) -> None:
        if self._socket.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self._socket.fileno())
            self._socket.close()


class DaemonProcess:
    """A real `dedlocd` subprocess with its own state directory."""

    def __init__(self, root: Path, process: asyncio.subprocess.Process, notify: NotifyListener) -> None:
        self.root = root
        self.process = process
        self.notify = notify
        self.socket_path = root / "dedlocd.sock"
        self.log_lines: list[str] = []
        self._stderr_task = asyncio.create_task(self._collect_stderr())

    @classmethod
    async def start(cls, root: Path, *args: str, env: dict[str, str] | None = None,
                    prefix: tuple[str, ...] = (), listen: str = "/ip4/127.0.0.1/tcp/0") -> DaemonProcess:
        """`prefix` runs it inside something (e.g. `ip netns exec NS` for the NAT lab)."""
        notify = NotifyListener(root / "notify.sock")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), **(env or {})}
        process = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-m", "dedloc.daemon", "--node.state_dir", str(root / "state"),
            "--node.runtime_dir", str(root), "--log.format", "json", "--log.level", "debug",
            "--net.listen", listen, *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=full_env, limit=LOG_LINE_LIMIT)
        daemon = cls(root, process, notify)
        try:
            await daemon.wait_ready()
        except BaseException:
            await daemon.kill()
            raise
        return daemon

    async def _collect_stderr(self) -> None:
        """Read the daemon's log for as long as it writes: a reader that stopped would leave the
        daemon blocked on a full pipe (its whole event loop, since logging is synchronous)."""
        assert self.process.stderr is not None
        while True:
            try:
                line = await self.process.stderr.readline()
            except ValueError:  # a line past LOG_LINE_LIMIT (its start dropped): say so
                self.log_lines.append(f"[a log line over {LOG_LINE_LIMIT} bytes, dropped]")
                continue
            if not line:
                return
            self.log_lines.append(line.decode(errors="replace").rstrip())

    async def dump_stacks(self, wait: float = 1.0) -> str:
        """Every thread's stack of a daemon still running (daemon/main.py: SIGUSR1 writes them to
        `stacks.txt`), for a failed test's report: what a daemon that stopped answering does."""
        if self.process.returncode is not None:
            return f"(exited with {self.process.returncode})"
        path = self.root / "stacks.txt"
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGUSR1)
        await asyncio.sleep(wait)
        try:
            return path.read_text(errors="replace")[-8000:]
        except OSError as exc:
            return f"(no stacks: {exc})"

    def events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_lines:
            with contextlib.suppress(orjson.JSONDecodeError):
                events.append(orjson.loads(line))
        return events

    async def wait_ready(self) -> None:
        ready = asyncio.create_task(self.notify.wait_for("READY=1"))
        exited = asyncio.create_task(self.process.wait())
        done, _ = await asyncio.wait([ready, exited], timeout=START_TIMEOUT,
                                     return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        exited.cancel()
        if ready not in done:
            await asyncio.sleep(0)
            raise RuntimeError("dedlocd did not become ready:\n" + "\n".join(self.log_lines[-30:]))

    async def client(self) -> JsonRpcClient:
        return await JsonRpcClient.connect(self.socket_path, default_timeout=120.0)

    async def call(self, method: str, params: Any = None, timeout: float = 120.0) -> Any:
        async with await self.client() as client:
            return await client.call(method, params, timeout=timeout)

    async def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)
        async with asyncio.timeout(timeout):
            code = await self.process.wait()
        await self._finish()
        return code

    async def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the daemon to exit by itself (after node.shutdown); return its exit code."""
        async with asyncio.timeout(timeout):
            code = await self.process.wait()
        await self._finish()
        return code

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()
        await self._finish()

    async def _finish(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._stderr_task
        self.notify.close()



async def wait_until(predicate: Any, timeout: float = 120.0, interval: float = 0.2) -> Any:
    """Poll an async predicate until it returns something truthy; return that."""
    async with asyncio.timeout(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await asyncio.sleep(interval)


async def join_by_name(daemon: Any, name: str, timeout: float = 60.0) -> dict[str, Any]:
    """`dedloc join NAME`: run.start with the name only, asked again while no peer publishes the
    run yet (or the daemon has not joined the network); its status."""
    from dedloc.rpc import RpcCallError

    async def join() -> dict[str, Any] | None:
        try:
            return await daemon.call("run.start", {"name": name})
        except RpcCallError as exc:
            if "no peer publishes" in exc.message or "not joined the network" in exc.message:
                return None
            raise

    return await wait_until(join, timeout=timeout)


async def p2p_address(daemon: DaemonProcess) -> str:
    """The daemon's loopback peer address (tests listen on 127.0.0.1 only)."""
    info = await daemon.call("node.info")
    (address,) = [a for a in info["addresses"]["p2p"] if "/127.0.0.1/" in a]
    return address


async def start_swarm(daemon_factory: Any, count: int, *args: str) -> list[DaemonProcess]:
    """`count` daemons, all bootstrapped from the first, once every one has joined the DHT."""
    first = await daemon_factory(*args)
    address = await p2p_address(first)
    rest = await asyncio.gather(*(daemon_factory("--net.bootstrap", address, *args)
                                  for _ in range(count - 1)))
    daemons = [first, *rest]

    async def joined() -> bool:
        infos = [await d.call("node.info") for d in daemons]
        return all(info["dht"]["joined"] for info in infos)

    await wait_until(joined, timeout=60)
    return daemons


async def swarm_with_odd_one(daemon_factory: Any, args: tuple[str, ...], name: str,
                             env: dict[str, str]) -> list[DaemonProcess]:
    """Three honest daemons and a fourth (`name`) started with `env` (a test-only switch that
    makes it misbehave), all bootstrapped from the first, once each answers averaging.status."""
    from dedloc.rpc import RpcCallError

    first = await daemon_factory(*args)
    address = await p2p_address(first)
    honest = [daemon_factory(*args, "--net.bootstrap", address) for _ in range(2)]
    odd = daemon_factory(*args, "--net.bootstrap", address, name=name, env=env)
    daemons = [first, *await asyncio.gather(*honest, odd)]

    async def ready() -> bool:
        try:
            for daemon in daemons:
                await daemon.call("averaging.status")
        except RpcCallError:  # still joining
            return False
        return True

    await wait_until(ready, timeout=60)
    return daemons


async def dedloc_cli(socket: Path, *args: str) -> tuple[int, str, str]:
    """Run the `dedloc` CLI against the daemon at `socket`: (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dedloc.cli", "--socket", str(socket), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(300):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `benchmark_<name>`, without leaving benchmarks/ on
    sys.path nor the modules it imports from there (its `collab`, `dht`) in sys.modules: there
    they would shadow the tests' own `dht` and `collab` packages."""
    path = list(sys.path)
    module_name = f"benchmark_{name}"
    # A test that imported the tests' own `collab` package (a namespace package, from tests/) before
    # would make the benchmark's `from collab import ...` find it: step the tests' modules of the
    # benchmarks' names aside while the benchmark loads, and put them back after.
    stems = {sibling.stem for sibling in BENCHMARKS.glob("*.py")}
    stepped_aside = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] in stems}
    try:
        spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # (dataclasses look their module up there)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        for loaded in list(sys.modules):  # the benchmark's own imports from benchmarks/
            if loaded.split(".")[0] in stems and str(BENCHMARKS) in str(
                    getattr(sys.modules[loaded], "__file__", "") or ""):
                del sys.modules[loaded]
        sys.modules.update(stepped_aside)
    return module


async def average_in_shared_memory(daemons: list[DaemonProcess], key: str, vectors: list[Any],
                                   weights: list[float], **params: Any) -> tuple[list[Any], list[Any]]:
    """One averaging.average round of `daemons` (one vector and weight each, handed over in
    shared memory, expecting them all, a 5 s window): their reports and their results. `params`
    are added to every call; a callable one is called with the daemon's index."""


    length = int(vectors[0].size)
    shms = [shared_memory.SharedMemory(create=True, size=length * 4) for _ in vectors]
    try:
        for shm, vector in zip(shms, vectors, strict=True):
            np.ndarray(length, np.float32, shm.buf)[:] = vector
        reports = await asyncio.gather(*(daemon.call("averaging.average", {
            "key": key, "buffer": shm.name, "length": length, "weight": weight,
            "expected_peers": len(daemons), "window": 5, "timeout": 60,
            **{name: value(index) if callable(value) else value for name, value in params.items()}},
            timeout=90) for index, (daemon, shm, weight)
            in enumerate(zip(daemons, shms, weights, strict=True))))
        results = [np.ndarray(length, np.float32, shm.buf).copy() for shm in shms]
    finally:
        for shm in shms:
            shm.close()
            shm.unlink()
    return list(reports), results
