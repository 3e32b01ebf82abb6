"""The daemon process: start-up, serving, and its one shutdown path.

SIGTERM, SIGINT and the RPC `node.shutdown` all set the same event; the node then tells systemd
it is stopping, stops every run (checkpointing it and stopping its worker), closes the control
socket and returns. A failure during start-up is logged with its reason and raised.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import structlog

from dedloc.rpc import AccessError, JsonRpcServer

from . import timebase
from .api import build_registry
from .collab.autojoin import RunAutoJoin
from .collab.runs import RunRegistry
from .collab.state_sync import StateSharing
from .config import Config
from .errors import DaemonError
from .identity import Identity
from .loop_watch import LoopStallWatch
from .network import PeerNetwork
from .sdnotify import SystemdNotifier
from .web import Dashboard
from .workers.buffers import sweep_orphans
from .workers.catalog import WorkloadListing

log = structlog.get_logger(__name__)

STATUS_INTERVAL = 5.0


class Node:
    def __init__(self, config: Config, notifier: SystemdNotifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or SystemdNotifier()
        self.loop_watch = LoopStallWatch()
        self.started_at = timebase.now()
        self.socket_path: Path = config.socket_path()
        self.identity = Identity.load_or_create(config.state_dir())
        self.network = PeerNetwork(config, self.identity, on_failure=self.request_shutdown)
        self.runs = RunRegistry(self.identity.peer_id, self.network, state_dir=config.state_dir(),
                                runtime_dir=config.runtime_dir(), workers=config.workers,
                                limits=config.limits, default_role=config.node.role)
        self.autojoin = RunAutoJoin(self.runs, config.run, config.state_dir())
        self.workloads = WorkloadListing(config.worker_command(),
                                         cache_seconds=config.workers.list_cache_seconds,
                                         timeout=config.workers.start_timeout)
        self.registry = build_registry(self)
        self._server = JsonRpcServer(
            self.registry, self.socket_path, mode=config.rpc.socket_mode,
            max_request_bytes=config.rpc.max_request_bytes,
            max_connections=config.rpc.max_connections, idle_timeout=config.rpc.idle_timeout,
            tcp_listen=config.rpc.tcp_listen or None,
            token_file=config.rpc_token_path() if config.rpc.tcp_listen else None)
        self.dashboard = (Dashboard(self.registry, config.dashboard.listen)
                          if config.dashboard.listen else None)
        self._shutdown: asyncio.Event | None = None
        self._shutdown_reason: str | None = None
        self.failed: str | None = None  # why a background task or the network failed

    @property
    def control_tcp_address(self) -> str | None:
        """The loopback TCP control listener as HOST:PORT (rpc.tcp_listen); None when off."""
        return self._server.tcp_address_text

    @property
    def dashboard_url(self) -> str | None:
        """The dashboard's URL (dashboard.listen); None when off."""
        return None if self.dashboard is None else self.dashboard.url

    def counters(self) -> dict[str, int]:
        dashboard = {} if self.dashboard is None else {
            f"dashboard.{k}": v for k, v in self.dashboard.counters.items()}
        return {**self.registry.counters, **self.network.counters(), **dashboard}

    def request_shutdown(self, reason: str) -> None:
        if self._shutdown is None:
            return
        if self._shutdown.is_set():
            log.info("shutdown_already_requested", reason=reason)
            return
        self._shutdown_reason = reason
        self._shutdown.set()

    async def run(self) -> None:
        """Serve until shutdown is requested; return after a clean stop."""
        self._shutdown = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown, sig.name)
        try:
            sweep_orphans()  # segments of an earlier daemon that was killed before it cleaned up
            await self.network.start()
            assert self.network.transport is not None
            StateSharing(self.network.transport, self.runs.find_by_key, self.network.membership)
            try:
                await self._server.start()
            except AccessError as exc:
                raise DaemonError(f"control API: {exc}") from exc
            if self.dashboard is not None:
                try:
                    await self.dashboard.start()
                except (ValueError, OSError) as exc:
                    raise DaemonError(f"dashboard: {exc}") from exc
            log.info("dedlocd_ready", peer_id=self.identity.peer_id, socket=str(self.socket_path),
                     tcp=self._server.tcp_address_text, dashboard=self.dashboard_url)
            self.notifier.notify("READY=1", f"STATUS=serving on {self.socket_path}")
            async with asyncio.TaskGroup() as tasks:
                background = [
                    tasks.create_task(self._supervised(job, name), name=name) for job, name in (
                        (self.notifier.ping_watchdog(), "watchdog"), (self._report_status(), "status"),
                        (self.loop_watch.run(), "loop_watch"),
                        (self.runs.publish_revocations(), "revocations"),
                        (self.runs.watch_idleness(), "idleness"))]
                autojoin = tasks.create_task(self._supervised(self.autojoin.run(), "autojoin"),
                                             name="autojoin")  # [run]
                await self._shutdown.wait()
                log.info("dedlocd_stopping", reason=self._shutdown_reason)
                self.notifier.notify("STOPPING=1", f"STATUS=stopping ({self._shutdown_reason})")
                autojoin.cancel()  # first: the runs stopping now is no stop by the volunteer
                await self.runs.close()
                await self.network.close()
                for task in background:
                    task.cancel()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if self.dashboard is not None:
                await self.dashboard.close()
            await self._server.close()
            await self.network.close()
            self.notifier.close()
        log.info("dedlocd_stopped")

    async def _supervised(self, job: Coroutine[Any, Any, None], name: str) -> None:
        """Run a background job; if it fails, log why and stop the node through its one shutdown
        path (runs checkpointed, workers stopped): systemd restarts a daemon that exits non-zero."""
        try:
            await job
        except Exception as exc:
            log.error("background_task_failed", task=name, error=repr(exc), exc_info=exc)
            self.failed = f"{name} failed: {exc!r}"
            self.request_shutdown(self.failed)

    async def _report_status(self) -> None:
        """Keep systemd's STATUS= line current (what `systemctl status dedlocd` shows)."""
        while True:
            await asyncio.sleep(STATUS_INTERVAL)
            parts = []
            for status in self.runs.statuses():
                loss = status["loss"]
                parts.append(f"{status['name']}: {status['state']}, epoch {status['epoch']}"
                             + (f", loss {loss:.4f}" if loss is not None else ""))
            self.notifier.notify("STATUS=" + ("; ".join(parts) or f"idle, serving on {self.socket_path}"))
