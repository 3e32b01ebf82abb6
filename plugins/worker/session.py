"""One loaded workload: its model, optimizer, data and gradient accumulator (blocking torch code).

Every method here blocks; the JSON-RPC service runs them in a thread, one at a time. Gradients
accumulate in a flat float32 vector as the sum over samples (each batch adds its mean gradient
times its batch size), so that `export("gradients")` can hand out the mean gradient per sample.

In a local-update run (`sync` mode "local", outer.py) the workload's optimizer steps on every
batch instead; `export("gradients")` hands out the pseudo-gradient (outer minus local
parameters), `apply("gradients")` takes one outer step with the averaged one and puts the model
back on the new outer parameters, and `zero_grad` drops the inner steps taken since the last one.
Each inner step runs at the workload's learning rate times the run's `inner_lr_scale`, applied
for that step only (learning_rate.py's `scaled_lr`; outer.py says why).

The full state's vector and meta are built and loaded in state.py, a checkpoint's contents in
checkpoint.py, and the learning-rate schedule is put at the run's global step by
scheduler_position.py.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import structlog
import torch

from ..catalog import CatalogEntry
from ..errors import PluginError, SharedBufferError, WorkloadError
from . import buffers, checkpoint
from .layout import gather, optimizer_state, pack, scatter_views
from .learning_rate import check_scalable, scaled_lr
from .outer import LocalUpdates, OuterState, cpu_norm
from .scheduler_position import position_scheduler, scheduler_start
from .state import apply_state, state_pieces

log = structlog.get_logger(__name__)

Kind = Literal["gradients", "parameters", "state", "residual"]
MAX_TASK_FINGERPRINT = 128
# batches in a row whose loss or gradients are NaN or Inf before training fails: one such batch
# (an fp16 overflow, a bad sample) is skipped; this many means the model itself has diverged
MAX_NONFINITE_STREAK = 8


class Session:
    """A workload built and ready to train on one device."""

    def __init__(self, entry: CatalogEntry, config: dict[str, Any], seed: int, init_seed: int,
                 device: torch.device, local: LocalUpdates | None = None) -> None:
        self.workload = entry.workload
        self.plugin = entry.plugin
        self.config = config
        self.seed = seed
        self.device = device
        torch.manual_seed(init_seed)
        with self._guard("build_model"):
            self.model = self.workload.build_model(config, device)
        if not isinstance(self.model, torch.nn.Module):
            raise WorkloadError(f"workload {self.workload.name!r}: build_model returned a "
                                f"{type(self.model).__name__}, not a torch.nn.Module")
        with self._guard("build_optimizer"):
            self.optimizer, self.scheduler = self.workload.build_optimizer(self.model, config)
        # The schedule's start, to rewind a scheduler without a closed form (see position_scheduler).
        self._scheduler_start = scheduler_start(self.optimizer, self.scheduler)
        torch.manual_seed(seed)  # dropout and the like differ per peer; the weights do not
        with self._guard("build_data"):
            self._train_data: Iterator[Any] = iter(self.workload.build_data(config, seed, "train"))
        self.task_fingerprint: str | None = None
        if self.workload.task_fingerprint is not None:
            with self._guard("task_fingerprint"):
                fingerprint = self.workload.task_fingerprint(config)
            if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= MAX_TASK_FINGERPRINT:
                raise WorkloadError(f"workload {self.workload.name!r}: task_fingerprint returned "
                                    f"{fingerprint!r:.80}, not a string of 1 to {MAX_TASK_FINGERPRINT} "
                                    "characters")
            self.task_fingerprint = fingerprint
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        if not named:
            raise WorkloadError(f"workload {self.workload.name!r}: the model has no trainable parameters")
        self.params = [p for _, p in named]
        self.slots = pack((name, p.shape) for name, p in named)
        self.total_numel = self.slots[-1].end
        # (a local-update run steps on every batch: it accumulates no gradients)
        self._grad_sum = torch.zeros(self.total_numel if local is None else 0, dtype=torch.float32,
                                     device=device)
        self.accumulated_samples = 0
        self.step = 0
        self.skipped_batches = 0  # batches skipped for a NaN or Inf loss or gradients (all calls)
        self._nonfinite_streak = 0
        self.samples_per_second: float | None = None
        self._rest_until = float("-inf")  # (perf_counter) a duty cycle's rest owed until then
        # a local-update run: the outer parameters and momentum, and the inner steps taken since
        # the last outer step
        self.local = local
        self.outer = None if local is None else OuterState(local, self.slots, self.params, device)
        self.inner_step = 0
        self.inner_lr: float | None = None  # a local-update run: the last inner step's (scaled) rate
        if local is not None and local.inner_lr_scale != 1.0:
            check_scalable(self.optimizer, self.workload.name)
        # Counted when the optimizer state changes, so that describe never reads it mid-step.
        self.state_numel = self._count_state_numel()

    @contextlib.contextmanager
    def _guard(self, stage: str) -> Iterator[None]:
        """Turn an exception of the workload's own code into a WorkloadError naming the stage."""
        try:
            yield
        except PluginError:
            raise
        except Exception as exc:
            log.exception("workload_failed", workload=self.workload.name, stage=stage)
            raise WorkloadError(
                f"workload {self.workload.name!r} failed in {stage}: {type(exc).__name__}: {exc}",
                {"workload": self.workload.name, "stage": stage,
                 "error": f"{type(exc).__name__}: {exc}"}) from exc

    # --- describe -------------------------------------------------------------------------------

    def _count_state_numel(self) -> int:
        _, tensors, _ = optimizer_state(self.optimizer)
        return (self.total_numel + sum(t.numel() for t in tensors)
                + sum(b.numel() for _, b in self._float_buffers())
                + (0 if self.outer is None else self.outer.numel))  # the outer momentum

    def describe(self) -> dict[str, Any]:
        return {
            "workload": self.workload.name,
            "config": self.config,
            "device": str(self.device),
            "devices": [str(self.device)],
            "task_fingerprint": self.task_fingerprint,
            "parameters": [slot.to_json() for slot in self.slots],
            "total_numel": self.total_numel,
            "state_numel": self.state_numel,
            "accumulated_samples": self.accumulated_samples,
            "step": self.step,
            "samples_per_second": self.samples_per_second,
            "sync": {"mode": "gradients"} if self.local is None else self.local.to_json(),
            "inner_step": self.inner_step,
        }

    # --- training -------------------------------------------------------------------------------

    def _skip_nonfinite(self, what: str, done: int, **data: Any) -> None:
        """Skip a batch whose loss or gradients are not finite (its gradients are discarded and
        nothing steps); WorkloadError once MAX_NONFINITE_STREAK batches in a row were."""
        for param in self.params:
            param.grad = None
        self.skipped_batches += 1
        self._nonfinite_streak += 1
        log.warning("nonfinite_batch_skipped", workload=self.workload.name, reason=what,
                    in_a_row=self._nonfinite_streak)
        if self._nonfinite_streak >= MAX_NONFINITE_STREAK:
            self._nonfinite_streak = 0
            raise WorkloadError(
                f"workload {self.workload.name!r}: {MAX_NONFINITE_STREAK} batches in a row gave a "
                f"NaN or Inf loss or gradients (the last: {what}); their gradients were discarded. "
                "The model has diverged: lower the learning rate (or a local-update run's "
                "outer_lr), or resume from an earlier checkpoint",
                {"workload": self.workload.name, "samples": done,
                 "skipped_batches": self.skipped_batches,
                 "accumulated_samples": self.accumulated_samples, **data})

    def train(self, samples: int, max_seconds: float | None, cancel: threading.Event,
              duty_cycle: float = 1.0) -> dict[str, Any]:
        """Run whole batches until `samples` are done (or time is up, or cancelled; one at least,
        unless it was skipped for a NaN or Inf, or the call rested all its time: then `samples`
        is 0 and so is `loss`).
        `duty_cycle` below 1: each batch (skipped ones too) is owed a rest (1 / duty_cycle - 1)
        times as long as it took, so that the worker computes that share of the time. A rest
        waits on `cancel` (a cancelled call ends at once) and within `max_seconds`; what a call
        had no time for is rested at the start of the next (the daemon asks for half a second
        at a time, less than a CPU batch takes), before its first batch. The speed reported is
        the one the duty cycle sustains."""
        start = time.perf_counter()
        done = 0
        loss_sum = 0.0
        batches = 0
        computing = 0.0  # seconds of the counted batches
        rested = 0.0
        self.model.train()
        rest_factor = 1.0 / duty_cycle - 1.0
        if rest_factor <= 0:
            self._rest_until = float("-inf")

        def over() -> bool:
            return cancel.is_set() or (max_seconds is not None
                                       and time.perf_counter() - start >= max_seconds)

        def rest() -> None:
            nonlocal rested
            now = time.perf_counter()
            owed = self._rest_until - now
            allowed = owed if max_seconds is None else min(owed, start + max_seconds - now)
            if allowed <= 0 or cancel.is_set():
                return
            cancelled = cancel.wait(allowed)
            rested += time.perf_counter() - now
            if not cancelled and allowed >= owed:
                self._rest_until = float("-inf")  # (paid in full, however the clock rounds)

        def owe(since: float) -> None:
            if rest_factor > 0:
                now = time.perf_counter()
                self._rest_until = now + (now - since) * rest_factor
                rest()

        rest()  # (what the last call had no time for)
        while time.perf_counter() >= self._rest_until and not (rested and over()):
            batch_start = time.perf_counter()
            with self._guard("build_data"):
                batch = next(self._train_data)
            for param in self.params:
                param.grad = None
            with self._guard("loss"):
                loss, batch_size = self.workload.loss(self.model, batch, self.device)
                value = float(loss.detach())
            if not math.isfinite(value):
                self._skip_nonfinite(f"the loss of a batch is {value}", done, loss=str(value))
                owe(batch_start)
                if over():
                    break
                continue
            if not isinstance(batch_size, int) or batch_size < 1:
                raise WorkloadError(f"workload {self.workload.name!r}: loss() returned batch size "
                                    f"{batch_size!r}, not a positive int")
            with self._guard("backward"):  # an inner step takes the batch's mean gradient
                (loss * batch_size if self.outer is None else loss).backward()
            grads = torch.cat([torch.zeros(p.numel(), device=self.device) if p.grad is None
                               else p.grad.reshape(-1).float() for p in self.params])
            if not bool(torch.isfinite(grads).all()):
                self._skip_nonfinite("a batch gave NaN or Inf gradients", done)
                owe(batch_start)
                if over():
                    break
                continue
            self._nonfinite_streak = 0
            if self.outer is None:
                self._grad_sum.add_(grads)
            else:  # a local-update run: an inner step on every batch
                self._inner_step(batch_size)
            self.accumulated_samples += batch_size
            done += batch_size
            loss_sum += value * batch_size
            batches += 1
            computing += time.perf_counter() - batch_start
            owe(batch_start)
            if done >= samples or over():
                break
        for param in self.params:
            param.grad = None
        seconds = time.perf_counter() - start
        if rest_factor > 0:  # what the duty cycle sustains, whatever this call rested
            rate = done * duty_cycle / computing if computing > 0 and done else None
        else:
            rate = done / seconds if seconds > 0 and done else None
        if rate is not None:
            self.samples_per_second = rate
        result = {"samples": done, "loss": loss_sum / done if done else 0.0, "seconds": seconds,
                  "samples_per_second": rate, "accumulated_samples": self.accumulated_samples,
                  "skipped_batches": self.skipped_batches, "rested_seconds": rested}
        if self.outer is not None:
            result["inner_step"] = self.inner_step
            result["inner_lr"] = self.inner_lr
        return result

    def _local_only(self, what: str) -> None:
        if self.outer is None:
            raise SharedBufferError(f"{what!r} is a vector of local-update runs (worker.load sync "
                                    "mode \"local\"); this worker trains a gradients run")

    def _inner_step(self, batch_size: int) -> None:
        """The workload's optimizer steps, at its learning rate times the run's inner_lr_scale
        for a batch of `batch_size`; its schedule does not step (`_position_inner_schedule`)."""
        assert self.local is not None
        scale = self.local.lr_scale(batch_size)
        with scaled_lr(self.optimizer, scale) as lr, self._guard("optimizer.step"):
            self.inner_lr = lr
            self.optimizer.step()
        self.inner_step += 1

    def zero_grad(self) -> None:
        """Drop what was accumulated: the gradients, or in a local-update run the inner steps
        since the last outer step (the model goes back to the outer parameters)."""
        self._grad_sum.zero_()
        self.accumulated_samples = 0
        if self.outer is not None:
            self.outer.restore(self.params)
            self.outer.forget()
            self.inner_step = 0

    def close(self) -> None:
        """Release what the session holds beyond memory (nothing here; replicas in a subclass)."""

    def evaluate(self, samples: int) -> dict[str, Any]:
        """Mean loss and metrics over the first `samples` (whole batches) of the eval split."""
        with self._guard("build_data"):
            data = iter(self.workload.build_data(self.config, self.seed, "eval"))
        done = 0
        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        self.model.eval()
        try:
            with torch.no_grad():
                while done < samples:
                    with self._guard("evaluate"):
                        batch = next(data)
                        loss, batch_size = self.workload.loss(self.model, batch, self.device)
                        loss_sum += float(loss) * batch_size
                        if self.workload.metrics is not None:
                            for key, value in self.workload.metrics(self.model, batch, self.device).items():
                                metric_sums[key] = metric_sums.get(key, 0.0) + float(value) * batch_size
                    done += batch_size
        finally:
            self.model.train()
        return {"loss": loss_sum / done, "samples": done,
                "metrics": {key: total / done for key, total in metric_sums.items()}}

    # --- export ---------------------------------------------------------------------------------

    def export(self, what: Kind, buffer: str, capacity: int) -> dict[str, Any]:
        """Write gradients, parameters or full state into shared-memory `buffer`."""
        if what == "residual":
            self._local_only(what)
        if what == "state":
            slots, tensors, meta = state_pieces(self)
        else:
            slots, tensors = self.slots, [p.detach() for p in self.params]
            meta = {"step": self.step}
        numel = slots[-1].end
        if capacity < numel:
            raise SharedBufferError(f"exporting {what} needs {numel} float32 elements, buffer "
                                    f"{buffer!r} was given with numel={capacity}",
                                    {"buffer": buffer, "needed": numel, "given": capacity})
        with buffers.attach(buffer, numel) as view:
            if what == "gradients" and self.outer is not None:
                self.outer.pseudo_gradient(self.params, view)
                self.outer.remember(self.params, self.accumulated_samples, self.inner_step)
                meta = {"accumulated_samples": self.accumulated_samples, "step": self.step,
                        "inner_step": self.inner_step}
            elif what == "residual":
                assert self.outer is not None
                view.copy_(self.outer.residual)
                meta = {"step": self.step}
            elif what == "gradients":
                view.copy_(self._grad_sum)
                if self.accumulated_samples:
                    view.div_(self.accumulated_samples)
                meta = {"accumulated_samples": self.accumulated_samples, "step": self.step}
            else:
                with torch.no_grad():
                    gather(slots, tensors, view)
            del view
        return {"numel": numel, "dtype": "float32", "meta": meta}

    def _float_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, b) for name, b in self.model.named_buffers()
                if b.is_floating_point() and b.dim() > 0]

    # --- apply ----------------------------------------------------------------------------------

    def apply(self, what: Kind, buffer: str, numel: int, meta: Mapping[str, Any] | None
              ) -> dict[str, Any]:
        """Take gradients (and step), parameters or full state from shared-memory `buffer`."""
        meta = dict(meta or {})
        if what == "state":
            return apply_state(self, buffer, numel, meta)
        if what == "residual":
            self._local_only(what)
        if numel != self.total_numel:
            raise SharedBufferError(f"applying {what} needs exactly {self.total_numel} float32 "
                                    f"elements (worker.describe total_numel), got numel={numel}",
                                    {"buffer": buffer, "needed": self.total_numel, "given": numel})
        # Gradients: meta.step, if given, is the run's global step this optimizer step is (the
        # learning-rate schedule follows it); parameters: meta.step, if given, sets the counter.
        global_step = "step" in meta
        new_step = meta["step"] if global_step else self.step
        if not isinstance(new_step, int) or isinstance(new_step, bool) or new_step < 0:
            raise SharedBufferError(f"meta.step must be a non-negative integer, not {new_step!r}",
                                    {"key": "meta.step", "value": repr(new_step)})
        with buffers.attach(buffer, numel) as view:
            buffers.check_finite(view, buffer, what)
            if self.outer is not None and what in ("gradients", "residual"):
                # a local-update run's vectors stay float32 whatever the model's dtype, and the
                # outer step's guard reads them here, on the CPU (outer.py: the same on every peer)
                flat = view.clone()
                incoming = []
            else:
                incoming = [v.to(self.device, dtype=p.dtype, copy=True)
                            for v, p in zip(scatter_views(self.slots, view), self.params, strict=True)]
            del view
        if what == "residual":
            assert self.outer is not None
            with torch.no_grad():
                self.outer.residual.copy_(flat)
            return {"step": self.step}
        if what == "parameters":
            with torch.no_grad():
                for param, value in zip(self.params, incoming, strict=True):
                    param.copy_(value)
            if self.outer is not None:
                self.outer.take(self.params)
                self.inner_step = 0
            self.step = new_step
            return {"step": self.step}
        if self.outer is not None:
            return self._outer_step(flat, new_step)
        if global_step and self.scheduler is not None:
            with self._guard("scheduler"):
                position_scheduler(self.scheduler, new_step, self._scheduler_start)
        self.step = new_step
        lr = float(self.optimizer.param_groups[0]["lr"])  # the learning rate of this step
        for param, grad in zip(self.params, incoming, strict=True):
            param.grad = grad
        with self._guard("optimizer.step"):
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        for param in self.params:
            param.grad = None
        self.step += 1
        self.zero_grad()
        self.state_numel = self._count_state_numel()
        return {"step": self.step, "lr": lr}

    def _outer_step(self, delta: torch.Tensor, new_step: int) -> dict[str, Any]:
        """A local-update run: one outer step with the averaged pseudo-gradient `delta` (flat
        float32, on the CPU), through the guard; the model goes to the new outer parameters, and
        the learning-rate schedule of the next inner steps is put where the run's outer step is."""
        assert self.outer is not None and self.local is not None
        outer = self.outer
        factor = outer.step(delta, cpu_norm(delta))
        self.step = new_step + 1
        # overlap: what was trained since the export carries over onto the new outer parameters
        carried = outer.carry_over(self.params)
        samples = self.accumulated_samples - outer.anchor_samples if carried else 0
        inner = self.inner_step - outer.anchor_inner_steps if carried else 0
        if not carried:
            self.zero_grad()  # back on the (new) outer parameters
        outer.forget()
        self._grad_sum.zero_()
        self.accumulated_samples, self.inner_step = max(0, samples), max(0, inner)
        self._position_inner_schedule()
        self.state_numel = self._count_state_numel()
        if factor < 1.0:
            log.warning("outer_step_clipped", step=new_step, factor=factor,
                        step_norm=outer.step_norm, clipped_steps=outer.clipped_steps)
        return {"step": self.step, "lr": float(self.optimizer.param_groups[0]["lr"]),
                "outer_lr": self.local.outer_lr, "accumulated_samples": self.accumulated_samples,
                "inner_step": self.inner_step, "clip_factor": factor}

    def _position_inner_schedule(self) -> None:
        """A local-update run's learning rate is the schedule's at (outer step x H), held for
        the whole outer step: the schedule counts the run's target batches, as in a gradients
        run, and every peer then takes its inner steps at the same rate, whatever its batch."""
        if self.scheduler is not None and self.local is not None:
            with self._guard("scheduler"):
                position_scheduler(self.scheduler, self.step * self.local.inner_steps,
                                   self._scheduler_start)

    # --- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write this session's checkpoint to `path` (checkpoint.py says what it holds)."""
        return checkpoint.save_session(self, path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Take the model, optimizer, scheduler and step from the checkpoint at `path`."""
        return checkpoint.load_session(self, path)
