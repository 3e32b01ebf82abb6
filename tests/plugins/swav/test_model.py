"""The SwAV model and loss: presets, frozen prototypes, the queue, the schedule, and training."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from dedloc.plugins.optim.lars import LARS
from dedloc.plugins.swav.model import SwAV, assignment_stats
from dedloc.plugins.swav.workload import (
    SWAV,
    build_data,
    build_model,
    build_optimizer,
    loss,
    lr_factor,
    metrics,
)
from dedloc.plugins.worker.scheduler_position import position_scheduler

CPU = torch.device("cpu")


def crops(batch: int = 4) -> list[torch.Tensor]:
    return [torch.randn(batch, 3, 64, 64), torch.randn(batch, 3, 64, 64),
            torch.randn(batch, 3, 32, 32), torch.randn(batch, 3, 32, 32)]


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_resnet50_preset_has_the_expected_trunk_head_and_prototypes() -> None:
    import torchvision

    model = build_model(SWAV.resolve_config(), CPU)
    assert isinstance(model, SwAV)
    trunk = model.trunk
    assert isinstance(trunk, torchvision.models.ResNet) and isinstance(trunk.fc, nn.Identity)
    assert [len(layer) for layer in (trunk.layer1, trunk.layer2, trunk.layer3, trunk.layer4)] == [3, 4, 6, 3]
    assert all(isinstance(block, torchvision.models.resnet.Bottleneck) for block in trunk.layer4)
    assert count(trunk) == 23_508_032  # torchvision's resnet50 (25,557,032) less its fc (2,049,000)
    linear1, norm, _, linear2 = model.head
    assert (linear1.in_features, linear1.out_features, norm.num_features) == (2048, 2048, 2048)
    assert (linear2.in_features, linear2.out_features) == (2048, 128)
    assert model.prototypes.weight.shape == (3000, 128) and model.prototypes.bias is None
    head = 2048 * 2048 + 2048 + 2 * 2048 + 2048 * 128 + 128
    assert count(model) == 23_508_032 + head + 3000 * 128 == 28_354_752
    torch.testing.assert_close(model.prototypes.weight.norm(dim=1), torch.ones(3000))
    model.eval()
    with torch.no_grad():
        embeddings, scores = model([torch.randn(2, 3, 64, 64)])
    assert embeddings.shape == (2, 128) and scores.shape == (2, 3000)
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(2))


def test_resnet18_preset_scales_the_head(tiny_config: dict[str, Any]) -> None:
    model = build_model({**tiny_config, "prototypes": 3000, "feature_dim": 128}, CPU)
    assert isinstance(model, SwAV)
    assert count(model.trunk) == 11_176_512  # resnet18 less its fc
    linear1, _, _, linear2 = model.head
    assert (linear1.in_features, linear1.out_features, linear2.out_features) == (512, 512, 128)
    assert count(model) == 11_176_512 + 512 * 512 + 512 + 2 * 512 + 512 * 128 + 128 + 3000 * 128


def test_prototypes_get_no_gradient_while_frozen(tiny_config: dict[str, Any]) -> None:
    model = build_model({**tiny_config, "freeze_prototypes_steps": 3}, CPU)
    assert isinstance(model, SwAV)
    batch = crops()
    for step, frozen in [(0, True), (2, True), (3, False), (10, False)]:
        model.step_source = lambda step=step: step
        model.zero_grad(set_to_none=True)
        model.swav_loss(batch).backward()
        assert model.last["frozen"] is frozen
        assert model.head[3].weight.grad is not None and float(model.head[3].weight.grad.abs().sum()) > 0
        if frozen:
            assert model.prototypes.weight.grad is None
        else:
            assert model.prototypes.weight.grad is not None
            assert float(model.prototypes.weight.grad.abs().sum()) > 0


def test_the_queue_starts_at_queue_start_step(tiny_config: dict[str, Any]) -> None:
    model = build_model({**tiny_config, "queue_length": 10, "queue_start_step": 5}, CPU)
    assert isinstance(model, SwAV)
    step = 0
    model.step_source = lambda: step
    used = []
    for step in (3, 4, 5, 5, 6, 7, 8):  # noqa: B007  (read by step_source)
        model.swav_loss(crops(batch=4))
        used.append(model.last["queue_used"])
    # Off before step 5; from step 5 each batch of 4 is queued (up to 10) and used by the next.
    assert used == [0, 0, 0, 4, 8, 10, 10]
    assert model.queue is not None and model.queue.shape == (2, 10, 16) and model.queue_filled == 10
    # The newest embeddings of the assignment crops (the first 2 crops) are at the front.
    batch = crops(batch=4)
    model.swav_loss(batch)
    with torch.no_grad():
        expected = model.embed(batch)[:8].reshape(2, 4, 16)
    torch.testing.assert_close(model.queue[:, :4], expected, rtol=1e-4, atol=1e-5)
    # Evaluation neither uses nor fills it.
    model.eval()
    queue = model.queue.clone()
    with torch.no_grad():
        model.swav_loss(batch)
    assert model.last["queue_used"] == 0
    torch.testing.assert_close(model.queue, queue)


def test_the_queue_changes_the_codes(tiny_config: dict[str, Any]) -> None:
    model = build_model({**tiny_config, "queue_length": 32, "queue_start_step": 0}, CPU)
    assert isinstance(model, SwAV)
    for _ in range(3):
        model.swav_loss(crops())
    batch = crops()
    model.swav_loss(batch)
    with_queue = model.last["codes"][0]
    model.reset_queue()
    model.swav_loss(batch)
    without = model.last["codes"][0]
    assert not torch.allclose(with_queue, without, atol=1e-3)
    torch.testing.assert_close(with_queue.sum(dim=1), torch.ones(4), rtol=0, atol=1e-4)


def test_schedule_warms_up_then_decays_as_a_function_of_the_step() -> None:
    config = SWAV.resolve_config({"lr": 4.8, "warmup_start_lr": 0.3, "min_lr": 0.0048,
                                  "warmup_steps": 10, "total_steps": 110})
    lrs = [4.8 * lr_factor(step, config) for step in range(130)]
    assert lrs[0] == pytest.approx(0.3)
    assert lrs[5] == pytest.approx(0.3 + 4.5 * 0.5)
    assert lrs[10] == pytest.approx(4.8)
    assert lrs[60] == pytest.approx(0.0048 + (4.8 - 0.0048) * 0.5)
    assert lrs[110] == pytest.approx(0.0048) and lrs[129] == pytest.approx(0.0048)
    assert all(a < b for a, b in itertools.pairwise(lrs[:11]))
    assert all(a > b for a, b in itertools.pairwise(lrs[10:111]))


def test_optimizer_is_lars_with_a_lambda_schedule_the_worker_can_position(
        tiny_config: dict[str, Any]) -> None:
    config = {**tiny_config, "warmup_steps": 10, "total_steps": 100}
    model = build_model(config, CPU)
    optimizer, scheduler = build_optimizer(model, config)
    assert isinstance(optimizer, LARS) and isinstance(scheduler, lr_scheduler.LambdaLR)
    adapted, excluded = optimizer.param_groups
    assert all(p.dim() > 1 for p in adapted["params"]) and not adapted["exclude"]
    assert all(p.dim() == 1 for p in excluded["params"]) and excluded["exclude"]
    assert any(p is model.prototypes.weight for p in adapted["params"])
    assert adapted["weight_decay"] == 1e-6 and excluded["weight_decay"] == 0.0
    assert isinstance(model, SwAV) and model.global_step() == 0
    position_scheduler(scheduler, 57)
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(config["lr"] * lr_factor(57, config))
    assert model.global_step() == 57  # the model reads the run's step from the scheduler


def test_loss_falls_over_20_steps(small_crops_config: dict[str, Any]) -> None:
    """20 steps of batches of 8 at half the tiny crop sizes: the swapped-prediction loss falls
    from its value at the random initialisation (peaked, wrong predictions) by a clear margin
    (observed: about 1.5 nats of 5.8, first five steps against the last five; the crops are
    small so that the test costs seconds, not a minute of a loaded CI machine)."""
    config = small_crops_config
    model = build_model(config, CPU)
    optimizer, scheduler = build_optimizer(model, config)
    data = build_data(config, 1, "train")
    losses = []
    for _ in range(20):
        batch = next(data)
        value, size = loss(model, batch, CPU)
        assert size == 8
        (value * size).backward()  # as the worker does: sums, then the mean per sample
        for param in model.parameters():
            if param.grad is not None:
                param.grad /= size
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(value.detach()))
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, losses
    model.eval()
    with torch.no_grad():
        numbers = metrics(model, next(build_data(config, 1, "eval")), CPU)
    assert set(numbers) == {"code_entropy", "prototype_usage", "prediction_entropy", "swap_agreement"}
    assert 0 <= numbers["code_entropy"] <= math.log(64) + 1e-4
    assert 0 < numbers["prototype_usage"] <= 1 and 0 <= numbers["swap_agreement"] <= 1


def test_assignment_stats_of_a_batch(tiny_config: dict[str, Any]) -> None:
    model = build_model(tiny_config, CPU)
    assert isinstance(model, SwAV)
    model.swav_loss(crops())
    numbers = assignment_stats(model)
    assert 0 <= numbers["prediction_entropy"] <= math.log(64) + 1e-4


def test_needs_two_crops(tiny_config: dict[str, Any]) -> None:
    model = build_model(tiny_config, CPU)
    assert isinstance(model, SwAV)
    with pytest.raises(ValueError, match="at least 2 crops"):
        model.swav_loss(crops()[:1])
