"""A worker's full state as one flat float32 vector and its meta: `export("state")` and `apply("state")`.

The full state is what a peer that joins a run downloads: the parameters, the optimizer's state
tensors and the model's floating buffers in one vector (the order and the slots: layout.py), and in
`meta` the step, the layout, the optimizer's scalars and param_groups and the scheduler's state. A
local-update run's state holds its outer parameters in the parameters' slots (never the drifted
local ones), its outer momentum after everything else (the `OUTER_MOMENTUM` slot) and the outer
step's guard norm in `meta.outer.step_norm` (outer.py). Checkpoints hold the same things in a file
(checkpoint.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SharedBufferError
from . import buffers
from .layout import (
    Slot,
    optimizer_state,
    pack,
    rebuild_optimizer_state,
    scatter_views,
    slots_from_meta,
    to_json,
)

if TYPE_CHECKING:
    from .session import Session

OUTER_MOMENTUM = "outer.momentum"  # the slot of a local-update run's state after everything else


def state_pieces(session: Session) -> tuple[list[Slot], list[torch.Tensor], dict[str, Any]]:
    """The slots of `session`'s full state, the tensors that fill them (in order) and its meta."""
    keys, opt_tensors, scalars = optimizer_state(session.optimizer)
    model_buffers = session._float_buffers()
    param_slots = session.slots
    opt_slots = pack(((f"{index}:{key}", t.shape) for (index, key), t in zip(keys, opt_tensors,
                                                                            strict=True)),
                     param_slots[-1].end)
    buffer_slots = pack(((name, b.shape) for name, b in model_buffers),
                        (opt_slots or param_slots)[-1].end)
    slots = [*param_slots, *opt_slots, *buffer_slots]
    # a local-update run's state is its outer parameters (never the drifted local ones) and
    # the outer momentum, after everything else
    outer = session.outer
    outer_slots = [] if outer is None else pack([(OUTER_MOMENTUM, (outer.numel,))],
                                                slots[-1].end)
    slots += outer_slots
    groups = session.optimizer.state_dict()["param_groups"]
    meta = {
        "workload": session.workload.name,
        "step": session.step,
        "numel": slots[-1].end,
        "layout": {
            "parameters": [s.to_json() for s in param_slots],
            "optimizer": [{**s.to_json(), "param": index, "key": key}
                          for s, (index, key) in zip(opt_slots, keys, strict=True)],
            "buffers": [s.to_json() for s in buffer_slots],
            **({} if outer is None else {"outer": [s.to_json() for s in outer_slots]}),
        },
        **({} if outer is None else {"outer": {"step_norm": outer.step_norm}}),
        "optimizer": {"param_groups": to_json(groups, "optimizer param_groups"),
                      "scalars": scalars},
        "scheduler": (None if session.scheduler is None
                      else to_json(session.scheduler.state_dict(), "scheduler state")),
    }
    params = [p.detach() for p in session.params] if outer is None \
        else scatter_views(param_slots, outer.params)
    extra = [] if outer is None else [outer.momentum]
    return slots, [*params, *opt_tensors, *(b for _, b in model_buffers), *extra], meta


