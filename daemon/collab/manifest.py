"""A run's manifest: what every peer of a collaborative run must agree on, and how peers find it.

The manifest names the workload and its full config, the target batch size, the optimizer-step
schedule (`epochs`), when parameters and optimizer state are averaged, the gradient compression,
how the reducers aggregate (`aggregation`: the norm-clipped mean by default, or the plain mean;
averaging/aggregation.py), the initialisation seed, and how the run syncs: `sync = "gradients"`
(DeDLOC: every global batch's gradients are averaged) or `sync = "local"` (the DiLoCo family:
`inner_steps` global batches of local optimizer steps, then the pseudo-gradients are averaged
and one outer step of Nesterov SGD with `outer_lr` and `outer_momentum` is taken, optionally
`overlap`ped with the next inner steps; an epoch is then one outer step; the inner steps take
the workload's learning rate times `inner_lr_scale`; a lossy codec's error-feedback residual
decays by `feedback_decay` before each exchange). With `compression = "topk"` the outer
settings default to SparseLoCo's recipe (SPARSE_OUTER: no outer momentum, the decaying
residual in its place), otherwise to DiLoCo's (DENSE_OUTER).
Its hash (the fingerprint) is part of the run's key in the DHT: peers
whose manifests differ in anything never meet, even under the same run name.

Every trainer of a run publishes the manifest under `collab/<name>/manifests`, its own peer id as
the sub-key (only it can write that), so that `run.start` with just a name (or an aux peer, which
has no worker to ask) can find the run and join it. Local choices (device, checkpoint interval,
this peer's data seed) are not part of the manifest.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog

from dedloc.rpc.worker_protocol import INNER_LR_SCALE_AUTO, MAX_INNER_LR_SCALE, MIN_INNER_LR_SCALE

from .. import timebase
from ..averaging.aggregation import AGGREGATIONS, DEFAULT_RUN_AGGREGATION
from ..dht.records import is_peer_id
from ..identity import verify
from ..net import TransportError
from .errors import ManifestError
from .membership import namespace
from .policy import WEIGHT_SLACK

AUTO_AGGREGATION = "auto"  # the sync mode's default (RunManifest.aggregation)

if TYPE_CHECKING:
    from ..dht import DHTNode

log = structlog.get_logger(__name__)

COMPRESSIONS = ("none", "fp16", "uint8", "quantile8")
# "topk" only where error feedback keeps what it drops (local-update runs: the trainer keeps the
# residual); in a gradients run it would drop most of every gradient for good
LOCAL_COMPRESSIONS = (*COMPRESSIONS, "topk")
SYNC_MODES = ("gradients", "local")
MAX_INNER_STEPS = 1_000_000
MANIFEST_TTL = 600.0  # seconds a published manifest stays in the DHT without a refresh
REFRESH_EVERY = 120.0
MAX_MANIFEST_BYTES = 16 << 10


# A local run's outer settings left out (None) take the defaults of its codec. DiLoCo (Douillard
# et al. 2023): Nesterov momentum 0.9 at lr 0.7, the residual of a lossy codec kept whole.
# SparseLoCo (Sarfi et al. 2025) for topk: the residual decays by 0.95 before each exchange and
# stands in for the outer momentum (none), so the step is the averaged sparse update, at lr 1.5.
# On albert-tiny at equal samples (docs/collaboration.md) topk with DiLoCo's settings was
# 5.7-7.3 % above gradient rounds' held-out loss, with these 1.0-2.3 %; lr 2 was as good at first but
# its loss rose again after about 30 outer steps, lr 1 was stable but slower.
DENSE_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "feedback_decay": 1.0}
SPARSE_OUTER = {"outer_lr": 1.5, "outer_momentum": 0.0, "feedback_decay": 0.95}
# what a gradients run's manifest holds for them
_GRADIENTS_SYNC = (0, 0.7, 0.9, True, False, 4.0, None, 1.0)


def run_key(name: str, manifest: RunManifest) -> str:
    """The prefix of a run's DHT and averaging keys: its namespace (a closed run's under its
    owner) and its manifest's fingerprint."""
    return f"{namespace(name, manifest.owner if manifest.closed else None)}/{manifest.fingerprint()}"


