"""A run's link to its peers: progress through the DHT, gradients through the averager.

Every trainer of a run publishes its `PeerProgress` as its own sub-key of the run's progress key
and reads the others', so each peer estimates the run's accumulated samples. Once the run reaches
its target, every trainer averages its accumulated gradients under the epoch's key, weighted by
its samples, and steps. The run's key carries the run spec's fingerprint, so peers whose workload,
config or target differ never meet.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ..net import TransportError
from .progress import GlobalProgress, PeerProgress, estimate_global, reports_from_sub_keys

if TYPE_CHECKING:
    from ..network import PeerNetwork
    from .run import RunSpec

log = structlog.get_logger(__name__)

STALE_AFTER = 30.0  # seconds a progress report stays believable
ROUND_TIMEOUT = 60.0
ROUND_WINDOW = 2.0


class Collaboration:
    def __init__(self, network: PeerNetwork, spec: RunSpec) -> None:
        self.network = network
        self.spec = spec
        self.peer_id = network.identity.peer_id
        self.key = f"collab/{spec.name}/{spec.fingerprint()}"
        self.rejected_reports = 0
        self.last_reports: list[PeerProgress] = []

    def own_progress(self, epoch: int, accumulated: int, samples_per_second: float | None,
                     total: int) -> PeerProgress:
        now = time.time()
        return PeerProgress(self.peer_id, epoch, accumulated, float(samples_per_second or 0.0), now,
                            now + STALE_AFTER, "trainer", total)

    async def publish(self, progress: PeerProgress) -> None:
        dht = self.network.dht
        if dht is None:
            return
        try:
            await dht.store(self.key + "/progress", progress.to_bytes(), progress.expiration,
                            sub_key=self.peer_id, timeout=5.0)
        except (TransportError, TimeoutError) as exc:
            log.debug("progress_publish_failed", run=self.spec.name, error=str(exc))

    async def global_progress(self, own: PeerProgress) -> GlobalProgress:
        reports: list[PeerProgress] = []
        dht = self.network.dht
        if dht is not None:
            try:
                record = await dht.get(self.key + "/progress", timeout=5.0)
            except (TransportError, TimeoutError) as exc:
                log.debug("progress_read_failed", run=self.spec.name, error=str(exc))
                record = None
            if record is not None and record.has_sub_keys:
                reports, rejected = reports_from_sub_keys(
                    {sub: entry.value for sub, entry in record.sub_keys.items()})
                self.rejected_reports += len(rejected)
        self.last_reports = reports
        return estimate_global(reports, target_batch_size=self.spec.target_batch_size,
                               now=time.time(), own=own, stale_after=STALE_AFTER)

    async def average_gradients(self, vector: np.ndarray, epoch: int, weight: float,
                                expected: int) -> dict[str, Any] | None:
        """Average `vector` in place with this epoch's round; None if averaging is not possible."""
        from ..averaging.averager import RoundOptions

        averager = self.network.averager
        if averager is None:
            return None
        options = RoundOptions(key=f"{self.key}/grad/{epoch}", weight=weight, role="trainer",
                               deadline=time.time() + ROUND_TIMEOUT, expected=expected,
                               window=ROUND_WINDOW)
        return await averager.average(vector, options)
