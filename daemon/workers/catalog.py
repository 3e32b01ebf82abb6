"""The installed workloads, as the worker program reports them (`--list-workloads`).

The daemon does not import plugins (they import torch); it asks the worker program, in a short
subprocess, and caches the answer for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import structlog

from .. import timebase
from ..errors import WorkerError

log = structlog.get_logger(__name__)


class WorkloadListing:
    def __init__(self, command: list[str], cache_seconds: float, timeout: float) -> None:
        self.command = command
        self.cache_seconds = cache_seconds
        self.timeout = timeout
        self._cached: dict[str, Any] | None = None
        self._cached_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, refresh: bool = False) -> dict[str, Any]:
        """`{"workloads": [...], "errors": [...]}` of the installed workload plugins."""
        async with self._lock:
            fresh = timebase.monotonic() - self._cached_at < self.cache_seconds
            if self._cached is None or refresh or not fresh:
                self._cached = await self._ask_worker()
                self._cached_at = timebase.monotonic()
            return self._cached

    def invalidate(self) -> None:
        self._cached = None

    async def _ask_worker(self) -> dict[str, Any]:
        argv = [*self.command, "--list-workloads"]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise WorkerError(f"cannot run {argv[0]!r}: {exc}; check workers.command") from exc
        try:
            async with asyncio.timeout(self.timeout):
                stdout, stderr = await process.communicate()
        except TimeoutError as exc:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise WorkerError(f"listing workloads took over {self.timeout} s") from exc
        tail = stderr.decode(errors="replace").strip().splitlines()[-20:]
        if process.returncode != 0:
            raise WorkerError(f"listing workloads failed (exit code {process.returncode})",
                              {"exit_code": process.returncode, "last_log_lines": tail})
        try:
            listing = orjson.loads(stdout)
        except orjson.JSONDecodeError as exc:
            raise WorkerError("the worker's workload list is not JSON",
                              {"last_log_lines": tail}) from exc
        if not isinstance(listing, dict) or not isinstance(listing.get("workloads"), list):
            raise WorkerError("the worker's workload list has no 'workloads' array")
        for error in listing.get("errors", []):
            log.warning("workload_plugin_error", **error)
        return listing
