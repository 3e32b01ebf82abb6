"""The worker protocol (version 1): the `worker.*` methods a daemon calls on its worker, and the
shapes of their answers. Torch-free: the daemon (which drives workers) and plugins/worker (which
serves them) both import it, so that a method name or a field is spelled in one place.
docs/worker-protocol.md is the reference.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "INNER_LR_SCALE_AUTO",
    "MAX_INNER_LR_SCALE",
    "MIN_DUTY_CYCLE",
    "MIN_INNER_LR_SCALE",
    "PROTOCOL_VERSION",
    "ApplyResult",
    "CheckpointSaveResult",
    "DescribeResult",
    "EvaluateResult",
    "ExportResult",
    "HelloResult",
    "ParameterSlot",
    "RankResult",
    "StepResult",
    "TrainResult",
    "Vector",
    "WorkerMethod",
    "ZeroGradResult",
]

PROTOCOL_VERSION = 1

#: A local-update run's `sync.inner_lr_scale`: "auto" (the batch's size over the run's target
#: batch size) or a number in these bounds; the manifest and the worker check the same ones.
INNER_LR_SCALE_AUTO = "auto"
MIN_INNER_LR_SCALE = 1e-4
MAX_INNER_LR_SCALE = 10.0

#: The least share of the time a worker may compute (`workers.duty_cycle`, the worker's
#: `--duty-cycle`): a rest of at most 19 times the batch; the daemon and the worker check it.
MIN_DUTY_CYCLE = 0.05

#: Which vector an export or apply moves: the mean accumulated gradients, the parameters, the
#: full state (parameters, optimizer state, buffers), or a local-update run's error-feedback
#: residual (what a lossy codec did not convey yet; added to the next exported pseudo-gradient).
Vector = Literal["gradients", "parameters", "state", "residual"]


class WorkerMethod(StrEnum):
    HELLO = "worker.hello"
    LOAD = "worker.load"
    DESCRIBE = "worker.describe"
    TRAIN = "worker.train"
    EXPORT = "worker.export"
    APPLY = "worker.apply"
    ZERO_GRAD = "worker.zero_grad"
    CHECKPOINT_SAVE = "worker.checkpoint_save"
    CHECKPOINT_LOAD = "worker.checkpoint_load"
    EVALUATE = "worker.evaluate"
    STOP = "worker.stop"


class HelloResult(TypedDict):
    protocol: int
    implementation: str
    version: str
    pid: int


class ParameterSlot(TypedDict):
    name: str
    shape: list[int]
    numel: int
    offset: int


class DescribeResult(TypedDict):
    workload: str
    config: dict[str, Any]
    device: str
    devices: list[str]
    task_fingerprint: str | None
    parameters: list[ParameterSlot]
    total_numel: int
    state_numel: int
    accumulated_samples: int
    step: int
    samples_per_second: float | None
    running: str | None
    # how the run syncs: {"mode": "gradients"} or the local-update settings (worker.load's sync)
    sync: NotRequired[dict[str, Any]]
    inner_step: NotRequired[int]  # a local-update run: inner steps since the last outer step


class RankResult(TypedDict):
    device: str
    samples: int
    seconds: float
    rested_seconds: NotRequired[float]  # below a duty cycle of 1 (the worker's --duty-cycle)


class TrainResult(TypedDict):
    samples: int
    loss: float
    seconds: float
    samples_per_second: float | None
    accumulated_samples: int
    skipped_batches: NotRequired[int]  # batches skipped for a NaN or Inf, over all calls
    rested_seconds: NotRequired[float]  # how long this call rested (the worker's --duty-cycle)
    ranks: NotRequired[list[RankResult]]
    inner_step: NotRequired[int]  # a local-update run: inner steps since the last outer step
    # a local-update run: the last inner step's learning rate (the schedule's x inner_lr_scale;
    # null if the optimizer's first group has no numeric lr)
    inner_lr: NotRequired[float | None]


class ExportResult(TypedDict):
    numel: int
    dtype: Literal["float32"]
    meta: dict[str, Any]


class ApplyResult(TypedDict, total=False):
    step: int
    lr: float


class ZeroGradResult(TypedDict):
    accumulated_samples: int


class CheckpointSaveResult(TypedDict):
    path: str
    bytes: int
    step: int


class StepResult(TypedDict):
    step: int


class EvaluateResult(TypedDict):
    loss: float
    samples: int
    metrics: dict[str, float]
