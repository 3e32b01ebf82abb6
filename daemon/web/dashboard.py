"""The dashboard: a read-only web page, its data, and Prometheus metrics, on one loopback listener.

    /               the page (page.html, page.css, page.js: no CDN, it fetches only from here)
    /api/snapshot   JSON: the answers of node.info, node.peers, node.bandwidth, run.status and
                    averaging.status, which the page polls every ~1.5 s
    /metrics        the same data in Prometheus's text format (metrics.py)

The snapshot is made by dispatching those JSON-RPC requests, as one batch, to the control API's
own method registry in this process: the same code, validation and errors as a client on the
control socket gets, so there is no second source of truth (the dashboard's reads are counted as
requests like any other). One snapshot serves every reader for `cache_seconds`.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import orjson

from dedloc.rpc import MethodRegistry

from .. import timebase
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import render_metrics
from .server import HttpServer, Response

#: What a snapshot holds: its key, and the control-API method whose answer it is.
SNAPSHOT_METHODS = {
    "node": "node.info",
    "peers": "node.peers",
    "bandwidth": "node.bandwidth",
    "runs": "run.status",
    "averaging": "averaging.status",
}
ASSETS = {"/": ("page.html", "text/html; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8"),
          "/page.js": ("page.js", "text/javascript; charset=utf-8")}


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


class Dashboard:
    """Serves the dashboard of the methods in `registry` on the loopback address `listen`."""

    def __init__(self, registry: MethodRegistry, listen: str, *, cache_seconds: float = 0.5) -> None:
        self.registry = registry
        self.cache_seconds = cache_seconds
        self._assets = {path: (_asset(name), kind) for path, (name, kind) in ASSETS.items()}
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_at = -1e9
        self._lock = asyncio.Lock()
        routes = {path: self._static(path) for path in self._assets}
        routes["/api/snapshot"] = self._snapshot_route
        routes["/metrics"] = self._metrics_route
        self.server = HttpServer(listen, routes)

    @property
    def url(self) -> str | None:
        return self.server.url

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.server.counters)

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.close()

    async def snapshot(self) -> dict[str, Any]:
        """The answers of SNAPSHOT_METHODS (a method that failed: its error under `errors`)."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            if self._snapshot is None or loop.time() - self._snapshot_at > self.cache_seconds:
                self._snapshot = await self._take()
                self._snapshot_at = loop.time()
            return self._snapshot

    async def _take(self) -> dict[str, Any]:
        batch = [{"jsonrpc": "2.0", "id": key, "method": method}
                 for key, method in SNAPSHOT_METHODS.items()]
        answer = await self.registry.dispatch(orjson.dumps(batch))
        answers = orjson.loads(answer) if answer is not None else []
        if not isinstance(answers, list):  # the whole batch was refused
            answers = [{"id": key, "error": answers.get("error")} for key in SNAPSHOT_METHODS]
        snapshot: dict[str, Any] = {"time": timebase.now(), "errors": {}}
        snapshot.update({key: None for key in SNAPSHOT_METHODS})
        for item in answers:
            key = item.get("id")
            if key not in SNAPSHOT_METHODS:
                continue
            if "error" in item:
                snapshot["errors"][key] = item["error"]
            else:
                snapshot[key] = item.get("result")
        return snapshot

    def _static(self, path: str) -> Any:
        body, kind = self._assets[path]

        async def serve() -> Response:
            return Response(200, body, kind)

        return serve

    async def _snapshot_route(self) -> Response:
        return Response(200, orjson.dumps(await self.snapshot()), "application/json")

    async def _metrics_route(self) -> Response:
        snapshot = await self.snapshot()
        return Response(200, render_metrics(snapshot).encode(), METRICS_CONTENT_TYPE)


__all__ = ["SNAPSHOT_METHODS", "Dashboard"]
