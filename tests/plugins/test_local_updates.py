"""A worker session in a local-update run (sync mode "local", plugins/worker/outer.py): inner
steps on every batch, the pseudo-gradient, the outer step, and the state and checkpoint that
carry the outer parameters and momentum. Sessions run in this process with `tiny`."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
import torch
from reference_trainer import replay_local

from dedloc.plugins.catalog import CatalogEntry
from dedloc.plugins.errors import CheckpointError, SharedBufferError, WorkloadError
from dedloc.plugins.tiny.workload import TINY
from dedloc.plugins.worker.outer import LocalUpdates, OuterState
from dedloc.plugins.worker.session import Session
from dedloc.rpc import InvalidParams

CONFIG = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "batch_size": 8, "hidden": 16,
          "warmup_steps": 0}
ENTRY = CatalogEntry(TINY, "tiny (test)")


def _session(seed: int, local: LocalUpdates | None, config: dict[str, Any] | None = None) -> Session:
    resolved = TINY.resolve_config(dict(config or CONFIG))
    return Session(ENTRY, resolved, seed=seed, init_seed=5, device=torch.device("cpu"), local=local)


def _flat(session: Session) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in session.params]).numpy().copy()


def _train(session: Session, samples: int) -> None:
    session.train(samples, None, threading.Event())


def test_the_outer_step_is_sgd_with_nesterov_momentum() -> None:
    settings = LocalUpdates(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True, clip=0)
    start = torch.randn(10, generator=torch.Generator().manual_seed(1))
    reference = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterState(settings, [_slot(10)], [start.clone()], torch.device("cpu"))
    generator = torch.Generator().manual_seed(2)
    for _ in range(4):
        delta = torch.randn(10, generator=generator)
        reference.grad = delta.clone()
        optimizer.step()
        outer.step(delta)
        torch.testing.assert_close(outer.params, reference.detach(), rtol=0, atol=1e-6)


def _slot(numel: int) -> Any:
    from dedloc.plugins.worker.layout import pack

    return pack([("x", (numel,))])[0]


def test_an_outer_step_of_lr_one_without_momentum_is_the_weighted_mean_of_the_local_parameters(
        buffers: Any) -> None:
    local = LocalUpdates(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, clip=0)
    peers = [_session(1, local), _session(2, local)]
    initial = _flat(peers[0])
    assert np.array_equal(initial, _flat(peers[1]))  # the same initial weights
    _train(peers[0], 24)  # three inner steps
    _train(peers[1], 8)  # one
    assert [p.inner_step for p in peers] == [3, 1]
    assert [p.accumulated_samples for p in peers] == [24, 8]
    drifted = [_flat(p) for p in peers]
    assert not np.array_equal(drifted[0], initial)  # the inner steps moved the model
    numel = peers[0].total_numel
    deltas = []
    for peer in peers:
        name, vector = buffers.make(numel)
        exported = peer.export("gradients", name, numel)
        assert exported["meta"]["accumulated_samples"] == peer.accumulated_samples
        deltas.append((name, vector))
        # the pseudo-gradient is outer minus local parameters
        np.testing.assert_allclose(vector, initial - _flat(peer), rtol=0, atol=1e-6)
    mean = (24 * deltas[0][1] + 8 * deltas[1][1]) / 32
    for peer, (name, vector) in zip(peers, deltas, strict=True):
        vector[:] = mean
        answer = peer.apply("gradients", name, numel, {"step": 0})
        assert answer["step"] == 1 and peer.step == 1
        assert peer.inner_step == 0 and peer.accumulated_samples == 0
    expected = (24 * drifted[0] + 8 * drifted[1]) / 32
    for peer in peers:
        np.testing.assert_allclose(_flat(peer), expected, rtol=0, atol=1e-6)
        assert peer.outer is not None
        np.testing.assert_allclose(peer.outer.params.numpy(), expected, rtol=0, atol=1e-6)
    # ... which is what plain SGD on each peer's own batches, then the weighted mean, gives
    (_, replayed) = replay_local(CONFIG, 5, [(1, {0: 24}), (2, {0: 8})], 1)
    reference = torch.cat([replayed[name].reshape(-1)
                           for name, _ in peers[0].model.named_parameters()]).numpy()
    np.testing.assert_allclose(expected, reference, rtol=0, atol=1e-6)


def test_zero_grad_drops_the_inner_steps() -> None:
    peer = _session(1, LocalUpdates(inner_steps=2))
    initial = _flat(peer)
    _train(peer, 16)
    assert not np.array_equal(_flat(peer), initial)
    peer.zero_grad()
    assert np.array_equal(_flat(peer), initial) and peer.inner_step == 0


def _outer_step(peer: Session, buffers: Any) -> None:
    numel = peer.total_numel
    name, _ = buffers.make(numel)
    peer.export("gradients", name, numel)
    peer.apply("gradients", name, numel, {"step": peer.step})


def test_a_state_carries_the_outer_parameters_and_momentum_never_the_drifted_ones(
        buffers: Any) -> None:
    local = LocalUpdates(inner_steps=4, outer_lr=0.7, outer_momentum=0.9)
    donor = _session(1, local)
    _train(donor, 16)
    _outer_step(donor, buffers)
    assert donor.outer is not None and bool(donor.outer.momentum.abs().sum() > 0)
    outer = donor.outer.params.numpy().copy()
    _train(donor, 16)  # mid-way through the next inner steps
    assert not np.allclose(_flat(donor), outer)
    state_numel = donor.describe()["state_numel"]
    assert state_numel == donor.total_numel * 2  # SGD without momentum: parameters and outer momentum
    name, _ = buffers.make(state_numel)
    exported = donor.export("state", name, state_numel)
    assert exported["meta"]["layout"]["outer"][0]["name"] == "outer.momentum"
    joiner = _session(2, local)
    assert joiner.apply("state", name, exported["numel"], exported["meta"]) == {"step": 1}
    assert np.array_equal(_flat(joiner), outer)
    assert joiner.outer is not None
    assert torch.equal(joiner.outer.momentum, donor.outer.momentum)
    # a gradients run's worker refuses it, and a local-update run refuses a gradients state
    plain = _session(3, None)
    with pytest.raises(SharedBufferError, match="local-update run"):
        plain.apply("state", name, exported["numel"], exported["meta"])
    plain_numel = plain.describe()["state_numel"]
    plain_name, _ = buffers.make(plain_numel)
    plain_state = plain.export("state", plain_name, plain_numel)
    with pytest.raises(SharedBufferError):
        joiner.apply("state", plain_name, plain_state["numel"], plain_state["meta"])
    assert np.array_equal(_flat(joiner), outer)  # nothing changed


def test_a_checkpoint_resumes_on_the_outer_parameters(tmp_path: Any, buffers: Any) -> None:
    local = LocalUpdates(inner_steps=4, outer_lr=0.7, outer_momentum=0.9)
    peer = _session(1, local)
    _train(peer, 16)
    _outer_step(peer, buffers)
    assert peer.outer is not None
    outer, momentum = peer.outer.params.clone(), peer.outer.momentum.clone()
    _train(peer, 8)  # drifted when saved
    path = str(tmp_path / "checkpoint.pt")
    peer.save_checkpoint(path)
    resumed = _session(2, local)
    assert resumed.load_checkpoint(path) == {"step": 1}
    assert resumed.outer is not None
    assert torch.equal(resumed.outer.params, outer) and torch.equal(resumed.outer.momentum, momentum)
    assert np.array_equal(_flat(resumed), outer.numpy())
    # a gradients run's checkpoint has no outer parameters: refused
    plain = _session(3, None)
    plain_path = str(tmp_path / "plain.pt")
    plain.save_checkpoint(plain_path)
    with pytest.raises(CheckpointError, match="outer parameters"):
        resumed.load_checkpoint(plain_path)


@pytest.mark.parametrize("sync", [
    "local", {"mode": "local"}, {"mode": "local", "inner_steps": 0},
    {"mode": "local", "inner_steps": True}, {"mode": "local", "inner_steps": 4, "outer_lr": -1},
    {"mode": "local", "inner_steps": 4, "outer_lr": float("nan")},
    {"mode": "local", "inner_steps": 4, "outer_momentum": 1.0},
    {"mode": "local", "inner_steps": 4, "nesterov": 1}, {"mode": "local", "inner_steps": 4, "x": 1},
    {"mode": "diloco", "inner_steps": 4}, {"mode": "gradients", "inner_steps": 4},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": 0},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": 11},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": float("nan")},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": "Auto", "target_batch_size": 64},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": True},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": "auto"},  # no target batch size
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": "auto", "target_batch_size": 0},
    {"mode": "local", "inner_steps": 4, "inner_lr_scale": "auto", "target_batch_size": 64.0},
])
def test_malformed_sync_settings_are_refused(sync: Any) -> None:
    with pytest.raises(InvalidParams):
        LocalUpdates.from_json(sync)


def test_sync_settings_default_like_diloco() -> None:
    assert LocalUpdates.from_json(None) is None
    assert LocalUpdates.from_json({"mode": "gradients"}) is None
    local = LocalUpdates.from_json({"mode": "local", "inner_steps": 100})
    assert local == LocalUpdates(100, 0.7, 0.9, True, False, 4.0)
    assert local.inner_lr_scale == 1.0 and local.lr_scale(16) == 1.0  # the workload's lr as it is
    assert LocalUpdates.from_json(local.to_json()) == local
    auto = LocalUpdates.from_json({"mode": "local", "inner_steps": 100, "inner_lr_scale": "auto",
                                   "target_batch_size": 64})
    assert auto is not None and auto.lr_scale(16) == 0.25 and auto.lr_scale(128) == 2.0
    assert LocalUpdates.from_json(auto.to_json()) == auto
    explicit = LocalUpdates.from_json({"mode": "local", "inner_steps": 100, "inner_lr_scale": 3})
    assert explicit is not None and explicit.lr_scale(16) == 3.0
    assert isinstance(explicit.inner_lr_scale, float)


# --- the inner learning rate: inner_lr_scale ------------------------------------------------------

SCALED = {**CONFIG, "momentum": 0.9, "warmup_steps": 10}  # state and a schedule: both must scale


def _scaled_pair(scale: float | str, seed: int = 1) -> tuple[Session, Session]:
    """A session whose inner steps scale lr 0.1 by `scale` (0.25: batch 8 of a target of 32), and
    one that takes lr 0.025 itself: the same inner steps."""
    scaled = _session(seed, LocalUpdates(inner_steps=2, clip=0, inner_lr_scale=scale,  # type: ignore[arg-type]
                                         target_batch_size=32), SCALED)
    plain = _session(seed, LocalUpdates(inner_steps=2, clip=0), {**SCALED, "lr": 0.025})
    return scaled, plain


def _same_model(scaled: Session, plain: Session) -> None:
    np.testing.assert_allclose(_flat(scaled), _flat(plain), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale", ["auto", 0.25])
def test_inner_steps_take_the_learning_rate_times_inner_lr_scale(buffers: Any, scale: Any) -> None:
    scaled, plain = _scaled_pair(scale)
    initial = _flat(scaled)
    answer = scaled.train(24, None, threading.Event())  # three inner steps, in warm-up
    _train(plain, 24)
    assert not np.array_equal(_flat(scaled), initial)
    _same_model(scaled, plain)
    # the optimizer keeps the workload's (scheduled) rate; only the step used the scaled one
    assert scaled.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 10)
    assert answer["inner_lr"] == pytest.approx(0.025 / 10) and scaled.inner_lr == answer["inner_lr"]
    assert scaled.describe()["sync"]["inner_lr_scale"] == scale
    # the schedule scales too: after outer step 3 it is at the run's 4 * H = 8th target batch
    numel = scaled.total_numel
    for peer in (scaled, plain):
        name, _ = buffers.make(numel)
        peer.export("gradients", name, numel)
        peer.apply("gradients", name, numel, {"step": 3})
    answer = scaled.train(16, None, threading.Event())
    _train(plain, 16)
    assert answer["inner_lr"] == pytest.approx(0.025 * 9 / 10)
    _same_model(scaled, plain)


def test_a_scaled_inner_lr_is_scaled_once_after_a_checkpoint_and_a_state_download(
        tmp_path: Any, buffers: Any) -> None:
    """Checkpoints and states carry the workload's rates, never scaled ones: a restarted or
    joining trainer scales them once, as the one that saved or sent them did."""
    scaled, plain = _scaled_pair("auto")
    numel = scaled.total_numel
    for peer in (scaled, plain):
        _train(peer, 16)
        name, _ = buffers.make(numel)
        peer.export("gradients", name, numel)
        peer.apply("gradients", name, numel, {"step": 0})
        _train(peer, 8)
    _same_model(scaled, plain)
    resumed = []
    for index, peer in enumerate((scaled, plain)):
        path = str(tmp_path / f"checkpoint-{index}.pt")
        peer.save_checkpoint(path)
        again, reference = _scaled_pair("auto", seed=2)
        back = again if index == 0 else reference
        back.load_checkpoint(path)
        back.load_checkpoint(path)  # twice: still the same rate
        resumed.append(back)
        state_numel = peer.describe()["state_numel"]
        state_name, _ = buffers.make(state_numel)
        exported = peer.export("state", state_name, state_numel)
        joiner = _scaled_pair("auto", seed=3)[index]
        joiner.apply("state", state_name, exported["numel"], exported["meta"])
        resumed.append(joiner)
    assert [p.optimizer.param_groups[0]["lr"] for p in resumed[:2]] == \
        [scaled.optimizer.param_groups[0]["lr"]] * 2  # the workload's rate, unscaled
    for peer in resumed:
        _train(peer, 24)
    resumed_scaled, joined_scaled, resumed_plain, joined_plain = resumed
    assert not np.allclose(_flat(resumed_scaled), scaled.outer.params.numpy())  # type: ignore[union-attr]
    _same_model(resumed_scaled, resumed_plain)
    _same_model(joined_scaled, joined_plain)


def test_a_workload_whose_lr_cannot_be_scaled_is_refused_at_load() -> None:
    def no_lr(model: torch.nn.Module, config: dict[str, Any]) -> Any:
        optimizer, scheduler = TINY.build_optimizer(model, config)
        optimizer.param_groups[0]["lr"] = None  # (as an optimizer that picks its own steps)
        return optimizer, scheduler

    entry = CatalogEntry(dataclasses.replace(TINY, build_optimizer=no_lr), "tiny (test)")
    config = TINY.resolve_config(dict(CONFIG))

    def load(local: LocalUpdates) -> Session:
        return Session(entry, config, seed=1, init_seed=5, device=torch.device("cpu"), local=local)

    load(LocalUpdates(inner_steps=2))  # scale 1: nothing to scale
    with pytest.raises(WorkloadError, match="inner_lr_scale 1"):
        load(LocalUpdates(inner_steps=2, inner_lr_scale="auto", target_batch_size=32))


def test_the_residual_joins_the_next_pseudo_gradient_stays_in_checkpoints_and_not_in_states(
        tmp_path: Any, buffers: Any) -> None:
    local = LocalUpdates(inner_steps=2)
    peer = _session(1, local)
    numel = peer.total_numel
    name, vector = buffers.make(numel)
    residual = np.linspace(-1, 1, numel, dtype=np.float32)
    vector[:] = residual
    peer.apply("residual", name, numel, None)
    out_name, out = buffers.make(numel)
    peer.export("residual", out_name, numel)
    assert np.array_equal(out, residual)
    initial = _flat(peer)
    _train(peer, 16)
    peer.export("gradients", out_name, numel)
    np.testing.assert_allclose(out, initial - _flat(peer) + residual, rtol=0, atol=1e-6)
    path = str(tmp_path / "checkpoint.pt")
    peer.save_checkpoint(path)
    resumed = _session(2, local)
    resumed.load_checkpoint(path)
    resumed.export("residual", out_name, numel)
    assert np.array_equal(out, residual)  # this peer's own: kept across a restart
    state_numel = peer.describe()["state_numel"]
    state_name, _ = buffers.make(state_numel)
    exported = peer.export("state", state_name, state_numel)
    joiner = _session(3, local)
    joiner.apply("state", state_name, exported["numel"], exported["meta"])
    joiner.export("residual", out_name, numel)
    assert not out.any()  # a downloaded state starts without one
    vector[0] = float("nan")
    with pytest.raises(SharedBufferError):
        peer.apply("residual", name, numel, None)
    plain = _session(4, None)
    with pytest.raises(SharedBufferError, match="local-update runs"):
        plain.export("residual", out_name, numel)
    with pytest.raises(SharedBufferError, match="local-update runs"):
        plain.apply("residual", out_name, numel, None)


def test_a_decaying_residual_joins_the_next_pseudo_gradient_scaled(buffers: Any) -> None:
    # SparseLoCo: e <- beta e + delta is what goes out (the daemon then keeps e - conveyed)
    peer = _session(1, LocalUpdates(inner_steps=2, feedback_decay=0.5))
    numel = peer.total_numel
    name, vector = buffers.make(numel)
    residual = np.linspace(-1, 1, numel, dtype=np.float32)
    vector[:] = residual
    peer.apply("residual", name, numel, None)
    initial = _flat(peer)
    _train(peer, 16)
    out_name, out = buffers.make(numel)
    peer.export("gradients", out_name, numel)
    np.testing.assert_allclose(out, initial - _flat(peer) + 0.5 * residual, rtol=0, atol=1e-6)
    assert LocalUpdates.from_json({"mode": "local", "inner_steps": 2,
                                   "feedback_decay": 0.5}).feedback_decay == 0.5
    assert LocalUpdates.from_json({"mode": "local", "inner_steps": 2}).feedback_decay == 1.0
    for bad in (-0.5, 1.5, "1", True):
        with pytest.raises(InvalidParams, match="feedback_decay"):
            LocalUpdates.from_json({"mode": "local", "inner_steps": 2, "feedback_decay": bad})


def test_with_overlap_the_inner_steps_made_during_the_exchange_carry_over(buffers: Any) -> None:
    local = LocalUpdates(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, overlap=True, clip=0)
    peers = [_session(1, local), _session(2, local)]
    initial = _flat(peers[0])
    for peer in peers:
        _train(peer, 16)
    numel = peers[0].total_numel
    exported, anchors = [], []
    for peer in peers:
        name, vector = buffers.make(numel)
        peer.export("gradients", name, numel)
        exported.append((name, vector))
        anchors.append(_flat(peer))
    _train(peers[0], 8)  # trained on while the pseudo-gradients are averaged
    moved = _flat(peers[0]) - anchors[0]
    mean = (exported[0][1] + exported[1][1]) / 2
    answers = []
    for peer, (name, vector) in zip(peers, exported, strict=True):
        vector[:] = mean
        answers.append(peer.apply("gradients", name, numel, {"step": 0}))
    outer = initial - mean
    np.testing.assert_allclose(peers[1].outer.params.numpy(), outer, rtol=0, atol=1e-6)  # type: ignore[union-attr]
    np.testing.assert_allclose(_flat(peers[1]), outer, rtol=0, atol=1e-6)  # nothing to carry
    np.testing.assert_allclose(_flat(peers[0]), outer + moved, rtol=0, atol=1e-6)
    assert answers[0]["accumulated_samples"] == 8 and peers[0].inner_step == 1
    assert answers[1]["accumulated_samples"] == 0 and peers[1].inner_step == 0
    # the next pseudo-gradient holds exactly the carried inner step
    name, vector = buffers.make(numel)
    peers[0].export("gradients", name, numel)
    np.testing.assert_allclose(vector, -moved, rtol=0, atol=1e-6)
    # a round that fails settles nothing: the next export covers everything since the outer step
    _train(peers[0], 8)
    peers[0].export("gradients", name, numel)
    np.testing.assert_allclose(vector, outer - _flat(peers[0]), rtol=0, atol=1e-6)
    assert peers[0].accumulated_samples == 16


def test_the_guard_bounds_an_outer_step_by_the_recent_ones() -> None:
    settings = LocalUpdates(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, clip=4.0)
    start = torch.ones(100)
    outer = OuterState(settings, [_slot(100)], [start], torch.device("cpu"))
    # the first step: at most a tenth of the parameters' norm (10 here)
    assert outer.step(torch.full((100,), 0.05)) == 1.0  # norm 0.5: taken whole
    assert outer.step_norm == pytest.approx(0.5)
    # a hostile average 1e6 times larger is scaled to 4x the recent steps' norm
    before = outer.params.clone()
    factor = outer.step(torch.full((100,), 5e4))
    assert factor == pytest.approx(4 * 0.5 / 5e5, rel=1e-6)
    assert float((before - outer.params).norm()) == pytest.approx(2.0, rel=1e-5)
    assert outer.clipped_steps == 1
    # a fresh state's first step cannot rewrite the parameters either
    fresh = OuterState(settings, [_slot(100)], [start], torch.device("cpu"))
    fresh.step(torch.full((100,), -1e3))
    assert float((fresh.params - start).norm()) == pytest.approx(1.0, rel=1e-5)
    # the factor is a function of the norms only: two peers compute the same
    twin = OuterState(settings, [_slot(100)], [start], torch.device("cpu"))
    twin.step(torch.full((100,), -1e3))
    assert torch.equal(twin.params, fresh.params) and twin.step_norm == fresh.step_norm


def test_the_guard_of_a_model_that_starts_at_zero_lets_it_move() -> None:
    settings = LocalUpdates(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, clip=4.0)
    outer = OuterState(settings, [_slot(10)], [torch.zeros(10)], torch.device("cpu"))
    assert outer.step(torch.full((10,), -0.5)) == 1.0  # a bound of 0 x anything froze it
    assert float(outer.params.norm()) > 0 and outer.step_norm and outer.step_norm > 0


def test_the_guards_norm_travels_with_the_state_and_the_checkpoint(tmp_path: Any, buffers: Any) -> None:
    local = LocalUpdates(inner_steps=2)
    donor = _session(1, local)
    _train(donor, 16)
    _outer_step(donor, buffers)
    assert donor.outer is not None and donor.outer.step_norm is not None
    state_numel = donor.describe()["state_numel"]
    name, _ = buffers.make(state_numel)
    exported = donor.export("state", name, state_numel)
    assert exported["meta"]["outer"]["step_norm"] == donor.outer.step_norm
    joiner = _session(2, local)
    joiner.apply("state", name, exported["numel"], exported["meta"])
    assert joiner.outer is not None and joiner.outer.step_norm == donor.outer.step_norm
    path = str(tmp_path / "checkpoint.pt")
    donor.save_checkpoint(path)
    resumed = _session(3, local)
    resumed.load_checkpoint(path)
    assert resumed.outer is not None and resumed.outer.step_norm == donor.outer.step_norm
    for bad in (-1.0, float("nan"), "1", True):
        with pytest.raises(SharedBufferError, match="step_norm"):
            joiner.apply("state", name, exported["numel"],
                         {**exported["meta"], "outer": {"step_norm": bad}})


def test_the_inner_learning_rate_is_held_for_an_outer_step_at_the_runs_position(buffers: Any) -> None:
    config = {**CONFIG, "warmup_steps": 10}
    peer = _session(1, LocalUpdates(inner_steps=2, clip=0), config)
    lr = CONFIG["lr"]
    assert peer.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 1 / 10)
    _train(peer, 40)  # five inner steps: the schedule does not move within the outer step
    assert peer.inner_step == 5
    assert peer.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 1 / 10)
    numel = peer.total_numel
    name, _ = buffers.make(numel)
    peer.export("gradients", name, numel)
    answer = peer.apply("gradients", name, numel, {"step": 3})  # the run's outer step 3
    # outer step 4 starts at the run's 4 * H = 8th target batch
    assert answer["lr"] == pytest.approx(lr * 9 / 10)
    assert peer.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 9 / 10)
