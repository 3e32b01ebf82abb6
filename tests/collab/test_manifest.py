"""Pure tests of run manifests: validation, fingerprints, and finding a run's manifest in the DHT
(through a fake DHT: no network)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from dedloc.daemon.collab.errors import ManifestError
from dedloc.daemon.collab.manifest import (
    COMPRESSIONS,
    MANIFEST_TTL,
    MAX_MANIFEST_BYTES,
    PublishedManifest,
    RunManifest,
    choose_manifest,
    find_manifests,
    manifests_key,
    publish_manifest,
)
from dedloc.daemon.net import TransportError

BASE = RunManifest("tiny", {"hidden": 16, "batch_size": 8}, target_batch_size=64, epochs=10,
                   min_peers=2, average_state_every=3, compression="fp16", init_seed=7)


# --- validation ----------------------------------------------------------------------------------

def test_defaults_are_valid() -> None:
    manifest = RunManifest("tiny")
    assert manifest.config == {}
    assert manifest.epochs is None
    assert manifest.compression == "none"


@pytest.mark.parametrize(("name", "good"), [
    ("target_batch_size", 1),
    ("min_peers", 1),
    ("average_state_every", 0),
    ("init_seed", 0),
])
def test_integer_fields_bounds(name: str, good: int) -> None:
    assert getattr(dataclasses.replace(BASE, **{name: good}), name) == good
    for bad in (good - 1, -100, True, False, 1.0, 2.5, "8", None, [4]):
        with pytest.raises(ManifestError, match=name):
            dataclasses.replace(BASE, **{name: bad})


def test_bool_is_not_an_integer() -> None:
    # True == 1 and True >= 1: without the explicit check it would pass for every bound
    with pytest.raises(ManifestError, match="target_batch_size"):
        RunManifest("tiny", target_batch_size=True)  # type: ignore[arg-type]
    with pytest.raises(ManifestError, match="epochs"):
        RunManifest("tiny", epochs=True)  # type: ignore[arg-type]


def test_epochs_is_null_or_positive() -> None:
    assert RunManifest("tiny", epochs=None).epochs is None
    assert RunManifest("tiny", epochs=1).epochs == 1
    for bad in (0, -1, 1.0, "3", False, True):
        with pytest.raises(ManifestError, match="epochs"):
            RunManifest("tiny", epochs=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_known_compression_is_accepted(compression: str) -> None:
    assert RunManifest("tiny", compression=compression).compression == compression


def test_topk_is_for_local_update_runs_only() -> None:
    assert RunManifest("tiny", compression="topk", sync="local", inner_steps=10).compression == "topk"
    with pytest.raises(ManifestError, match="local-update runs"):
        RunManifest("tiny", compression="topk")


@pytest.mark.parametrize("compression", ["", "FP16", "int4", None, 16])
def test_bad_compression(compression: object) -> None:
    with pytest.raises(ManifestError, match="compression") as info:
        RunManifest("tiny", compression=compression)  # type: ignore[arg-type]
    for known in COMPRESSIONS:
        assert known in str(info.value)


@pytest.mark.parametrize("workload", ["", None, 5, b"tiny"])
def test_workload_must_be_a_non_empty_string(workload: object) -> None:
    with pytest.raises(ManifestError, match="workload"):
        RunManifest(workload)  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [None, [], "x", 3])
def test_config_must_be_an_object(config: object) -> None:
    with pytest.raises(ManifestError, match="config"):
        RunManifest("tiny", config=config)  # type: ignore[arg-type]


# --- json ----------------------------------------------------------------------------------------

def test_json_round_trip() -> None:
    data = BASE.to_json()
    assert data == {"workload": "tiny", "config": {"hidden": 16, "batch_size": 8},
                    "target_batch_size": 64, "epochs": 10, "min_peers": 2,
                    "average_state_every": 3, "compression": "fp16", "init_seed": 7,
                    "aggregation": "norm_clip"}
    assert RunManifest.from_json(data) == BASE
    assert RunManifest.from_json(orjson.loads(orjson.dumps(data))) == BASE
    assert RunManifest.from_json(RunManifest("x").to_json()) == RunManifest("x")


def test_from_json_fills_defaults() -> None:
    # all but aggregation: a manifest without it is a mean run (it was written before the field)
    assert RunManifest.from_json({"workload": "tiny"}) == RunManifest("tiny", aggregation="mean")
    assert RunManifest.from_json({"workload": "tiny", "aggregation": "norm_clip"}) == RunManifest("tiny")


def test_from_json_names_unknown_fields_and_says_to_upgrade() -> None:
    data = {**BASE.to_json(), "zeta_field": 1, "alpha_field": True}
    with pytest.raises(ManifestError) as info:
        RunManifest.from_json(data)
    message = str(info.value)
    assert "alpha_field" in message and "zeta_field" in message
    assert message.index("alpha_field") < message.index("zeta_field")  # sorted
    assert "upgrade" in message


@pytest.mark.parametrize("data", [None, [], "tiny", 3, [("workload", "tiny")]])
def test_from_json_refuses_non_objects(data: object) -> None:
    with pytest.raises(ManifestError, match="object"):
        RunManifest.from_json(data)


def test_from_json_missing_workload_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="malformed"):
        RunManifest.from_json({"target_batch_size": 4})


def test_from_json_validates_values() -> None:
    with pytest.raises(ManifestError, match="target_batch_size"):
        RunManifest.from_json({**BASE.to_json(), "target_batch_size": 0})
    with pytest.raises(ManifestError, match="compression"):
        RunManifest.from_json({**BASE.to_json(), "compression": "zip"})


# --- fingerprint ---------------------------------------------------------------------------------

def test_fingerprint_is_a_short_hex_digest() -> None:
    fingerprint = BASE.fingerprint()
    assert len(fingerprint) == 16
    int(fingerprint, 16)
    assert BASE.fingerprint() == fingerprint  # deterministic


def test_fingerprint_ignores_key_order_of_the_config() -> None:
    a = RunManifest("tiny", {"a": 1, "b": {"x": 1, "y": [1, 2]}, "c": "z"})
    b = RunManifest("tiny", {"c": "z", "b": {"y": [1, 2], "x": 1}, "a": 1})
    assert a.fingerprint() == b.fingerprint()
    assert RunManifest.from_json(orjson.loads(orjson.dumps(b.to_json()))).fingerprint() \
        == a.fingerprint()


@pytest.mark.parametrize(("name", "value"), [
    ("workload", "other"),
    ("config", {"hidden": 16, "batch_size": 9}),
    ("config", {"hidden": 16}),
    ("config", {"hidden": 16, "batch_size": 8, "extra": None}),
    ("target_batch_size", 65),
    ("epochs", None),
    ("epochs", 11),
    ("min_peers", 3),
    ("average_state_every", 0),
    ("compression", "uint8"),
    ("init_seed", 8),
    ("aggregation", "mean"),
])
def test_fingerprint_changes_with_every_field(name: str, value: Any) -> None:
    changed = dataclasses.replace(BASE, **{name: value})
    assert changed.fingerprint() != BASE.fingerprint()


LOCAL = dataclasses.replace(BASE, sync="local", inner_steps=25)


def test_a_gradients_run_keeps_the_fingerprint_it_had_before_sync_existed() -> None:
    # the fields of local-update runs are left out of a gradients run's JSON
    assert set(BASE.to_json()) == {"workload", "config", "target_batch_size", "epochs", "min_peers",
                                   "average_state_every", "compression", "init_seed", "aggregation"}
    assert BASE.fingerprint() == RunManifest.from_json(BASE.to_json()).fingerprint()


def test_runs_aggregate_by_the_norm_clipped_mean_unless_they_say_mean() -> None:
    assert BASE.aggregation == "norm_clip" and BASE.to_json()["aggregation"] == "norm_clip"
    mean = dataclasses.replace(BASE, aggregation="mean")
    assert mean.fingerprint() != BASE.fingerprint()
    assert RunManifest.from_json(mean.to_json()) == mean
    # a mean run is what every run was before the field existed: its JSON leaves the field out,
    # so its fingerprint is the one it had then, and such a manifest (a run create file, a peer
    # of an earlier version) reads as a mean run, never as one whose reducers clip
    before = {k: v for k, v in BASE.to_json().items() if k != "aggregation"}
    assert mean.to_json() == before
    assert RunManifest.from_json(before) == mean
    with pytest.raises(ManifestError, match="aggregation must be one of mean, norm_clip"):
        dataclasses.replace(BASE, aggregation="centered_clip")
    with pytest.raises(ManifestError, match="aggregation must be"):
        RunManifest.from_json({**BASE.to_json(), "aggregation": 1})


def test_a_local_update_run_averages_by_the_mean_unless_it_says_norm_clip() -> None:
    # its pseudo-gradients grow with each peer's inner steps: under norm_clip an honest fast
    # peer's was clipped, and the outer step was not the weighted mean of the peers' work (seen
    # in test_local_updates's reference check under load)
    local = RunManifest("tiny", sync="local", inner_steps=4)
    assert local.aggregation == "mean" and "aggregation" not in local.to_json()
    assert RunManifest.from_json(local.to_json()) == local
    assert RunManifest("tiny", sync="local", inner_steps=4, aggregation="norm_clip").aggregation \
        == "norm_clip"
    assert RunManifest("tiny", aggregation="auto").aggregation == "norm_clip"


def test_a_local_update_run_names_its_outer_optimizer() -> None:
    data = LOCAL.to_json()
    assert (data["sync"], data["inner_steps"], data["outer_lr"], data["outer_momentum"],
            data["outer_nesterov"]) == ("local", 25, 0.7, 0.9, True)
    assert RunManifest.from_json(data) == LOCAL
    assert LOCAL.fingerprint() != BASE.fingerprint()
    assert LOCAL.epoch_samples == 25 * 64 and BASE.epoch_samples == 64
    assert LOCAL.worker_sync() == {"mode": "local", "inner_steps": 25, "outer_lr": 0.7,
                                   "outer_momentum": 0.9, "nesterov": True, "overlap": False,
                                   "clip": 4.0, "inner_lr_scale": "auto", "target_batch_size": 64}
    assert LOCAL.max_weight == 25 * 64 + 7 * 64 and BASE.max_weight == 8 * 64
    assert BASE.worker_sync() is None and BASE.sync_fields() == {}
    assert dataclasses.replace(BASE, **LOCAL.sync_fields()) == LOCAL
    # 1 and 1.0 are one outer learning rate, one fingerprint
    assert dataclasses.replace(LOCAL, outer_lr=1).fingerprint() \
        == dataclasses.replace(LOCAL, outer_lr=1.0).fingerprint()


def test_a_topk_run_takes_sparselocos_outer_settings_unless_it_names_its_own() -> None:
    # (None: the codec's defaults; dataclasses.replace keeps a manifest's resolved ones)
    topk = dataclasses.replace(LOCAL, compression="topk", outer_lr=None, outer_momentum=None,
                               feedback_decay=None)
    assert (topk.outer_lr, topk.outer_momentum, topk.feedback_decay) == (1.5, 0.0, 0.95)
    assert (LOCAL.outer_lr, LOCAL.outer_momentum, LOCAL.feedback_decay) == (0.7, 0.9, 1.0)
    for codec in ("none", "fp16", "uint8", "quantile8"):  # DiLoCo's for every dense codec
        dense = RunManifest("tiny", sync="local", inner_steps=4, compression=codec)
        assert (dense.outer_lr, dense.outer_momentum, dense.feedback_decay) == (0.7, 0.9, 1.0)
    assert topk.to_json()["feedback_decay"] == 0.95
    assert topk.worker_sync()["feedback_decay"] == 0.95  # type: ignore[index]
    assert RunManifest.from_json(topk.to_json()) == topk
    assert dataclasses.replace(BASE, compression="topk", **topk.sync_fields()) == topk
    assert dataclasses.replace(LOCAL, compression="topk").outer_momentum == 0.9
    # named ones win, and 0.95 given or defaulted is one fingerprint
    own = RunManifest("tiny", compression="topk", sync="local", inner_steps=25, outer_lr=0.7,
                      outer_momentum=0.9, feedback_decay=1.0)
    assert (own.outer_lr, own.outer_momentum, own.feedback_decay) == (0.7, 0.9, 1.0)
    fresh = RunManifest("tiny", compression="topk", sync="local", inner_steps=25)
    assert own.fingerprint() != fresh.fingerprint()
    assert RunManifest("tiny", compression="topk", sync="local", inner_steps=25,
                       feedback_decay=0.95).fingerprint() == fresh.fingerprint()


def test_a_local_run_from_before_feedback_decay_keeps_its_fingerprint_and_its_whole_residual() -> None:
    # a manifest of such a run (a peer of an earlier version, a run create file): no
    # feedback_decay in its JSON; it reads as 1 (what its peers did), never as topk's 0.95
    before_topk = {**dataclasses.replace(LOCAL, compression="topk", outer_lr=0.7,
                                         outer_momentum=0.9, feedback_decay=1.0).to_json()}
    assert "feedback_decay" not in before_topk
    read = RunManifest.from_json(before_topk)
    assert (read.outer_lr, read.outer_momentum, read.feedback_decay) == (0.7, 0.9, 1.0)
    assert read.to_json() == before_topk and "feedback_decay" not in read.worker_sync()  # type: ignore[operator]
    assert "feedback_decay" not in LOCAL.to_json() and "feedback_decay" not in BASE.to_json()


def test_a_hand_written_local_manifest_without_outer_settings_reads_as_it_did_before() -> None:
    # no feedback_decay, no outer_lr, no outer_momentum: what such a JSON meant before topk had
    # its own defaults was DiLoCo's, topk's included; it must not read as a mix of both
    data = {"workload": "tiny", "sync": "local", "inner_steps": 4, "compression": "topk"}
    read = RunManifest.from_json(data)
    assert (read.outer_lr, read.outer_momentum, read.feedback_decay) == (0.7, 0.9, 1.0)
    # one that names feedback_decay is new: what it leaves out takes the codec's defaults
    read = RunManifest.from_json({**data, "feedback_decay": 0.95})
    assert (read.outer_lr, read.outer_momentum, read.feedback_decay) == (1.5, 0.0, 0.95)


def test_feedback_decay_is_refused_where_no_residual_exists() -> None:
    with pytest.raises(ManifestError, match="compression none has none"):
        RunManifest("tiny", sync="local", inner_steps=4, feedback_decay=0.9)
    assert RunManifest("tiny", sync="local", inner_steps=4, compression="uint8",
                       feedback_decay=0.9).feedback_decay == 0.9


@pytest.mark.parametrize("value", [-0.1, 1.01, float("nan"), True, "0.9"])
def test_a_feedback_decay_out_of_bounds_is_refused(value: Any) -> None:
    with pytest.raises(ManifestError, match=r"feedback_decay must be a number from 0 to 1\.0"):
        dataclasses.replace(LOCAL, compression="topk", feedback_decay=value)


def test_a_gradients_run_refuses_a_feedback_decay() -> None:
    with pytest.raises(ManifestError, match="are for local-update runs"):
        dataclasses.replace(BASE, feedback_decay=0.9)


def test_a_local_update_runs_inner_lr_is_scaled_to_the_trainers_batch_unless_it_says_otherwise() -> None:
    assert LOCAL.inner_lr_scale == "auto" and LOCAL.to_json()["inner_lr_scale"] == "auto"
    assert RunManifest.from_json(LOCAL.to_json()) == LOCAL
    # left out (a manifest written by hand): the default, spelled out in the fingerprint
    data = {k: v for k, v in LOCAL.to_json().items() if k != "inner_lr_scale"}
    assert RunManifest.from_json(data).fingerprint() == LOCAL.fingerprint()
    explicit = dataclasses.replace(LOCAL, inner_lr_scale=0.5)
    assert explicit.to_json()["inner_lr_scale"] == 0.5
    assert explicit.worker_sync()["inner_lr_scale"] == 0.5  # type: ignore[index]
    assert "target_batch_size" not in explicit.worker_sync()  # type: ignore[operator]
    assert dataclasses.replace(BASE, **explicit.sync_fields()) == explicit
    # 1 and 1.0 are one scale, one fingerprint; the bounds are allowed
    assert dataclasses.replace(LOCAL, inner_lr_scale=1).fingerprint() \
        == dataclasses.replace(LOCAL, inner_lr_scale=1.0).fingerprint()
    for bound in (1e-4, 10):
        assert dataclasses.replace(LOCAL, inner_lr_scale=bound).inner_lr_scale == float(bound)
    # a gradients run has none (its steps take the whole batch): not in its JSON
    assert BASE.inner_lr_scale is None and "inner_lr_scale" not in BASE.to_json()


@pytest.mark.parametrize("value", [0, -1, 1e-5, 10.5, float("nan"), float("inf"), True, "Auto",
                                   "1", [1]])
def test_an_inner_lr_scale_out_of_bounds_is_refused_saying_what_it_takes(value: Any) -> None:
    with pytest.raises(ManifestError, match=r'inner_lr_scale must be "auto" .* or a number '
                                            r"from 0\.0001 to 10\.0"):
        dataclasses.replace(LOCAL, inner_lr_scale=value)


@pytest.mark.parametrize("value", ["auto", 1.0, 0.25])
def test_a_gradients_run_refuses_an_inner_lr_scale(value: Any) -> None:
    with pytest.raises(ManifestError, match=r"inner_lr_scale.* are for local-update runs"):
        dataclasses.replace(BASE, inner_lr_scale=value)
    with pytest.raises(ManifestError, match="inner_lr_scale"):
        RunManifest.from_json({**BASE.to_json(), "inner_lr_scale": value})


@pytest.mark.parametrize(("name", "value"), [
    ("inner_steps", 26), ("outer_lr", 0.5), ("outer_momentum", 0.0), ("outer_nesterov", False),
    ("overlap", True), ("outer_clip", 0.0), ("inner_lr_scale", 1.0), ("inner_lr_scale", 0.25),
    ("feedback_decay", 0.9), ("compression", "topk"),
])
def test_a_local_update_runs_fingerprint_changes_with_its_outer_optimizer(name: str, value: Any) -> None:
    assert dataclasses.replace(LOCAL, **{name: value}).fingerprint() != LOCAL.fingerprint()


@pytest.mark.parametrize("changes", [
    {"sync": "diloco"}, {"sync": None},
    {"sync": "local"},  # no inner_steps
    {"sync": "local", "inner_steps": 0}, {"sync": "local", "inner_steps": 10**7},
    {"sync": "local", "inner_steps": True}, {"sync": "local", "inner_steps": 2.0},
    {"sync": "local", "inner_steps": 4, "outer_lr": -0.1},
    {"sync": "local", "inner_steps": 4, "outer_lr": float("inf")},
    {"sync": "local", "inner_steps": 4, "outer_lr": "1"},
    {"sync": "local", "inner_steps": 4, "outer_momentum": 1.0},
    {"sync": "local", "inner_steps": 4, "outer_nesterov": "yes"},
    {"inner_steps": 4},  # outer settings without sync "local": a mistake, said so
    {"outer_lr": 1.0}, {"overlap": True}, {"outer_clip": 2.0},
    {"sync": "local", "inner_steps": 4, "outer_clip": -1}, {"sync": "local", "inner_steps": 4, "overlap": 1},
])
def test_malformed_sync_settings_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        dataclasses.replace(BASE, **changes)


def test_fingerprint_distinguishes_list_order_and_types() -> None:
    assert RunManifest("t", {"l": [1, 2]}).fingerprint() != RunManifest("t", {"l": [2, 1]}).fingerprint()
    assert RunManifest("t", {"v": 1}).fingerprint() != RunManifest("t", {"v": "1"}).fingerprint()


# --- the DHT: fakes ------------------------------------------------------------------------------

@dataclass
class FakeEntry:
    value: bytes


@dataclass
class FakeRecord:
    sub_keys: dict[str, FakeEntry]

    @property
    def has_sub_keys(self) -> bool:
        return bool(self.sub_keys)

    @property
    def own_sub_keys(self) -> dict[str, FakeEntry]:  # every publisher here writes its own sub-key
        return self.sub_keys


@dataclass
class FakeDHT:
    values: dict[str, dict[str, bytes]] = field(default_factory=dict)
    fail_with: BaseException | None = None
    plain: bool = False  # the key holds a plain value, not sub-keys
    gets: list[tuple[str, float]] = field(default_factory=list)
    stores: list[dict[str, Any]] = field(default_factory=list)

    async def get(self, key: str, timeout: float = 5.0) -> FakeRecord | None:
        self.gets.append((key, timeout))
        if self.fail_with is not None:
            raise self.fail_with
        if self.plain:
            return FakeRecord({})
        held = self.values.get(key)
        return None if held is None else FakeRecord({k: FakeEntry(v) for k, v in held.items()})

    async def store(self, key: str, value: bytes, expiration: float, sub_key: str | None = None,
                    timeout: float = 5.0) -> bool:
        self.stores.append({"key": key, "value": value, "expiration": expiration,
                            "sub_key": sub_key, "timeout": timeout})
        if self.fail_with is not None:
            raise self.fail_with
        self.values.setdefault(key, {})[sub_key or ""] = value
        return True


def entry(manifest: RunManifest, parameters: Any = 1000, published_at: float = 100.0,
          **changes: Any) -> bytes:
    data = {"manifest": manifest.to_json(), "fingerprint": manifest.fingerprint(),
            "parameters": parameters, "published_at": published_at}
    data.update(changes)
    return orjson.dumps(data)


def dht_with(name: str, **sub_keys: bytes) -> FakeDHT:
    return FakeDHT({manifests_key(name): dict(sub_keys)})


OTHER = dataclasses.replace(BASE, target_batch_size=128)
THIRD = dataclasses.replace(BASE, workload="third")


# --- find_manifests ------------------------------------------------------------------------------

async def test_find_most_published_first() -> None:
    dht = dht_with("r", p1=entry(OTHER), p2=entry(BASE), p3=entry(BASE), p4=entry(THIRD),
                   p5=entry(BASE), p6=entry(OTHER))
    found = await find_manifests(dht, "r")
    assert dht.gets == [("collab/r/manifests", 5.0)]
    assert [p.fingerprint for p in found] == [BASE.fingerprint(), OTHER.fingerprint(),
                                              THIRD.fingerprint()]
    assert [sorted(p.publishers) for p in found] == [["p2", "p3", "p5"], ["p1", "p6"], ["p4"]]
    assert found[0].manifest == BASE
    assert found[0].parameters == 1000


async def test_find_groups_publishers_and_keeps_the_latest_time() -> None:
    dht = dht_with("r", a=entry(BASE, published_at=10.0), b=entry(BASE, published_at=30.0),
                   c=entry(BASE, published_at=20.0))
    (found,) = await find_manifests(dht, "r")
    assert found.published_at == 30.0
    assert set(found.publishers) == {"a", "b", "c"}
    assert found.to_json() == {"manifest": BASE.to_json(), "fingerprint": BASE.fingerprint(),
                               "parameters": 1000, "publishers": 3, "published_at": 30.0}


async def test_find_ties_broken_by_the_latest_publication() -> None:
    dht = dht_with("r", a=entry(BASE, published_at=10.0), b=entry(OTHER, published_at=50.0))
    found = await find_manifests(dht, "r")
    assert [p.manifest for p in found] == [OTHER, BASE]


@pytest.mark.parametrize("bad", [
    b"not json",
    b"\xff\xfe",
    b"[1, 2, 3]",
    b"42",
    b"null",
    b'{"manifest": null, "parameters": 5}',
    b'{"manifest": [], "parameters": 5}',
    orjson.dumps({"manifest": {**BASE.to_json(), "future": 1}, "parameters": 5}),
    orjson.dumps({"manifest": {**BASE.to_json(), "target_batch_size": 0}, "parameters": 5}),
])
async def test_find_skips_malformed_entries(bad: bytes) -> None:
    dht = dht_with("r", good=entry(BASE), bad=bad)
    found = await find_manifests(dht, "r")
    assert [(p.fingerprint, p.publishers) for p in found] == [(BASE.fingerprint(), ("good",))]


@pytest.mark.parametrize("changes", [
    {"fingerprint": "0" * 16},
    {"fingerprint": None},
    {"fingerprint": OTHER.fingerprint()},
])
async def test_find_skips_fingerprint_mismatch(changes: dict[str, Any]) -> None:
    dht = dht_with("r", good=entry(BASE), bad=entry(BASE, **changes))
    found = await find_manifests(dht, "r")
    assert [p.publishers for p in found] == [("good",)]


async def test_find_skips_missing_fingerprint_too() -> None:
    data = orjson.loads(entry(BASE))
    del data["fingerprint"]
    assert await find_manifests(dht_with("r", bad=orjson.dumps(data)), "r") == []


@pytest.mark.parametrize("parameters", [0, -5, True, False, 1.5, "1000", None, [1000]])
async def test_find_skips_bad_parameters(parameters: Any) -> None:
    dht = dht_with("r", good=entry(BASE, parameters=7), bad=entry(BASE, parameters=parameters))
    found = await find_manifests(dht, "r")
    assert [(p.publishers, p.parameters) for p in found] == [(("good",), 7)]


async def test_find_skips_missing_parameters() -> None:
    data = orjson.loads(entry(BASE))
    del data["parameters"]
    assert await find_manifests(dht_with("r", bad=orjson.dumps(data)), "r") == []


@pytest.mark.parametrize("published_at", ["yesterday", None, [1]])
async def test_find_skips_bad_publication_time(published_at: Any) -> None:
    dht = dht_with("r", good=entry(BASE), bad=entry(BASE, published_at=published_at))
    found = await find_manifests(dht, "r")
    assert [p.publishers for p in found] == [("good",)]


async def test_find_skips_oversized_entries() -> None:
    big = RunManifest("tiny", {"blob": "x" * MAX_MANIFEST_BYTES})
    dht = dht_with("r", big=entry(big), good=entry(BASE))
    assert len(dht.values[manifests_key("r")]["big"]) > MAX_MANIFEST_BYTES
    found = await find_manifests(dht, "r")
    assert [p.fingerprint for p in found] == [BASE.fingerprint()]
    just_fits = RunManifest("tiny", {"blob": "x" * (MAX_MANIFEST_BYTES // 2)})
    assert len(entry(just_fits)) <= MAX_MANIFEST_BYTES
    assert [p.manifest for p in await find_manifests(dht_with("r", ok=entry(just_fits)), "r")] \
        == [just_fits]


async def test_find_keeps_the_first_publishers_parameter_count() -> None:
    # the parameter count does not enter the fingerprint: the first entry seen wins
    dht = dht_with("r", a=entry(BASE, parameters=10), b=entry(BASE, parameters=20))
    (found,) = await find_manifests(dht, "r")
    assert found.parameters == 10


@pytest.mark.parametrize("error", [TimeoutError("slow"), TransportError("unreachable")])
async def test_find_failed_lookup_is_empty(error: BaseException) -> None:
    dht = dht_with("r", a=entry(BASE))
    dht.fail_with = error
    assert await find_manifests(dht, "r") == []


async def test_find_nothing_published() -> None:
    assert await find_manifests(FakeDHT(), "r") == []
    assert await find_manifests(dht_with("r"), "r") == []
    plain = FakeDHT(plain=True)
    assert await find_manifests(plain, "r") == []


async def test_find_looks_under_the_runs_own_key() -> None:
    dht = dht_with("other-run", a=entry(BASE))
    assert await find_manifests(dht, "r") == []
    assert len(await find_manifests(dht, "other-run")) == 1


# --- choose_manifest -----------------------------------------------------------------------------

def published(manifest: RunManifest, *publishers: str, at: float = 0.0) -> PublishedManifest:
    return PublishedManifest(manifest, manifest.fingerprint(), 100, publishers, at)


def test_choose_the_most_published() -> None:
    best = published(BASE, "a", "b")
    assert choose_manifest("r", [best, published(OTHER, "c")]) is best
    only = published(OTHER, "c")
    assert choose_manifest("r", [only]) is only


def test_choose_none_tells_to_give_a_workload() -> None:
    with pytest.raises(ManifestError) as info:
        choose_manifest("my-run", [])
    message = str(info.value)
    assert "'my-run'" in message
    assert "workload" in message


def test_choose_equally_popular_names_both_fingerprints() -> None:
    candidates = [published(BASE, "a", "b", at=5.0), published(OTHER, "c", "d", at=1.0),
                  published(THIRD, "e")]
    with pytest.raises(ManifestError) as info:
        choose_manifest("r", candidates)
    message = str(info.value)
    assert BASE.fingerprint() in message
    assert OTHER.fingerprint() in message
    assert "'r'" in message
    assert "workload" in message


async def test_choose_from_what_was_found() -> None:
    tie = dht_with("r", a=entry(BASE), b=entry(OTHER))
    with pytest.raises(ManifestError) as info:
        choose_manifest("r", await find_manifests(tie, "r"))
    assert BASE.fingerprint() in str(info.value) and OTHER.fingerprint() in str(info.value)
    clear = dht_with("r", a=entry(BASE), b=entry(OTHER), c=entry(OTHER))
    assert choose_manifest("r", await find_manifests(clear, "r")).manifest == OTHER
    with pytest.raises(ManifestError, match="workload"):
        choose_manifest("r", await find_manifests(FakeDHT(), "r"))


# --- publish_manifest ----------------------------------------------------------------------------

async def test_publish_stores_under_the_peer_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dedloc.daemon.timebase.now", lambda: 1000.0)
    dht = FakeDHT()
    await publish_manifest(dht, "r", BASE, 4321, "peer-xyz")
    (stored,) = dht.stores
    assert stored["key"] == "collab/r/manifests"
    assert stored["sub_key"] == "peer-xyz"
    assert stored["expiration"] == 1000.0 + MANIFEST_TTL
    assert stored["timeout"] > 0
    data = orjson.loads(stored["value"])
    assert data == {"manifest": BASE.to_json(), "fingerprint": BASE.fingerprint(),
                    "parameters": 4321, "published_at": 1000.0}
    assert len(stored["value"]) <= MAX_MANIFEST_BYTES


async def test_publish_then_find_round_trip() -> None:
    dht = FakeDHT()
    await publish_manifest(dht, "r", BASE, 4321, "peer-1")
    await publish_manifest(dht, "r", BASE, 4321, "peer-2")
    await publish_manifest(dht, "r", OTHER, 99, "peer-3")
    found = await find_manifests(dht, "r")
    assert [(p.manifest, set(p.publishers), p.parameters) for p in found] == [
        (BASE, {"peer-1", "peer-2"}, 4321), (OTHER, {"peer-3"}, 99)]
    assert choose_manifest("r", found).manifest == BASE


@pytest.mark.parametrize("error", [TimeoutError("slow"), TransportError("unreachable")])
async def test_publish_survives_a_failed_store(error: BaseException) -> None:
    dht = FakeDHT(fail_with=error)
    await publish_manifest(dht, "r", BASE, 10, "peer-1")  # no exception
    assert len(dht.stores) == 1


# --- the task fingerprint --------------------------------------------------------------------------

def test_task_is_part_of_the_identity_and_absent_when_none() -> None:
    assert "task" not in BASE.to_json()  # a workload without one keeps the fingerprint it had
    with_task = dataclasses.replace(BASE, task="vocab-0123456789abcdef")
    assert with_task.to_json()["task"] == "vocab-0123456789abcdef"
    assert with_task.fingerprint() != BASE.fingerprint()
    assert RunManifest.from_json(with_task.to_json()) == with_task
    assert RunManifest.from_json(BASE.to_json()).task is None


@pytest.mark.parametrize("task", ["", "x" * 129, 5, ["vocab"]])
def test_bad_task_is_refused(task: Any) -> None:
    with pytest.raises(ManifestError, match="task"):
        RunManifest.from_json({**BASE.to_json(), "task": task})


def test_a_local_update_run_averages_no_state() -> None:
    from dedloc.daemon.collab.run import schedule_of

    assert schedule_of(BASE).average_state_every == 3 and schedule_of(BASE).target_batch_size == 64
    local = schedule_of(dataclasses.replace(LOCAL, average_state_every=5))
    assert local.average_state_every == 0 and local.target_batch_size == 25 * 64


def test_a_grid_round_sends_its_later_stages_densely_when_the_codec_sparsifies() -> None:
    from dedloc.daemon.collab.rounds import stage_compression

    assert stage_compression("topk", "m0/3") == "topk"
    assert stage_compression("topk", "m1/0") == "fp16" and stage_compression("topk", "m2/1") == "fp16"
    assert stage_compression("uint8", "m1/0") == "uint8" and stage_compression("none", "m1/0") == "none"
