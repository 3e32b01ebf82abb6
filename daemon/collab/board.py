"""The run's progress board in the DHT: every peer's report under one key, one sub-key each.

A peer publishes its `PeerProgress` as its own sub-key of `<run key>/progress` (only it can write
that) and reads everyone's; a trainer also keeps the run's manifest published (manifest.py). The
first time a report is read is noted on this peer's clock, so that the estimate measures a
report's age without trusting the reporter's clock (estimate.py).

Reads are incremental: every peer of a swarm of hundreds reads this one key several times an
epoch, so a peer asks only for the entries that expire after what it already holds could (the
reports published since it last asked the same nodes, with `SKEW_MARGIN` seconds to spare for
clocks that are off), from `READ_REPLICAS` of the key's nodes, and merges them into what it
holds. Each read asks the next `READ_REPLICAS` of the key's nodes in turn, from a place in their
ring of its own (by its peer id): the readers spread over all the nodes that hold the key (when
all asked the closest three, at 128 peers those three served every read, and the stores to them
timed out), and a report that did not reach some of the nodes is read from the others. A read
asks for everything the nodes hold (a full read) unless each of the last `READ_TURNS` reads
succeeded, which asked every node that this one asks; every `FULL_READ_EVERY` seconds
`READ_TURNS` full reads in a row go round all the nodes again. The nodes are the DHT's route
to the key (kept 30 s): when it has expired, a read looks up the nodes only, not the board
(`DHTNode.get(by_route=True)`: every node near the key would send all of it). In a closed run
every publish first checks this peer's own membership (the owner's revocation list, refreshed
every `REVOCATIONS_REFRESH` seconds): a revoked or expired token raises MembershipError, which
ends the run. When the list names a newer generation of the run's secret than this peer holds, it learns
it then from the owner's re-keying records (rekeying.py).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from .. import timebase
from ..net import TransportError
from .errors import MembershipError
from .manifest import REFRESH_EVERY, RunManifest, owner_signing_bytes, publish_manifest, run_key
from .membership import revocations_key
from .progress import PeerProgress, Role, reports_from_sub_keys
from .rekeying import KeyCatchUp
from .revocations import REVOCATIONS_REFRESH, Revocations

if TYPE_CHECKING:
    from ..dht import DHTNode
    from ..identity import Identity
    from .membership import MembershipRegistry

log = structlog.get_logger(__name__)

__all__ = ["DhtProgressBoard", "LocalBoard"]

DHT_TIMEOUT = 5.0
READ_REPLICAS = 3  # of the DHT's 8 per read: each publish reaches all 8, so any 3 hold the news
# reads until the same nodes are asked again, at most (8 nodes, 3 a read): an incremental read
# asks for what was published since the read this many reads ago
READ_TURNS = 3
FULL_READ_EVERY = 60.0
SKEW_MARGIN = 10.0
KEEP_SECONDS = FULL_READ_EVERY + 30.0  # the longest a report is held after it was first read


class DhtProgressBoard:
    """The `ProgressBoard` of a collaborative run (see the module docstring)."""

    def __init__(self, dht: DHTNode, identity: Identity, membership: MembershipRegistry, name: str,
                 manifest: RunManifest, role: Role, parameters: int,
                 owner_signature: str | None = None, report_ttl: float = 30.0) -> None:
        self.dht = dht
        self.report_ttl = report_ttl
        self.identity = identity
        self.membership = membership
        self.name = name
        self.manifest = manifest
        self.role = role
        self.parameters = parameters
        self.peer_id = identity.peer_id
        self.key = run_key(name, manifest)
        self.rejected_reports = 0
        self._owner_signature = owner_signature
        self._manifest_published = float("-inf")
        self._revocations_checked = float("-inf")
        self._first_read: dict[str, tuple[float, float]] = {}  # peer -> (its report's time, read at)
        self._held: dict[str, PeerProgress] = {}  # the newest report of each peer read so far
        # our wall clock at each of the last READ_TURNS reads, None for one that failed
        self._reads: deque[float | None] = deque(maxlen=READ_TURNS)
        self._turn = int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:4], "big")
        self._last_full = float("-inf")  # monotonic
        self.rekeying = None if manifest.owner is None else KeyCatchUp(
            dht, membership, manifest.owner, name)

    @property
    def owner_signature(self) -> str | None:
        """The owner's signature of the manifest (hex): ours to make if we own the run."""
        owner = self.manifest.owner
        if owner is not None and owner == self.peer_id:
            message = owner_signing_bytes(self.name, self.manifest.fingerprint())
            return self.identity.sign(message).hex()
        return self._owner_signature

    async def publish(self, report: PeerProgress) -> bool:
        dht = self.dht
        await self.check_membership()
        # stored where every read of READ_REPLICAS of the key's nodes finds it (a report that
        # reached fewer goes out again at the next look: engine.py, REPUBLISH_UNCHANGED)
        enough = max(1, dht.config.replicas - READ_REPLICAS + 1)
        try:
            stored = await dht.store(self.key + "/progress", report.to_bytes(),
                                     report.expiration, sub_key=self.peer_id,
                                     timeout=DHT_TIMEOUT) >= enough
        except (TransportError, TimeoutError) as exc:
            log.debug("progress_publish_failed", run=self.name, error=str(exc))
            stored = False
        now = timebase.monotonic()
        if self.role == "trainer" and now - self._manifest_published > REFRESH_EVERY:
            self._manifest_published = now
            await publish_manifest(dht, self.name, self.manifest, self.parameters, self.peer_id,
                                   self.owner_signature)
        return stored

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        now, mono = timebase.now(), timebase.monotonic()
        if mono - self._last_full >= FULL_READ_EVERY:
            self._last_full = mono
            self._reads.clear()  # (the next READ_TURNS reads are full: round all the nodes)
        # incremental when the nodes asked now were all asked by the last READ_TURNS reads, the
        # oldest of which was the last time some of them were: what expires after what that read
        # could have seen is what was published since
        oldest = self._reads[0] if len(self._reads) == READ_TURNS else None
        since = None if oldest is None or None in self._reads \
            else oldest + self.report_ttl - SKEW_MARGIN
        self._turn += READ_REPLICAS
        try:
            record = await self.dht.get(self.key + "/progress", timeout=DHT_TIMEOUT,
                                        replicas=READ_REPLICAS, min_expiration=since,
                                        start=self._turn, by_route=True)
        except (TransportError, TimeoutError) as exc:
            log.debug("progress_read_failed", run=self.name, error=str(exc))
            record = None
            self._reads.append(None)  # (those nodes' news are asked for in full later)
        else:  # (a read some of whose nodes did not answer counts as failed for them)
            self._reads.append(now if record is None or record.complete else None)
        if record is not None and record.has_sub_keys:
            own = record.own_sub_keys  # one report per identity: not-a-peer-id sub-keys are junk
            reports, rejected = reports_from_sub_keys({sub: entry.value for sub, entry in own.items()})
            self.rejected_reports += len(rejected) + len(record.sub_keys) - len(own)
            for report in reports:
                held = self._held.get(report.peer_id)
                if held is None or (report.time, report.expiration) > (held.time, held.expiration):
                    self._held[report.peer_id] = report
        seen: dict[str, tuple[float, float]] = {}
        for report in self._held.values():
            first = self._first_read.get(report.peer_id)
            seen[report.peer_id] = first if first is not None and first[0] == report.time \
                else (report.time, now)
        # a report is kept while it lives, and not past KEEP_SECONDS after it was first read on
        # our clock, whatever it says of itself (one dated in the future would stay for ever;
        # an honest peer publishes a new one every few seconds)
        self._held = {peer: r for peer, r in self._held.items()
                      if r.expiration > now and now - seen[peer][1] < KEEP_SECONDS}
        self._first_read = {peer: seen[peer] for peer in self._held}  # bounded as _held is
        return list(self._held.values()), {peer: read_at for peer, (_, read_at) in seen.items()}

    async def leave(self, report: PeerProgress) -> None:
        """A farewell report (`left`), expiring no sooner than the report it replaces (the DHT
        keeps the later-expiring record of a sub-key)."""
        dht = self.dht
        now = timebase.now()
        gone = PeerProgress(report.peer_id, report.epoch, 0, 0.0, now,
                            max(report.expiration, now) + 1.0, report.role, report.total_samples,
                            left=True, lineage=report.lineage)
        try:
            await dht.store(self.key + "/progress", gone.to_bytes(), gone.expiration,
                            sub_key=self.peer_id, timeout=2.0)
        except (TransportError, TimeoutError) as exc:
            log.debug("progress_leave_failed", run=self.name, error=str(exc))

    async def check_membership(self) -> None:
        """In a closed run: refresh the owner's revocation list (every REVOCATIONS_REFRESH s) and
        raise MembershipError once our own token is revoked or expired (the run then stops);
        then learn the run secret's newer generation if the list names one."""
        manifest, dht = self.manifest, self.dht
        if not manifest.closed or manifest.owner is None or manifest.owner == self.peer_id:
            return
        now = timebase.monotonic()
        refresh = now - self._revocations_checked >= REVOCATIONS_REFRESH
        if refresh:
            self._revocations_checked = now
            try:
                record = await dht.get(revocations_key(manifest.owner, self.name), timeout=DHT_TIMEOUT)
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
                    if self.membership.learn(revocations):
                        log.info("revocations_updated", run=self.name, version=revocations.version,
                                 serials=len(revocations.serials), peers=len(revocations.peers))
        token = self.membership.held(manifest.owner, self.name)
        if token is None:
            raise MembershipError(f"this peer holds no token of closed run {self.name!r}")
        self.membership.check_own(token)
        if refresh and self.rekeying is not None:
            await self.rekeying.step()


class LocalBoard:
    """The board of a run nobody else takes part in: nothing to publish, nothing to read."""

    rejected_reports = 0

    async def publish(self, report: PeerProgress) -> bool:
        return True

    async def read(self) -> tuple[list[PeerProgress], Mapping[str, float]]:
        return [], {}

    async def leave(self, report: PeerProgress) -> None:
        return None
