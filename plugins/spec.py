"""What a workload is: the typed description a plugin hands to the worker.

A `Workload` bundles a config schema (`ConfigField`s) with the functions that build its model,
optimizer and data and compute its loss. The worker owns everything else: seeding, devices,
gradient accumulation, flattening tensors into shared buffers, checkpoints. This module holds no
torch state; it imports torch only for type hints.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .errors import WorkloadConfigError

if TYPE_CHECKING:
    import torch

WORKLOAD_API_VERSION = 1
"""The version of the `Workload` interface this dedloc implements; bumped on incompatible change."""

SUPPORTED_API_VERSIONS = frozenset({1})

WORKLOAD_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
CONFIG_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

Split = Literal["train", "eval"]
Batch = Any

_JSON_TYPES: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}


@dataclass(frozen=True)
class ConfigField:
    """One key of a workload's config: its type, default and optional bounds or choices."""

    type: type
    default: Any
    description: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] | None = None

    def json_schema(self) -> dict[str, Any]:
        """This field as a JSON Schema (type, default, description and bounds)."""
        schema: dict[str, Any] = {
            "type": _JSON_TYPES.get(self.type, "null"),
            "default": self.default,
            "description": self.description,
        }
        if self.minimum is not None:
            schema["minimum"] = self.minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        if self.choices is not None:
            schema["enum"] = list(self.choices)
        return schema

    def check(self, key: str, value: Any) -> Any:
        """Return `value` converted to this field's type; raise WorkloadConfigError naming `key`."""
        if self.type is bool:
            if not isinstance(value, bool):
                raise WorkloadConfigError(key, f"expected a boolean, got {_kind(value)}")
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise WorkloadConfigError(key, f"expected an integer, got {_kind(value)}")
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise WorkloadConfigError(key, f"expected a number, got {_kind(value)}")
            value = float(value)
            if not math.isfinite(value):
                raise WorkloadConfigError(key, f"expected a finite number, got {value}")
        elif self.type is str and not isinstance(value, str):
            raise WorkloadConfigError(key, f"expected a string, got {_kind(value)}")
        if self.minimum is not None and value < self.minimum:
            raise WorkloadConfigError(key, f"{value!r} is below the minimum {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise WorkloadConfigError(key, f"{value!r} is above the maximum {self.maximum}")
        if self.choices is not None and value not in self.choices:
            raise WorkloadConfigError(key, f"{value!r} is not one of {list(self.choices)}")
        return value

    def problems(self) -> list[str]:
        """What is wrong with this field's own definition (empty when it is valid)."""
        if self.type not in _JSON_TYPES:
            return [f"type must be one of int, float, str, bool, not {self.type!r}"]
        found = []
        if not isinstance(self.description, str):
            found.append("description must be a string")
        if self.type in (str, bool) and (self.minimum is not None or self.maximum is not None):
            found.append("minimum/maximum only apply to int and float fields")
        if self.choices is not None:
            for choice in self.choices:
                try:
                    self.check("choice", choice)
                except WorkloadConfigError as exc:
                    found.append(f"choice {choice!r}: {exc.reason}")
        try:
            self.check("default", self.default)
        except WorkloadConfigError as exc:
            found.append(f"default {self.default!r}: {exc.reason}")
        return found


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A trainable task that a plugin offers: a model, its optimizer, its data and its loss.

    The worker calls, in this order: `resolve_config(user_config)`; seeds torch with the run's
    `init_seed` and calls `build_model(config, device)` (same initial weights on every peer);
    `build_optimizer(model, config)`; `build_data(config, seed, "train")` (an endless iterator of
    batches; `seed` differs per peer). Each step it calls `loss(model, batch, device)`, which must
    return the mean loss over the batch (a scalar tensor) and the batch size. `metrics`, when
    given, returns means over one batch of extra evaluation numbers (e.g. accuracy).
    `task_fingerprint`, when given, returns a short string naming what the config does not pin but
    every peer of a run must share (albert: the tokenizer's vocabulary); the daemon puts it in the
    run's manifest and refuses a peer whose own differs.
    """

    name: str
    description: str
    version: str
    config: Mapping[str, ConfigField]
    build_model: Callable[[dict[str, Any], torch.device], torch.nn.Module]
    build_optimizer: Callable[
        [torch.nn.Module, dict[str, Any]],
        tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None],
    ]
    build_data: Callable[[dict[str, Any], int, Split], Iterator[Batch]]
    loss: Callable[[torch.nn.Module, Batch, torch.device], tuple[torch.Tensor, int]]
    metrics: Callable[[torch.nn.Module, Batch, torch.device], Mapping[str, float]] | None = None
    task_fingerprint: Callable[[dict[str, Any]], str] | None = None
    api_version: int = WORKLOAD_API_VERSION

    def config_schema(self) -> dict[str, Any]:
        """The config as a JSON Schema object: every key with its type, default and bounds."""
        return {
            "type": "object",
            "properties": {key: spec.json_schema() for key, spec in self.config.items()},
            "additionalProperties": False,
        }

    def resolve_config(self, user: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The full config: `user`'s values checked, defaults for the rest.

        Raises WorkloadConfigError naming the first unknown key or wrong value.
        """
        user = dict(user or {})
        for key in user:
            if key not in self.config:
                known = ", ".join(sorted(self.config)) or "none"
                raise WorkloadConfigError(str(key), f"unknown key for workload {self.name!r} "
                                                    f"(known keys: {known})")
        return {key: spec.check(key, user[key]) if key in user else spec.default
                for key, spec in self.config.items()}

    def problems(self) -> list[str]:
        """What is wrong with this workload's definition (empty when it is valid)."""
        found = []
        if self.api_version not in SUPPORTED_API_VERSIONS:
            found.append(f"api_version {self.api_version!r} is not supported (this dedloc supports "
                         f"{sorted(SUPPORTED_API_VERSIONS)})")
        if not isinstance(self.name, str) or not WORKLOAD_NAME.match(self.name):
            found.append(f"name {self.name!r} must match {WORKLOAD_NAME.pattern}")
        for attr in ("description", "version"):
            if not isinstance(getattr(self, attr), str):
                found.append(f"{attr} must be a string")
        for attr in ("build_model", "build_optimizer", "build_data", "loss"):
            if not callable(getattr(self, attr)):
                found.append(f"{attr} must be callable")
        if self.metrics is not None and not callable(self.metrics):
            found.append("metrics must be callable or None")
        if self.task_fingerprint is not None and not callable(self.task_fingerprint):
            found.append("task_fingerprint must be callable or None")
        if not isinstance(self.config, Mapping):
            return [*found, "config must be a mapping of key to ConfigField"]
        for key, spec in self.config.items():
            if not isinstance(key, str) or not CONFIG_KEY.match(key):
                found.append(f"config key {key!r} must match {CONFIG_KEY.pattern}")
            elif not isinstance(spec, ConfigField):
                found.append(f"config key {key!r} is a {type(spec).__name__}, not a ConfigField")
            else:
                found.extend(f"config key {key!r}: {problem}" for problem in spec.problems())
        return found


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return f"{names.get(type(value), type(value).__name__)} ({value!r:.40})"
