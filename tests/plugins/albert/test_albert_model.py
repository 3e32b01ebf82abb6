"""The `albert` workload's model, optimizer, schedule and loss, called as the worker calls them."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch

from dedloc.plugins.albert import ALBERT, PRESETS
from dedloc.plugins.albert.workload import albert_config, autocast_dtype, linear_schedule, settings
from dedloc.plugins.optim import Lamb
from dedloc.plugins.worker.scheduler_position import position_scheduler

CPU = torch.device("cpu")


def test_workload_is_valid() -> None:
    assert ALBERT.problems() == []
    assert ALBERT.resolve_config()["preset"] == "albert-large"


@pytest.mark.parametrize(("preset", "low", "high"), [
    ("albert-large", 17.5e6, 18.5e6),  # DeDLOC's ALBERT-large: ~18M
    ("albert-base", 11.5e6, 12.5e6),
    ("albert-tiny", 1e5, 5e5),
])
def test_preset_parameter_counts(preset: str, low: float, high: float) -> None:
    from transformers import AlbertForPreTraining

    config = albert_config(ALBERT.resolve_config({"preset": preset}))
    model = AlbertForPreTraining(config)  # built, never run
    count = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert low < count < high
    architecture = PRESETS[preset]["model"]
    assert config.hidden_size == architecture["hidden_size"]
    assert config.num_hidden_layers == architecture["num_hidden_layers"]
    assert config.embedding_size == architecture["embedding_size"]
    assert config.num_hidden_groups == 1  # one layer, shared by all


def test_config_overrides_the_preset(tmp_path: Any) -> None:
    resolved = settings(ALBERT.resolve_config({"preset": "albert-base"}))
    assert (resolved.max_seq_length, resolved.vocab_size, resolved.lr, resolved.warmup_steps,
            resolved.total_steps) == (512, 30000, 0.00176, 5000, 125000)
    resolved = settings(ALBERT.resolve_config({
        "preset": "albert-base", "max_seq_length": 128, "vocab_size": 8000, "batch_size": 3, "lr": 0.01,
        "warmup_steps": 0, "total_steps": 10, "weight_decay": 0.0, "cache_dir": str(tmp_path)}))
    assert (resolved.max_seq_length, resolved.vocab_size, resolved.batch_size, resolved.lr,
            resolved.warmup_steps, resolved.total_steps, resolved.weight_decay
            ) == (128, 8000, 3, 0.01, 0, 10, 0.0)
    assert resolved.cache_dir == tmp_path
    assert albert_config(ALBERT.resolve_config({"max_seq_length": 1024})).max_position_embeddings == 1024
    with pytest.raises(ValueError, match="max_seq_length"):
        settings(ALBERT.resolve_config({"max_seq_length": 4}))


def test_precision() -> None:
    assert autocast_dtype("auto", CPU) is None
    assert autocast_dtype("bf16", CPU) is None
    assert autocast_dtype("off", torch.device("cuda")) is None
    assert autocast_dtype("fp16", torch.device("cuda")) is torch.float16


def test_schedule_and_its_global_step(tiny_config: dict[str, Any]) -> None:
    factor = linear_schedule(10, 110)
    assert [factor(step) for step in (0, 4, 9, 10, 60, 110, 200)] == [0.1, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    torch.manual_seed(0)
    model = ALBERT.build_model(tiny_config, CPU)
    optimizer, scheduler = ALBERT.build_optimizer(model, tiny_config)
    assert isinstance(optimizer, Lamb)
    resolved = settings(tiny_config)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [resolved.weight_decay, 0.0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(resolved.lr / resolved.warmup_steps)
    position_scheduler(scheduler, 2000)  # as the worker does for the run's global step
    expected = resolved.lr * (resolved.total_steps - 2000) / (resolved.total_steps - resolved.warmup_steps)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([expected, expected])


def test_loss_is_albert_for_pretraining_loss(tiny_config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ALBERT.build_model(tiny_config, CPU)
    model.eval()  # no dropout (the sentence-order head has some), so that two passes agree
    batch = next(ALBERT.build_data(tiny_config, 5, "train"))
    loss, batch_size = ALBERT.loss(model, batch, CPU)
    assert batch_size == 16
    assert float(loss.detach()) == pytest.approx(float(model(**batch).loss.detach()), rel=1e-5)
    with torch.no_grad():
        metrics = ALBERT.metrics(model, batch, CPU)
    assert set(metrics) == {"mlm_accuracy", "sop_accuracy", "mlm_loss", "sop_loss"}
    assert metrics["mlm_loss"] + metrics["sop_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    # The same initial weights on every peer (the worker seeds torch before build_model).
    torch.manual_seed(0)
    twin = ALBERT.build_model(tiny_config, CPU)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_batch_without_masked_tokens_has_no_nan(tiny_config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ALBERT.build_model(tiny_config, CPU)
    batch = next(ALBERT.build_data(tiny_config, 5, "train"))
    batch["labels"] = torch.full_like(batch["labels"], -100)
    loss, _ = ALBERT.loss(model, batch, CPU)
    loss.backward()
    assert torch.isfinite(loss)


def test_loss_falls_over_40_steps(tiny_config: dict[str, Any]) -> None:
    """Train albert-tiny as the worker does: sum of loss × batch size, mean gradient, LAMB, schedule.

    The first steps sit at ln(vocab) + ln(2) ≈ 9.0; within 40 steps the MLM loss reaches the
    corpus's unigram level (≈ 6.5 nats), so a drop of more than one nat is a clear fall.
    """
    config = {**tiny_config, "warmup_steps": 5}
    torch.manual_seed(0)
    model = ALBERT.build_model(config, CPU)
    optimizer, scheduler = ALBERT.build_optimizer(model, config)
    data = ALBERT.build_data(config, 1, "train")
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead (and noise on a busy CPU)
    try:
        for _ in range(40):
            loss, batch_size = ALBERT.loss(model, next(data), CPU)
            (loss * batch_size).backward()
            for param in model.parameters():
                param.grad /= batch_size
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert first == pytest.approx(9.0, abs=0.2)
    assert last < first - 1.0, losses
    assert last < 0.88 * first, losses
