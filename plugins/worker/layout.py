"""Where each tensor lives in a flat float32 vector: the layouts of parameters and of full state.

The parameters vector (= the gradients vector) is every trainable parameter, flattened, in
`model.named_parameters()` order. The state vector is the parameters, then the optimizer's
floating per-parameter state tensors (by optimizer parameter index, then key, sorted), then the
model's floating buffers (e.g. batch-norm statistics). Everything that is not a floating tensor
of at least one dimension (Adam's `step`, hyper-parameters, the scheduler) travels as JSON in
`meta`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SharedBufferError, WorkloadError


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "numel": self.numel, "offset": self.offset}


def pack(named: Iterable[tuple[str, Sequence[int]]], start: int = 0) -> list[Slot]:
    """Slots for tensors of the given names and shapes, one after the other from `start`."""
    slots = []
    offset = start
    for name, shape in named:
        slot = Slot(name, tuple(int(s) for s in shape), offset)
        slots.append(slot)
        offset = slot.end
    return slots


def gather(slots: Sequence[Slot], tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy each tensor into its slot of the flat `out` (any device and dtype to out's)."""
    for slot, tensor in zip(slots, tensors, strict=True):
        out[slot.offset:slot.end].copy_(tensor.detach().reshape(-1))


def scatter_views(slots: Sequence[Slot], flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of `flat`, one per slot, in each slot's shape."""
    return [flat[slot.offset:slot.end].view(slot.shape) for slot in slots]


def optimizer_state(optimizer: torch.optim.Optimizer
                    ) -> tuple[list[tuple[int, str]], list[torch.Tensor], dict[str, dict[str, Any]]]:
    """Split the optimizer's per-parameter state into vector tensors and JSON scalars.

    Returns the (parameter index, key) of each vector tensor, the tensors, and the scalars as
    `{"<index>": {key: {"value": ..., "dtype": ...} | value}}`.
    """
    keys: list[tuple[int, str]] = []
    tensors: list[torch.Tensor] = []
    scalars: dict[str, dict[str, Any]] = {}
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            value = state[index][key]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                keys.append((index, key))
                tensors.append(value)
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                scalars.setdefault(str(index), {})[key] = {
                    "value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                scalars.setdefault(str(index), {})[key] = to_json(value, f"optimizer state {key!r}")
    return keys, tensors, scalars


def rebuild_optimizer_state(entries: Sequence[tuple[int, str]], tensors: Sequence[torch.Tensor],
                            scalars: dict[str, dict[str, Any]], param_groups: list[dict[str, Any]]
                            ) -> dict[str, Any]:
    """An optimizer state_dict from the pieces that `optimizer_state` split apart."""
    state: dict[int, dict[str, Any]] = {}
    for (index, key), tensor in zip(entries, tensors, strict=True):
        state.setdefault(index, {})[key] = tensor
    for index_text, values in scalars.items():
        per_param = state.setdefault(int(index_text), {})
        for key, value in values.items():
            if isinstance(value, dict) and set(value) == {"value", "dtype"}:
                dtype = getattr(torch, str(value["dtype"]), None)
                if not isinstance(dtype, torch.dtype):
                    raise SharedBufferError(f"meta: unknown dtype {value['dtype']!r} for optimizer "
                                            f"state {key!r}")
                per_param[key] = torch.tensor(value["value"], dtype=dtype)
            else:
                per_param[key] = value
    return {"state": state, "param_groups": param_groups}


def to_json(value: Any, what: str) -> Any:
    """`value` as plain JSON (tuples as lists, 0-d tensors as numbers); WorkloadError if it can't be."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if isinstance(value, list | tuple):
        return [to_json(item, what) for item in value]
    if isinstance(value, dict):
        return {str(key): to_json(item, what) for key, item in value.items()}
    raise WorkloadError(f"{what} holds a {type(value).__name__}, which cannot be exported as JSON")


def slots_from_meta(items: Any, section: str, start: int) -> list[Slot]:
    """Validate a layout section of `meta` (a list of slot objects, contiguous from `start`)."""
    if not isinstance(items, list):
        raise SharedBufferError(f"meta.layout.{section} must be a list")
    slots = []
    offset = start
    for position, item in enumerate(items):
        where = f"meta.layout.{section}[{position}]"
        if not isinstance(item, dict):
            raise SharedBufferError(f"{where} must be an object")
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise SharedBufferError(f"{where}.shape must be a list of non-negative integers")
        slot = Slot(str(item.get("name", "")), tuple(shape), offset)
        if item.get("offset") != offset or item.get("numel") != slot.numel:
            raise SharedBufferError(f"{where} does not follow the previous slot (offset "
                                    f"{item.get('offset')!r}, numel {item.get('numel')!r}; expected "
                                    f"offset {offset}, numel {slot.numel})")
        slots.append(slot)
        offset = slot.end
    return slots