def apply_state(session: Session, buffer: str, numel: int, meta: dict[str, Any]) -> dict[str, Any]:
    """Load the full state in shared-memory `buffer` into `session`, after checking `meta` (as
    `state_pieces` made it) against its model; SharedBufferError if it does not fit."""
    layout = meta.get("layout")
    if not isinstance(layout, dict):
        raise SharedBufferError("applying state needs the meta that worker.export returned with it "
                                "(meta.layout is missing)")
    param_slots = slots_from_meta(layout.get("parameters"), "parameters", 0)
    if [(s.name, s.shape) for s in param_slots] != [(s.name, s.shape) for s in session.slots]:
        raise SharedBufferError("meta.layout.parameters does not match this model's parameters "
                                "(names or shapes differ)")
    opt_items = layout.get("optimizer")
    opt_slots = slots_from_meta(opt_items, "optimizer", param_slots[-1].end)
    buffer_slots = slots_from_meta(layout.get("buffers"), "buffers", (opt_slots or param_slots)[-1].end)
    model_buffers = session._float_buffers()
    if [(s.name, s.shape) for s in buffer_slots] != [(n, tuple(b.shape)) for n, b in model_buffers]:
        raise SharedBufferError("meta.layout.buffers does not match this model's buffers")
    total = (buffer_slots or opt_slots or param_slots)[-1].end
    outer_slots: list[Slot] = []
    if session.outer is not None or "outer" in layout:
        if session.outer is None:
            raise SharedBufferError("this state is of a local-update run (meta.layout.outer); "
                                    "this worker trains a gradients run")
        outer_slots = slots_from_meta(layout.get("outer"), "outer", total)
        if [(s.name, s.shape) for s in outer_slots] != [(OUTER_MOMENTUM, (session.total_numel,))]:
            raise SharedBufferError("a local-update run's state needs meta.layout.outer: one "
                                    f"{OUTER_MOMENTUM!r} slot of {session.total_numel} elements")
        total = outer_slots[-1].end
        outer_meta = meta.get("outer")
        if outer_meta is not None and not isinstance(outer_meta, dict):
            raise SharedBufferError("meta.outer must be an object")
        step_norm = read_step_norm(None if outer_meta is None else outer_meta.get("step_norm"))
    if numel != total or meta.get("numel", total) != total:
        raise SharedBufferError(f"the state layout in meta holds {total} float32 elements, got "
                                f"numel={numel}", {"buffer": buffer, "needed": total, "given": numel})
    entries = []
    for item in opt_items:
        if not isinstance(item.get("param"), int) or not isinstance(item.get("key"), str):
            raise SharedBufferError("every meta.layout.optimizer item needs an int 'param' and a "
                                    "str 'key'")
        entries.append((item["param"], item["key"]))
    opt_meta = meta.get("optimizer")
    if not isinstance(opt_meta, dict) or not isinstance(opt_meta.get("param_groups"), list):
        raise SharedBufferError("meta.optimizer.param_groups is missing")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise SharedBufferError(f"meta.step must be a non-negative integer, not {step!r}")
    with buffers.attach(buffer, numel) as view:
        buffers.check_finite(view, buffer, "state")
        copied = view.clone()
        del view
    params_in = scatter_views(param_slots, copied)
    opt_state = rebuild_optimizer_state(entries, scatter_views(opt_slots, copied),
                                        dict(opt_meta.get("scalars") or {}), opt_meta["param_groups"])
    try:
        session.optimizer.load_state_dict(opt_state)
        if session.scheduler is not None and meta.get("scheduler") is not None:
            session.scheduler.load_state_dict(meta["scheduler"])
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise SharedBufferError(f"the optimizer state in meta does not fit this optimizer: {exc}",
                                {"buffer": buffer}) from exc
    with torch.no_grad():
        for param, value in zip(session.params, params_in, strict=True):
            param.copy_(value)
        for (_, model_buffer), value in zip(model_buffers, scatter_views(buffer_slots, copied),
                                            strict=True):
            model_buffer.copy_(value)
    if session.outer is not None:  # the state's parameters are the outer ones
        session.outer.take(session.params)
        session.outer.load(session.outer.params, scatter_views(outer_slots, copied)[0])
        session.outer.step_norm = step_norm
    session.step = step
    session.zero_grad()
    session.state_numel = session._count_state_numel()
    return {"step": session.step}


def read_step_norm(value: Any) -> float | None:
    """A state's or checkpoint's outer-step norm (outer.py's guard): null or a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0:
        raise SharedBufferError(f"meta.outer.step_norm must be null or a finite number >= 0, not "
                                f"{value!r:.40}")
    return float(value)
