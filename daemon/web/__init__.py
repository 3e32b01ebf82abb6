"""The daemon's web dashboard and Prometheus metrics, on one loopback listener (dashboard.listen).

Off by default. See docs/dashboard.md.
"""

from .dashboard import SNAPSHOT_METHODS, Dashboard
from .metrics import render_metrics
from .server import HttpServer, Response, loopback_listen_address

__all__ = ["SNAPSHOT_METHODS", "Dashboard", "HttpServer", "Response", "loopback_listen_address",
           "render_metrics"]
