"""One worker process: spawned, connected over its JSON-RPC socket, watched, stopped.

The daemon never imports torch: a worker is any program that serves the worker protocol
(docs/worker-protocol.md) on the socket it is given. Its output is kept (the last lines) for
`run.status` and forwarded to the daemon's log at debug level.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import structlog

from dedloc.rpc import JsonRpcClient, RpcCallError, RpcConnectionError, RpcError, RpcTimeoutError
from dedloc.rpc.worker_protocol import PROTOCOL_VERSION, WorkerMethod

from ..errors import WorkerError

log = structlog.get_logger(__name__)


class WorkerProcess:
    """A running worker. Create with `await WorkerProcess.spawn(...)`; always `await stop()`."""

    def __init__(self, process: asyncio.subprocess.Process, socket_path: Path, log_lines: int,
                 call_timeout: float, label: str) -> None:
        self._process = process
        self.socket_path = socket_path
        self.call_timeout = call_timeout
        self.label = label
        self.output: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._client: JsonRpcClient | None = None
        self._readers = [
            asyncio.create_task(self._read_output(stream), name=f"worker-output-{label}")
            for stream in (process.stdout, process.stderr) if stream is not None
        ]
        self._stopping = False

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exit_code(self) -> int | None:
        """The exit status (negative: killed by that signal), None while it runs."""
        return self._process.returncode

    @property
    def stopping(self) -> bool:
        return self._stopping

    def failure_data(self) -> dict[str, Any]:
        return {"pid": self.pid, "exit_code": self.exit_code, "last_log_lines": list(self.output)}

    @classmethod
    async def spawn(cls, command: list[str], socket_path: Path, *, start_timeout: float,
                    call_timeout: float, log_lines: int, threads: int = 0,
                    gpu_memory_fraction: float = 0.0, duty_cycle: float = 1.0,
                    label: str = "worker") -> WorkerProcess:
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        socket_path.unlink(missing_ok=True)
        argv = [*command, "--socket", str(socket_path), "--parent-pid", str(os.getpid())]
        if threads > 0:
            argv += ["--threads", str(threads)]
        if gpu_memory_fraction > 0:
            argv += ["--gpu-memory-fraction", repr(gpu_memory_fraction)]
        if duty_cycle < 1.0:
            argv += ["--duty-cycle", repr(duty_cycle)]
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # systemd's notify socket is the daemon's alone
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        except OSError as exc:
            raise WorkerError(f"cannot start worker {argv[0]!r}: {exc}; check workers.command",
                              {"command": argv}) from exc
        worker = cls(process, socket_path, log_lines, call_timeout, label)
        try:
            await worker._connect(start_timeout)
        except BaseException:
            await worker.stop()
            raise
        log.info("worker_started", worker=label, pid=worker.pid)
        return worker

    async def _connect(self, timeout: float) -> None:
        exited = asyncio.create_task(self._process.wait())
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if exited.done():
                        raise WorkerError(f"worker exited with code {self.exit_code} before it "
                                          "served its socket", self.failure_data())
                    try:
                        self._client = await JsonRpcClient.connect(
                            self.socket_path, timeout=5.0, default_timeout=self.call_timeout)
                        break
                    except RpcConnectionError:
                        await asyncio.wait([exited], timeout=0.05)
                hello = await self._client.call(WorkerMethod.HELLO, timeout=10.0)
        except TimeoutError as exc:
            raise WorkerError(f"worker did not answer on {self.socket_path} within {timeout} s",
                              self.failure_data()) from exc
        except RpcError as exc:
            raise WorkerError(f"worker failed its handshake: {exc}", self.failure_data()) from exc
        finally:
            exited.cancel()
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL_VERSION:
            raise WorkerError(f"worker speaks protocol {hello!r:.100}, this daemon speaks "
                              f"{PROTOCOL_VERSION}", self.failure_data())

    async def call(self, method: str, params: dict[str, Any] | None = None,
                   timeout: float | None = None) -> Any:
        """Call a worker method; a dead or silent worker raises WorkerError with its output."""
        if self._client is None:
            raise WorkerError("worker is not connected", self.failure_data())
        try:
            return await self._client.call(method, params, timeout=timeout)
        except RpcCallError:
            raise
        except RpcTimeoutError as exc:
            raise WorkerError(f"worker did not finish {method} in time: {exc}",
                              self.failure_data()) from exc
        except RpcConnectionError as exc:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._process.wait()
            raise WorkerError(f"worker died during {method} (exit code {self.exit_code})",
                              self.failure_data()) from exc

    async def wait(self) -> int:
        return await self._process.wait()

    async def stop(self, timeout: float = 20.0) -> int | None:
        """Ask the worker to stop, then SIGTERM, then SIGKILL; return its exit code."""
        self._stopping = True
        if self.exit_code is None and self._client is not None and not self._client.closed:
            with contextlib.suppress(RpcError):
                await self._client.call(WorkerMethod.STOP, timeout=min(5.0, timeout))
        for sig, grace in ((None, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None and self.exit_code is None:
                with contextlib.suppress(ProcessLookupError):
                    self._process.send_signal(sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._process.wait()
                break
        if self._client is not None:
            await self._client.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await asyncio.gather(*self._readers, return_exceptions=True)
        for reader in self._readers:
            reader.cancel()
        self.socket_path.unlink(missing_ok=True)
        log.info("worker_stopped", worker=self.label, pid=self.pid, exit_code=self.exit_code)
        return self.exit_code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()

    async def _read_output(self, stream: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the stream's limit: keep its start
                line = (await stream.read(4096)) + b" [...]\n"
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            self.output.append(text)
            log.debug("worker_output", worker=self.label, line=text)
