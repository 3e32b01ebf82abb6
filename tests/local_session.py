"""One outer step of a local-update run (plugins/worker/outer.py) on two in-process sessions of a
workload, checked: what the paper workloads' tests use to show they train in both sync modes
without a change to their plugins."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from dedloc.plugins.catalog import CatalogEntry
from dedloc.plugins.worker.outer import LocalUpdates
from dedloc.plugins.worker.session import Session


def _flat(session: Session) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in session.params]).numpy().copy()


def _close(actual: np.ndarray, expected: np.ndarray, atol: float) -> None:
    """(numpy's assert_allclose costs seconds on a ResNet's 11 M values)"""
    worst = float(np.max(np.abs(actual - expected)))
    assert worst <= atol, f"{worst} apart (at most {atol})"


def check_one_outer_step(entry: CatalogEntry, config: dict[str, Any], batch: int,
                         buffers: Any) -> None:
    """Two peers take 2 and 1 inner steps of `batch` samples at the workload's own optimizer
    (its rate scaled "auto": batch / target), exchange their pseudo-gradients (outer minus local
    parameters, finite, weighted by samples), apply one outer step at lr 1 without momentum, and
    end on the same parameters, the samples-weighted mean of where their inner steps took them;
    a newcomer that loads a peer's state then holds those outer parameters too."""
    local = LocalUpdates(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, clip=0,
                         inner_lr_scale="auto", target_batch_size=4 * batch)

    def session(seed: int) -> Session:
        return Session(entry, config, seed=seed, init_seed=3, device=torch.device("cpu"),
                       local=local)

    peers = [session(1), session(2)]
    initial = _flat(peers[0])
    assert np.array_equal(initial, _flat(peers[1]))
    for peer, steps in zip(peers, (2, 1), strict=True):
        for _ in range(steps):
            trained = peer.train(batch, None, threading.Event())
            assert trained["samples"] == batch and math.isfinite(trained["loss"])
    assert [p.inner_step for p in peers] == [2, 1]
    assert [p.accumulated_samples for p in peers] == [2 * batch, batch]  # (the mean's weights)
    drifted = [_flat(p) for p in peers]
    assert all(not np.array_equal(d, initial) for d in drifted)  # the inner steps moved them
    numel = peers[0].total_numel
    vectors = []
    for peer, moved in zip(peers, drifted, strict=True):
        name, vector = buffers.make(numel)
        exported = peer.export("gradients", name, numel)
        assert exported["meta"]["accumulated_samples"] == peer.accumulated_samples
        assert np.isfinite(vector).all()
        _close(vector, initial - moved, 1e-5)
        vectors.append((name, vector))
    mean = (2 * vectors[0][1] + vectors[1][1]) / 3
    for peer, (name, vector) in zip(peers, vectors, strict=True):
        vector[:] = mean
        assert peer.apply("gradients", name, numel, {"step": 0})["step"] == 1
        assert peer.inner_step == 0 and peer.accumulated_samples == 0
    expected = (2 * drifted[0] + drifted[1]) / 3
    for peer in peers:
        _close(_flat(peer), expected, 1e-5)
    state_numel = peers[0].describe()["state_numel"]
    state_name, _ = buffers.make(state_numel)
    exported = peers[0].export("state", state_name, state_numel)
    newcomer = session(5)
    assert newcomer.apply("state", state_name, exported["numel"], exported["meta"])["step"] == 1
    _close(_flat(newcomer), expected, 1e-6)
    # and all three train on from there
    for peer in (*peers, newcomer):
        assert math.isfinite(peer.train(batch, None, threading.Event())["loss"])
