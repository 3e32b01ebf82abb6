"""The DHT's settings: the `[dht]` section of the daemon's configuration; `node_config()` says what
they mean for a DHTNode (whose DHTConfig holds more than a user sets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..settings import documented
from .node import DHTConfig
from .records import RecordLimits


@dataclass(frozen=True)
class DhtSettings:
    client_mode: Literal["auto", "yes", "no"] = documented(
        "Serve the DHT (no), only query it (yes), or decide from whether other peers can dial us "
        "(auto).", default="auto")
    k: int = documented("Bucket size: how many peers per distance range the routing table keeps.",
                        default=20)
    replicas: int = documented("How many of the closest peers hold each record (and a read asks).",
                               default=8)
    alpha: int = documented("Parallel requests per lookup step.", default=3)
    lookup_timeout: float = documented("Deadline of one lookup, in seconds.", default=10.0)
    max_value_bytes: int = documented("Largest value accepted for storage.", default=64 << 10)
    max_records: int = documented("Most entries this node stores for others.", default=100_000)
    refresh_interval: float = documented("Seconds between refreshes of an idle bucket.", default=600.0)
    republish_interval: float = documented("Seconds between republishing records to the closest peers.",
                                           default=300.0)
    def node_config(self) -> DHTConfig:
        """The DHTNode's config; client_mode "auto" starts as a server until reachability says."""
        return DHTConfig(
            k=self.k, replicas=self.replicas, alpha=self.alpha, lookup_timeout=self.lookup_timeout,
            refresh_interval=self.refresh_interval, republish_interval=self.republish_interval,
            client_mode=self.client_mode == "yes",
            limits=RecordLimits(max_value_bytes=self.max_value_bytes, max_entries=self.max_records))
