"""Fixtures for the worker tests: real `dedloc-worker` processes and shared-memory buffers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from dedloc.rpc import JsonRpcClient, RpcConnectionError

START_TIMEOUT = 60.0
EXIT_TIMEOUT = 20.0
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Worker:
    """A real worker subprocess (loop-independent: a Popen) and its socket and log file."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.directory = directory
        self.socket = directory / "worker.sock"
        self.log_path = directory / "worker.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dedloc.plugins.worker", "--socket", str(self.socket),
             "--threads", "1", *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            env={**os.environ, **THREAD_ENV})

    async def connect(self) -> JsonRpcClient:
        """Connect once the worker serves its socket (the worker lives until this closes)."""
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log()}")
                try:
                    return await JsonRpcClient.connect(self.socket, timeout=5.0, default_timeout=60.0)
                except RpcConnectionError:
                    await asyncio.sleep(0.05)

    async def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        return await asyncio.to_thread(self.process.wait, timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def finish(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(EXIT_TIMEOUT)
        self._log.close()


@pytest.fixture(scope="session")
def launch() -> Iterator[Callable[..., Worker]]:
    """Start workers, each in its own short directory (socket paths must stay under 108 bytes)."""
    started: list[tuple[Worker, Path]] = []

    def start(*extra: str) -> Worker:
        directory = Path(tempfile.mkdtemp(prefix="dlw-", dir="/tmp"))
        worker = Worker(directory, *extra)
        started.append((worker, directory))
        return worker

    yield start
    for worker, directory in started:
        worker.finish()
        shutil.rmtree(directory, ignore_errors=True)


class Buffers:
    """Shared-memory buffers the test owns (as the daemon would): created here, unlinked here."""

    def __init__(self) -> None:
        self._made: list[shared_memory.SharedMemory] = []

    def make(self, numel: int, fill: float | None = None) -> tuple[str, np.ndarray]:
        shm = shared_memory.SharedMemory(create=True, size=numel * 4)
        self._made.append(shm)
        array: np.ndarray = np.ndarray((numel,), dtype=np.float32, buffer=shm.buf)
        if fill is not None:
            array[:] = fill
        return shm.name, array

    def close(self) -> None:
        for shm in self._made:
            shm.unlink()
            with contextlib.suppress(BufferError):  # an array of a test may still be alive
                shm.close()
        self._made.clear()


@pytest.fixture(scope="module")
def buffers() -> Iterator[Buffers]:
    made = Buffers()
    yield made
    made.close()

