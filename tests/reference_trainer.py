"""One trainer, in this process, that takes the optimizer steps a collaborative run should have taken.

Given each peer's data seed and how many samples each peer contributed to each epoch (both from
`run.status`: `data_seed` and `epoch_history`), it replays the same samples as one batch per epoch
with the `tiny` workload's own model, optimizer and data: the parameters a single trainer with
batch B on the same samples would reach.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dedloc.plugins.tiny.workload import TINY


def full_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return TINY.resolve_config(dict(config))


def samples_by_epoch(status: dict[str, Any]) -> dict[int, int]:
    """A trainer's samples in each epoch it stepped (its `epoch_history`)."""
    return {entry["epoch"]: entry["samples"] for entry in status["epoch_history"] if entry["stepped"]}


def replay(config: Mapping[str, Any], init_seed: int, peers: list[tuple[int, dict[int, int]]],
           epochs: int) -> dict[str, torch.Tensor]:
    """The parameters after `epochs` steps, each over the samples `peers` (data seed, samples per
    epoch) contributed to that epoch, taken in whole batches from each peer's own data stream."""
    config = full_config(config)
    device = torch.device("cpu")
    torch.manual_seed(init_seed)
    model = TINY.build_model(config, device)
    optimizer, scheduler = TINY.build_optimizer(model, config)
    streams: list[Iterator[Any]] = [iter(TINY.build_data(config, seed, "train")) for seed, _ in peers]
    params = [p for p in model.parameters() if p.requires_grad]
    for epoch in range(epochs):
        grad_sum = [torch.zeros_like(p) for p in params]
        total = 0
        for stream, (_, by_epoch) in zip(streams, peers, strict=True):
            wanted, done = by_epoch.get(epoch, 0), 0
            while done < wanted:
                for p in params:
                    p.grad = None
                loss, batch_size = TINY.loss(model, next(stream), device)
                (loss * batch_size).backward()
                for acc, p in zip(grad_sum, params, strict=True):
                    acc.add_(p.grad)
                done += batch_size
            assert done == wanted, f"epoch {epoch}: {wanted} samples is not whole batches"
            total += done
        assert total > 0, f"nobody contributed to epoch {epoch}"
        for acc, p in zip(grad_sum, params, strict=True):
            p.grad = acc / total
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def replay_local(config: Mapping[str, Any], init_seed: int, peers: list[tuple[int, dict[int, int]]],
                 epochs: int, inner_lr_scale: float | str = 1.0,
                 target_batch_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """A local-update run (sync "local") with a stateless inner optimizer (SGD without momentum
    or schedule), outer lr 1 and no outer momentum: each outer step is the mean of the peers'
    local parameters weighted by their samples, each peer having taken one inner step per batch
    of its own data from the outer parameters, at the config's lr times `inner_lr_scale` (the
    manifest's: a number, or "auto": the batch's size over `target_batch_size`). The outer
    parameters after each of `epochs` outer steps (index e: after e steps, e = 0..epochs)."""
    config = full_config(config)
    assert config["optimizer"] == "sgd" and config["momentum"] == 0 and config["warmup_steps"] == 0, \
        "the replay assumes a stateless inner optimizer"
    device = torch.device("cpu")
    torch.manual_seed(init_seed)
    model = TINY.build_model(config, device)
    optimizer, _ = TINY.build_optimizer(model, config)
    assert inner_lr_scale != "auto" or target_batch_size is not None, "auto needs the target"
    streams: list[Iterator[Any]] = [iter(TINY.build_data(config, seed, "train")) for seed, _ in peers]
    params = [p for p in model.parameters() if p.requires_grad]

    def snapshot() -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    outers = [snapshot()]
    for epoch in range(epochs):
        outer = [p.detach().clone() for p in params]
        weighted = [torch.zeros_like(p) for p in params]
        total = 0
        for stream, (_, by_epoch) in zip(streams, peers, strict=True):
            wanted, done = by_epoch.get(epoch, 0), 0
            with torch.no_grad():
                for p, value in zip(params, outer, strict=True):
                    p.copy_(value)
            while done < wanted:
                optimizer.zero_grad(set_to_none=True)
                loss, batch_size = TINY.loss(model, next(stream), device)
                loss.backward()  # an inner step: the batch's mean gradient
                scale = batch_size / target_batch_size if inner_lr_scale == "auto" \
                    else float(inner_lr_scale)  # type: ignore[operator]
                for group in optimizer.param_groups:
                    group["lr"] = config["lr"] * scale
                optimizer.step()
                done += batch_size
            assert done == wanted, f"epoch {epoch}: {wanted} samples is not whole batches"
            for acc, p in zip(weighted, params, strict=True):
                acc.add_(p.detach(), alpha=done)
            total += done
        assert total > 0, f"nobody contributed to outer step {epoch}"
        with torch.no_grad():
            for p, acc in zip(params, weighted, strict=True):
                p.copy_(acc / total)
        outers.append(snapshot())
    return outers