def manifests_key(name: str, owner: str | None = None) -> str:
    return f"{namespace(name, owner)}/manifests"


_OWNER_DOMAIN = b"dedloc-run-manifest-v1\0"


def owner_signing_bytes(name: str, fingerprint: str) -> bytes:
    """What a run's owner signs: the run's name and its manifest's fingerprint."""
    return _OWNER_DOMAIN + name.encode() + b"\0" + fingerprint.encode()


@dataclass(frozen=True)
class RunManifest:
    workload: str
    config: dict[str, Any] = field(default_factory=dict)
    target_batch_size: int = 256
    epochs: int | None = None  # the schedule's length; None: open-ended
    min_peers: int = 1  # no step is taken before this many trainers are present
    average_state_every: int = 5  # parameters and optimizer state are averaged every K epochs (0: never)
    compression: str = "none"  # of the gradients in averaging rounds
    init_seed: int = 0
    # What the config cannot pin but peers must share (the workload's task_fingerprint, e.g. a
    # tokenizer's vocabulary): the first trainer's worker fills it in; None when the workload has none.
    task: str | None = None
    # The owner's peer id (it signs the manifest); a closed run admits only peers with its tokens.
    owner: str | None = None
    closed: bool = False
    # How the run syncs (module docstring); the outer optimizer's settings are for "local" only.
    sync: str = "gradients"
    inner_steps: int = 0  # local: H, the global batches of inner steps between outer steps
    # None: the codec's default (DENSE_OUTER, or SPARSE_OUTER for topk)
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_nesterov: bool = True
    # local: train on while the pseudo-gradient is averaged (a one-step-delayed outer step)
    overlap: bool = False
    # local: the outer step's guard, kappa: a step at most kappa times the recent steps' norm
    # (plugins/worker/outer.py; 0: none)
    outer_clip: float = 4.0
    # local, with a lossy codec: the error-feedback residual (what earlier exchanges did not
    # convey) is multiplied by this before it is added to the next pseudo-gradient (1: kept whole)
    feedback_decay: float | None = None
    # local: each inner step's learning rate is the workload's times this: a number from
    # MIN_INNER_LR_SCALE to MAX_INNER_LR_SCALE (1: unchanged), or "auto" (the default of a local
    # run): the trainer's batch size over target_batch_size. Why auto: the workload's lr is tuned
    # for a step on the run's global batch (what a gradients run takes), but an inner step takes
    # one trainer's batch, b samples of the target T; the linear scaling rule (Goyal et al.
    # 2017) keeps the step per sample the same with lr x b / T. On albert-tiny (b 16, T 64) the
    # unscaled lr stalled or diverged, the scaled one beat gradient rounds (docs/collaboration.md).
    # None: the sync mode's default (a gradients run has none: its steps take the whole batch).
    inner_lr_scale: float | str | None = None
    # How every reducer of the run's rounds combines a chunk's contributions, and what members
    # check its answers against (averaging/aggregation.py): "norm_clip" (each contribution
    # clipped to 4 times the chunk's median norm, then the weighted mean) or "mean". The run's,
    # not a peer's: reducers and members must agree. A manifest without it (written before it
    # existed) is a "mean" run, as its peers averaged then, and "mean" is left out of the JSON,
    # so such a run keeps its fingerprint; "norm_clip" runs have their own. "auto" (the
    # default) is resolved when the manifest is made: norm_clip for a gradients run, mean for a
    # local-update run, whose pseudo-gradients grow with each peer's inner steps: an honest fast
    # peer's is several times a slow one's and was clipped (the run's outer step then was not
    # the weighted mean of the peers' work; the outer-step guard bounds a hostile one there).
    aggregation: str = AUTO_AGGREGATION

    def __post_init__(self) -> None:
        if not isinstance(self.workload, str) or not self.workload:
            raise ManifestError("workload must be a non-empty string")
        if not isinstance(self.config, dict):
            raise ManifestError("config must be an object")
        for name, low in (("target_batch_size", 1), ("min_peers", 1), ("average_state_every", 0),
                          ("init_seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ManifestError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.epochs is not None and (isinstance(self.epochs, bool) or not isinstance(self.epochs, int)
                                        or self.epochs < 1):
            raise ManifestError(f"epochs must be null or an integer >= 1, got {self.epochs!r}")
        if self.task is not None and (not isinstance(self.task, str) or not 0 < len(self.task) <= 128):
            raise ManifestError("task must be null or a string of 1 to 128 characters, "
                                f"got {self.task!r:.80}")
        if self.owner is not None and not is_peer_id(self.owner):
            raise ManifestError(f"owner must be a peer id, got {self.owner!r:.80}")
        if not isinstance(self.closed, bool) or (self.closed and self.owner is None):
            raise ManifestError("closed must be a boolean, and a closed run needs an owner")
        self._check_sync()
        if self.compression == "topk" and self.sync != "local":
            raise ManifestError("compression topk is for local-update runs (sync \"local\"), "
                                "whose error feedback keeps what it drops; a gradients run "
                                "would lose most of every gradient")
        if self.compression not in LOCAL_COMPRESSIONS:
            raise ManifestError(f"compression must be one of {', '.join(COMPRESSIONS)}, or "
                                f"topk in a local-update run, got {self.compression!r:.40}")
        if self.aggregation == AUTO_AGGREGATION:
            object.__setattr__(self, "aggregation",
                               "mean" if self.sync == "local" else DEFAULT_RUN_AGGREGATION)
        if not isinstance(self.aggregation, str) or self.aggregation not in AGGREGATIONS:
            raise ManifestError(f"aggregation must be one of {', '.join(AGGREGATIONS)} (how the "
                                f"reducers combine contributions: norm_clip clips each to 4 "
                                f"times the median norm, mean does not), got "
                                f"{self.aggregation!r:.40}")

    def _check_sync(self) -> None:
        if self.sync not in SYNC_MODES:
            raise ManifestError(f"sync must be one of {', '.join(SYNC_MODES)}, got {self.sync!r:.40}")
        defaults = SPARSE_OUTER if self.sync == "local" and self.compression == "topk" else DENSE_OUTER
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name, high in (("outer_lr", 10.0), ("outer_momentum", 0.999), ("outer_clip", 1000.0),
                           ("feedback_decay", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or not 0.0 <= value <= high:
                raise ManifestError(f"{name} must be a number from 0 to {high}, got {value!r:.40}")
            object.__setattr__(self, name, float(value))  # 1 and 1.0: one fingerprint
        self._check_inner_lr_scale()
        if self.sync == "local" and self.feedback_decay != 1.0 and self.compression == "none":
            raise ManifestError("feedback_decay is for a lossy codec's residual (compression "
                                "fp16, uint8, quantile8 or topk); compression none has none")
        for flag in ("outer_nesterov", "overlap"):
            if not isinstance(getattr(self, flag), bool):
                raise ManifestError(f"{flag} must be a boolean, got {getattr(self, flag)!r:.40}")
        steps = self.inner_steps
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise ManifestError(f"inner_steps must be an integer, got {steps!r:.40}")
        if self.sync == "local" and not 1 <= steps <= MAX_INNER_STEPS:
            raise ManifestError(f"a local-update run (sync \"local\") needs inner_steps from 1 to "
                                f"{MAX_INNER_STEPS}, got {steps}")
        if self.sync == "gradients" and (steps, self.outer_lr, self.outer_momentum,
                                         self.outer_nesterov, self.overlap, self.outer_clip,
                                         self.inner_lr_scale, self.feedback_decay) != _GRADIENTS_SYNC:
            raise ManifestError("inner_steps, inner_lr_scale and the outer optimizer's settings "
                                "are for local-update runs: give sync \"local\" too, or leave "
                                "them out")

    def _check_inner_lr_scale(self) -> None:
        scale = self.inner_lr_scale
        if self.sync != "local" or scale == INNER_LR_SCALE_AUTO:
            return  # (a gradients run's: refused by _check_sync unless None)
        if scale is None:
            object.__setattr__(self, "inner_lr_scale", INNER_LR_SCALE_AUTO)
            return
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) \
                or not MIN_INNER_LR_SCALE <= scale <= MAX_INNER_LR_SCALE:
            raise ManifestError(f"inner_lr_scale must be \"auto\" (the trainer's batch size / "
                                f"target_batch_size) or a number from {MIN_INNER_LR_SCALE} to "
                                f"{MAX_INNER_LR_SCALE} (1: the workload's lr unchanged), got "
                                f"{scale!r:.40}")
        object.__setattr__(self, "inner_lr_scale", float(scale))  # 1 and 1.0: one fingerprint

    @property
    def local_updates(self) -> bool:
        return self.sync == "local"

    @property
    def max_weight(self) -> int:
        """The most samples one member of a gradient (or pseudo-gradient) round may claim: an
        honest trainer stops at the epoch's samples, overshooting by at most one of its batches
        (7 target batches of slack: WEIGHT_SLACK); a claim of 1e15 is refused, not averaged."""
        return self.epoch_samples + (WEIGHT_SLACK - 1) * self.target_batch_size

    @property
    def epoch_samples(self) -> int:
        """The run's samples between two optimizer steps of the run: the target batch, or in a
        local-update run `inner_steps` target batches."""
        return self.target_batch_size * (self.inner_steps if self.local_updates else 1)

    def sync_fields(self) -> dict[str, Any]:
        """The sync fields as RunManifest takes them (none for a gradients run)."""
        if not self.local_updates:
            return {}
        return {"sync": self.sync, "inner_steps": self.inner_steps, "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "outer_nesterov": self.outer_nesterov,
                "overlap": self.overlap, "outer_clip": self.outer_clip,
                "inner_lr_scale": self.inner_lr_scale, "feedback_decay": self.feedback_decay}

    def worker_sync(self) -> dict[str, Any] | None:
        """`worker.load`'s sync settings (None: a gradients run)."""
        if not self.local_updates:
            return None
        settings: dict[str, Any] = {
            "mode": "local", "inner_steps": self.inner_steps, "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "nesterov": self.outer_nesterov,
            "overlap": self.overlap, "clip": self.outer_clip, "inner_lr_scale": self.inner_lr_scale}
        if self.feedback_decay != 1.0:  # (a worker from before the setting takes none)
            settings["feedback_decay"] = self.feedback_decay
        if self.inner_lr_scale == INNER_LR_SCALE_AUTO:  # the worker divides its batch by it
            settings["target_batch_size"] = self.target_batch_size
        return settings

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key, unset in (("task", None), ("owner", None), ("closed", False)):
            if data[key] == unset:  # so that a run without them keeps its fingerprint
                del data[key]
        if data["aggregation"] == "mean":  # (as manifests were before the field existed)
            del data["aggregation"]
        if self.sync == "gradients":  # the same: gradients runs keep their fingerprints
            for key in ("sync", "inner_steps", "outer_lr", "outer_momentum", "outer_nesterov",
                        "overlap", "outer_clip", "inner_lr_scale", "feedback_decay"):
                del data[key]
        elif data["feedback_decay"] == 1.0:  # (as local runs were before the setting existed)
            del data["feedback_decay"]
        return data

    @classmethod
    def from_json(cls, data: Any) -> RunManifest:
        if not isinstance(data, dict):
            raise ManifestError("a manifest must be an object")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ManifestError(f"unknown manifest fields: {', '.join(sorted(unknown))} (a newer "
                                "dedloc made this run; upgrade to join it)")
        if "aggregation" not in data:  # written before the field existed, or a "mean" run
            data = {**data, "aggregation": "mean"}
        if data.get("sync") == "local" and "feedback_decay" not in data:
            # written before the field existed (or with 1): every outer setting it leaves out
            # meant DiLoCo's then, topk's included (never SparseLoCo's defaults)
            data = {**DENSE_OUTER, **data}
        try:
            return cls(**data)
        except TypeError as exc:
            raise ManifestError(f"malformed manifest: {exc}") from None

    def fingerprint(self) -> str:
        """The manifest's identity: peers (and checkpoints) of another manifest never mix."""
        canonical = orjson.dumps(self.to_json(), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(canonical).hexdigest()[:16]


@dataclass(frozen=True)
class PublishedManifest:
    """A manifest as found in the DHT, with how many live peers publish it."""

    manifest: RunManifest
    fingerprint: str
    parameters: int  # float32 elements of the gradient vector: what an aux peer averages
    publishers: tuple[str, ...]
    published_at: float
    owner_signature: str | None = None  # hex; checked when the manifest names an owner

    def to_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest.to_json(), "fingerprint": self.fingerprint,
                "parameters": self.parameters, "publishers": len(self.publishers),
                "published_at": self.published_at}


async def publish_manifest(dht: DHTNode, name: str, manifest: RunManifest, parameters: int,
                           peer_id: str, owner_signature: str | None = None) -> None:
    """Announce that this peer trains `manifest` under `name` (refresh every REFRESH_EVERY s).
    A manifest with an owner travels with the owner's signature (`owner_signature`, hex)."""
    now = timebase.now()
    document: dict[str, Any] = {"manifest": manifest.to_json(), "fingerprint": manifest.fingerprint(),
                                "parameters": parameters, "published_at": now}
    if owner_signature is not None:
        document["owner_signature"] = owner_signature
    value = orjson.dumps(document)
    try:
        await dht.store(manifests_key(name, manifest.owner if manifest.closed else None), value,
                        now + MANIFEST_TTL, sub_key=peer_id, timeout=5.0)
    except (TransportError, TimeoutError) as exc:
        log.info("manifest_publish_failed", run=name, error=str(exc))


async def find_manifests(dht: DHTNode, name: str, owner: str | None = None) -> list[PublishedManifest]:
    """The manifests published under `name` (of closed runs of `owner` when given), the most
    widely published first. Malformed entries, ones whose fingerprint does not match their
    manifest and ones naming an owner without that owner's valid signature are skipped."""
    try:
        record = await dht.get(manifests_key(name, owner), timeout=5.0)
    except (TransportError, TimeoutError) as exc:
        log.info("manifest_lookup_failed", run=name, error=str(exc))
        return []
    if record is None or not record.has_sub_keys:
        return []
    found: dict[str, PublishedManifest] = {}
    for publisher, entry in record.own_sub_keys.items():  # one vote per identity, not per sub-key
        try:
            if len(entry.value) > MAX_MANIFEST_BYTES:
                raise ManifestError("too large")
            data = orjson.loads(entry.value)
            manifest = RunManifest.from_json(data.get("manifest"))
            parameters = data.get("parameters")
            published_at = float(data.get("published_at", 0.0))
            signature = data.get("owner_signature")
            fingerprint = manifest.fingerprint()
            if manifest.owner is not None and not (
                    isinstance(signature, str)
                    and verify(manifest.owner, bytes.fromhex(signature),
                               owner_signing_bytes(name, fingerprint))):
                raise ManifestError(f"not signed by its owner {manifest.owner[:16]}")
            if manifest.closed != (owner is not None) or (owner is not None and manifest.owner != owner):
                raise ManifestError("published under another run's keys")
        except (orjson.JSONDecodeError, ManifestError, AttributeError, TypeError, ValueError) as exc:
            log.info("manifest_entry_skipped", run=name, publisher=publisher[:12], error=str(exc))
            continue
        if data.get("fingerprint") != fingerprint or isinstance(parameters, bool) \
                or not isinstance(parameters, int) or parameters < 1:
            continue
        held = found.get(fingerprint)
        if held is None:
            found[fingerprint] = PublishedManifest(manifest, fingerprint, parameters, (publisher,),
                                                   published_at, signature)
        else:
            found[fingerprint] = PublishedManifest(manifest, fingerprint, held.parameters,
                                                   (*held.publishers, publisher),
                                                   max(held.published_at, published_at),
                                                   held.owner_signature)
    return sorted(found.values(), key=lambda p: (-len(p.publishers), -p.published_at))


def choose_manifest(name: str, candidates: list[PublishedManifest]) -> PublishedManifest:
    """The run to join by name: the manifest most peers publish. ManifestError if there is none,
    or if two manifests are equally popular (the caller must then give the manifest itself)."""
    if not candidates:
        raise ManifestError(f"no peer publishes a run named {name!r}; start it with a workload "
                            "(run.start workload=...) or check the name and the bootstrap peers")
    if len(candidates) > 1 and len(candidates[0].publishers) == len(candidates[1].publishers):
        described = "; ".join(f"{c.fingerprint}: {c.manifest.workload}, batch "
                              f"{c.manifest.target_batch_size}, {len(c.publishers)} peer(s)"
                              for c in candidates[:4])
        raise ManifestError(f"several runs named {name!r} differ in their manifests ({described}); "
                            "give the workload and config to say which one to join")
    return candidates[0]
