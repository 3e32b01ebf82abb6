"""A run's link to its peers: progress and the manifest through the DHT, vectors through the averager.

Every peer of a run (trainer or aux) publishes its `PeerProgress` as its own sub-key of the run's
progress key and reads the others', so each peer estimates the run's accumulated samples. Once
the run reaches its target, its peers average under the epoch's key: trainers their gradients
weighted by samples, aux peers as reducers with nothing of their own. The run's key carries the
manifest's fingerprint, so peers whose workload, config or schedule differ never meet.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ..averaging.errors import AveragingError
from ..net import TransportError
from .manifest import REFRESH_EVERY, RunManifest, owner_signing_bytes, publish_manifest
from .membership import (
    REVOCATIONS_REFRESH,
    MembershipError,
    Revocations,
    namespace,
    revocations_key,
)
from .progress import GlobalProgress, PeerProgress, Role, estimate_global, reports_from_sub_keys

if TYPE_CHECKING:
    from ..network import PeerNetwork

log = structlog.get_logger(__name__)

STALE_AFTER = 30.0  # seconds a progress report stays believable
ROUND_TIMEOUT = 60.0


def run_key(name: str, manifest: RunManifest) -> str:
    """The prefix of a run's DHT keys: its namespace (closed runs under their owner) and manifest."""
    return f"{namespace(name, manifest.owner if manifest.closed else None)}/{manifest.fingerprint()}"


class Collaboration:
    def __init__(self, network: PeerNetwork, name: str, manifest: RunManifest, role: Role,
                 parameters: int, owner_signature: str | None = None) -> None:
        self.network = network
        self.name = name
        self.manifest = manifest
        self.role = role
        self.parameters = parameters
        self.peer_id = network.identity.peer_id
        self.key = run_key(name, manifest)
        self.rejected_reports = 0
        self.started_at = time.time()  # published in every report: peers show our time online
        self.last_reports: list[PeerProgress] = []
        self._manifest_published = 0.0
        self._owner_signature = owner_signature
        self._revocations_checked = 0.0

    @property
    def owner_signature(self) -> str | None:
        """The owner's signature of the manifest (hex): ours to make if we own the run."""
        owner = self.manifest.owner
        if owner is not None and owner == self.peer_id:
            message = owner_signing_bytes(self.name, self.manifest.fingerprint())
            return self.network.identity.sign(message).hex()
        return self._owner_signature

    async def check_membership(self) -> None:
        """In a closed run: refresh the owner's revocation list (every REVOCATIONS_REFRESH s) and
        raise MembershipError once our own token is revoked or expired (the run then stops)."""
        manifest, dht = self.manifest, self.network.dht
        if not manifest.closed or manifest.owner is None or manifest.owner == self.peer_id:
            return
        now = time.time()
        if dht is not None and now - self._revocations_checked >= REVOCATIONS_REFRESH:
            self._revocations_checked = now
            try:
                record = await dht.get(revocations_key(manifest.owner, self.name), timeout=5.0)
            except (TransportError, TimeoutError) as exc:
                log.debug("revocations_read_failed", run=self.name, error=str(exc))
                record = None
            entry = None if record is None else record.sub_keys.get(manifest.owner)
            if entry is not None and entry.signer == manifest.owner:
                try:
                    revocations = Revocations.from_bytes(entry.value, manifest.owner, self.name)
                except MembershipError as exc:
                    log.warning("revocations_malformed", run=self.name, error=str(exc))
                else:
                    if self.network.membership.learn(revocations):
                        log.info("revocations_updated", run=self.name, version=revocations.version,
                                 serials=len(revocations.serials), peers=len(revocations.peers))
        token = self.network.membership.held(manifest.owner, self.name)
        if token is None:
            raise MembershipError(f"this peer holds no token of closed run {self.name!r}")
        self.network.membership.check_own(token)

    def own_progress(self, epoch: int, accumulated: int, samples_per_second: float | None,
                     total: int, step_overhead: float | None = None) -> PeerProgress:
        now = time.time()
        return PeerProgress(self.peer_id, epoch, accumulated, float(samples_per_second or 0.0), now,
                            now + STALE_AFTER, self.role, total, step_overhead,
                            started_at=self.started_at)

    async def prepare(self) -> None:
        """Get averaging ready before the run's first round (if the node has joined already)."""
        averager = self.network.averager
        if averager is not None:
            await averager.prepare()

    async def publish(self, progress: PeerProgress) -> None:
        dht = self.network.dht
        if dht is None:
            return
        await self.check_membership()
        try:
            await dht.store(self.key + "/progress", progress.to_bytes(), progress.expiration,
                            sub_key=self.peer_id, timeout=5.0)
        except (TransportError, TimeoutError) as exc:
            log.debug("progress_publish_failed", run=self.name, error=str(exc))
        if self.role == "trainer" and time.time() - self._manifest_published > REFRESH_EVERY:
            self._manifest_published = time.time()
            await publish_manifest(dht, self.name, self.manifest, self.parameters, self.peer_id,
                                   self.owner_signature)

    async def leave(self, progress: PeerProgress) -> None:
        """Tell the run this peer is gone (a farewell report), so that its rounds stop expecting
        it now rather than when its last report goes stale. The farewell expires no sooner than
        the report it replaces (the DHT keeps the later-expiring record of a sub-key)."""
        dht = self.network.dht
        if dht is None:
            return
        now = time.time()
        gone = PeerProgress(progress.peer_id, progress.epoch, 0, 0.0, now, now + STALE_AFTER + 1.0,
                            progress.role, progress.total_samples, left=True)
        try:
            await dht.store(self.key + "/progress", gone.to_bytes(), gone.expiration,
                            sub_key=self.peer_id, timeout=2.0)
        except (TransportError, TimeoutError) as exc:
            log.debug("progress_leave_failed", run=self.name, error=str(exc))

    async def global_progress(self, own: PeerProgress) -> GlobalProgress:
        reports: list[PeerProgress] = []
        dht = self.network.dht
        if dht is not None:
            try:
                record = await dht.get(self.key + "/progress", timeout=5.0)
            except (TransportError, TimeoutError) as exc:
                log.debug("progress_read_failed", run=self.name, error=str(exc))
                record = None
            if record is not None and record.has_sub_keys:
                reports, rejected = reports_from_sub_keys(
                    {sub: entry.value for sub, entry in record.sub_keys.items()})
                self.rejected_reports += len(rejected)
        self.last_reports = reports
        return estimate_global(reports, target_batch_size=self.manifest.target_batch_size,
                               now=time.time(), own=own, stale_after=STALE_AFTER)

    async def average(self, vector: np.ndarray, round_key: str, weight: float, expected: int,
                      compression: str = "none") -> dict[str, Any] | None:
        """Average `vector` in place in the round `round_key` of this run; the round's report, or
        None when there is no averager (not joined yet) or the round could not run at all."""
        from ..averaging.averager import RoundOptions

        averager = self.network.averager
        if averager is None:
            return None
        # No window of our own: the node's averaging.window (5 s by default) bounds the gathering,
        # which ends as soon as the expected peers are seen. A shorter one loses peers far away: on
        # a 200 ms, lossy link, announcing takes a peer about 2 s, and the join's acknowledgement
        # (half the window) runs out.
        options = RoundOptions(key=f"{self.key}/{round_key}", weight=weight, role=self.role,
                               deadline=time.time() + ROUND_TIMEOUT, expected=expected,
                               compression=compression)
        try:
            return await averager.average(vector, options)
        except AveragingError as exc:
            log.warning("averaging_round_not_run", run=self.name, round=round_key, error=str(exc))
            return None
