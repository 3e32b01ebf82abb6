"""Data parallelism inside one peer: a worker that trains on several local devices at once.

A worker loaded with several devices (`"cuda:0,cuda:1"`, `"cuda:all"`, or `"cpu,cpu"` for tests)
holds the model on the first device itself (rank 0) and starts one replica process per other device
(ranks 1..N-1), joined by a torch.distributed process group (NCCL on GPUs, Gloo on CPUs) over a
store on 127.0.0.1. To the daemon and the collaboration it is still one worker and one peer.

- `train(samples)`: every rank trains on its share of the samples from a data stream of its own
  (rank 0 keeps the peer's seed, rank r a seed derived from it), accumulating gradient sums
  locally, all ranks at once.
- `export("gradients")`: the ranks' gradient sums and sample counts are reduced onto rank 0 first
  (one collective per export, not one per batch: the same traffic as DistributedDataParallel with
  `no_sync()` over the accumulation, and it works with any workload, including ones whose `loss`
  calls submodules rather than the model's `forward`).
- Any change of the parameters on rank 0 (an optimizer step, parameters or state applied, a
  checkpoint loaded) is broadcast to the replicas with the model's floating buffers, and their
  step and LR scheduler move to rank 0's (a workload may read the global step from there). Replicas
  hold no optimizer state (torch creates it lazily, on the first step, which they never take).
- Evaluation and checkpoints run on rank 0 alone.

A replica that dies or stops answering fails the call with WorkloadError and marks the session
broken: every later call fails at once (the run fails with that message; restarting the run starts
a new worker), rather than hanging in a collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ..catalog import CatalogEntry, WorkloadCatalog
from ..errors import PluginError, WorkloadError
from .layout import gather, pack, scatter_views
from .scheduler_position import position_scheduler
from .session import Kind, Session

log = structlog.get_logger(__name__)

START_TIMEOUT_SECONDS = 300.0
"""How long replicas may take to start, import the workload and build the model."""
COLLECTIVE_TIMEOUT_SECONDS = 120.0
"""How long one collective (reduce, broadcast) may wait for the slowest rank."""
ANSWER_GRACE_SECONDS = 120.0
"""How long after its deadline (or after rank 0's share, for an unbounded call) a replica may take."""
SEED_STRIDE = 0x9E3779B97F4A7C15
PR_SET_PDEATHSIG = 1


def parse_devices(device: str) -> list[str]:
    """`device` as a list: "cuda:0,cuda:1" and "cpu,cpu" name each; "cuda:all" is every local GPU.

    A single name (or "auto") gives a list of one. Raises ValueError with what to write instead.
    """
    names = [name.strip() for name in device.split(",")]
    if any(not name for name in names):
        raise ValueError(f"{device!r} has an empty device name (write e.g. cuda:0,cuda:1)")
    if "cuda:all" in names:
        if len(names) > 1:
            raise ValueError("cuda:all stands alone (it is every local GPU)")
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("cuda:all: CUDA is not available on this machine")
        return [f"cuda:{index}" for index in range(count)]
    if len(names) > 1 and "auto" in names:
        raise ValueError("auto stands alone; name the devices (e.g. cuda:0,cuda:1)")
    return names


def replica_seed(seed: int, rank: int) -> int:
    """The data seed of rank `rank`: rank 0 keeps the peer's seed, so one device changes nothing."""
    return seed if rank == 0 else (seed + rank * SEED_STRIDE) % (1 << 63)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process needs to build its copy of the session and join the group."""

    workload: str
    config: dict[str, Any]
    seed: int
    init_seed: int
    device: str
    rank: int
    world_size: int
    store_port: int
    backend: str
    threads: int
    parent_pid: int


class ReplicatedSession(Session):
    """A Session on rank 0 of a worker with several devices (see the module's docstring)."""

    def __init__(self, entry: CatalogEntry, config: dict[str, Any], seed: int, init_seed: int,
                 devices: list[torch.device]) -> None:
        if len(devices) < 2:
            raise ValueError("a replicated session needs at least two devices")
        if len({device.type for device in devices}) > 1:
            raise WorkloadError("all devices of one worker must be of one kind (all cuda or all cpu), "
                                f"not {', '.join(map(str, devices))}")
        super().__init__(entry, config, seed, init_seed, devices[0])
        self.devices = devices
        self.world_size = len(devices)
        self._broken: str | None = None
        self._pending_samples = [0] * self.world_size  # accumulated on each replica, not yet reduced
        self._replica_skipped = [0] * self.world_size  # batches each replica skipped (NaN/Inf)
        self._processes: list[Any] = []
        self._pipes: list[Connection] = []
        self._sync_slots, self._sync_tensors = self._sync_layout()
        try:
            self._start_replicas(entry.workload.name, config, seed, init_seed)
        except BaseException:
            self.close()
            raise

    # --- the group ------------------------------------------------------------------------------

    def _start_replicas(self, workload: str, config: dict[str, Any], seed: int, init_seed: int) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS)
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        threads = torch.get_num_threads()
        if self.device.type == "cpu":  # the ranks share this machine's cores
            threads = max(1, threads // self.world_size)
            torch.set_num_threads(threads)
        context = multiprocessing.get_context("spawn")
        for rank, device in enumerate(self.devices[1:], start=1):
            spec = ReplicaSpec(workload, config, seed, init_seed, str(device), rank, self.world_size,
                               store.port, backend, threads, os.getpid())
            ours, theirs = context.Pipe()
            process = context.Process(target=replica_main, args=(spec, theirs), daemon=True,
                                      name=f"dedloc-replica-{rank}")
            process.start()
            theirs.close()
            self._processes.append(process)
            self._pipes.append(ours)
        log.info("replicas_starting", devices=[str(d) for d in self.devices], backend=backend)
        dist.init_process_group(backend, store=store, rank=0, world_size=self.world_size,
                                timeout=timeout)
        self._store = store
        for rank in range(1, self.world_size):
            answer = self._answer(rank, START_TIMEOUT_SECONDS, "start")
            if answer["total_numel"] != self.total_numel:
                raise WorkloadError(f"the replica on {self.devices[rank]} built a model of "
                                    f"{answer['total_numel']} parameters, rank 0 has {self.total_numel}")
            if answer["task_fingerprint"] != self.task_fingerprint:
                raise WorkloadError(f"the replica on {self.devices[rank]} has task fingerprint "
                                    f"{answer['task_fingerprint']!r}, rank 0 {self.task_fingerprint!r}")
        self._broadcast_parameters()  # the same weights everywhere, whatever the workload's init did
        log.info("replicas_ready", world_size=self.world_size)

    def _send(self, command: tuple[Any, ...]) -> None:
        self._check_usable()
        try:
            for pipe in self._pipes:
                pipe.send(command)
        except (OSError, EOFError) as exc:
            self._fail(f"a replica's pipe is closed ({exc})")

    def _answer(self, rank: int, timeout: float, what: str) -> dict[str, Any]:
        """Rank `rank`'s answer to the last command, waiting at most `timeout` seconds."""
        pipe = self._pipes[rank - 1]
        process = self._processes[rank - 1]
        deadline = time.monotonic() + timeout
        while not pipe.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not process.is_alive():
                self._fail(f"the replica on {self.devices[rank]} exited (code {process.exitcode}) "
                           f"during {what}")
            if time.monotonic() >= deadline:
                self._fail(f"the replica on {self.devices[rank]} did not answer {what} within "
                           f"{timeout:.0f} s")
        try:
            status, payload = pipe.recv()
        except (OSError, EOFError):
            self._fail(f"the replica on {self.devices[rank]} exited during {what}")
        if status != "ok":
            self._fail(f"the replica on {self.devices[rank]} failed in {what}: {payload}")
        return payload

    def _answers(self, timeout: float, what: str) -> list[dict[str, Any]]:
        return [self._answer(rank, timeout, what) for rank in range(1, self.world_size)]

    def _fail(self, reason: str) -> None:
        self._broken = reason
        log.error("replicas_broken", reason=reason)
        raise WorkloadError(f"multi-device worker: {reason}; restart the run (`dedloc restart NAME` "
                            "starts a new worker) or use one device",
                            {"devices": [str(d) for d in self.devices]})

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise WorkloadError(f"multi-device worker is broken ({self._broken}); restart the run "
                                "(`dedloc restart NAME`) or load the workload again",
                                {"devices": [str(d) for d in self.devices]})

    @contextlib.contextmanager
    def _collective(self, what: str) -> Any:
        try:
            yield
        except (RuntimeError, dist.DistBackendError) as exc:
            self._fail(f"{what} failed: {exc}")

    def _sync_layout(self) -> tuple[list[Any], list[torch.Tensor]]:
        tensors = [*self.params, *(b for _, b in self._float_buffers())]
        return pack((str(i), t.shape) for i, t in enumerate(tensors)), tensors

    def _broadcast_parameters(self) -> None:
        """Send rank 0's parameters and floating buffers to every replica."""
        position = getattr(self.scheduler, "last_epoch", None)
        self._send(("sync", self.step, position if isinstance(position, int) else None))
        flat = torch.empty(self._sync_slots[-1].end, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            gather(self._sync_slots, self._sync_tensors, flat)
        with self._collective("broadcasting the parameters"):
            dist.broadcast(flat, src=0)
        self._answers(COLLECTIVE_TIMEOUT_SECONDS, "sync")

    def _reduce_gradients(self) -> None:
        """Add every replica's gradient sum and sample count into rank 0's; the replicas zero theirs."""
        if not any(self._pending_samples[1:]):
            return
        self._send(("reduce",))
        with self._collective("reducing the gradients"):
            dist.reduce(self._grad_sum, dst=0)
        self._answers(COLLECTIVE_TIMEOUT_SECONDS, "reduce")
        self.accumulated_samples += sum(self._pending_samples[1:])
        self._pending_samples = [0] * self.world_size

    def close(self) -> None:
        """Stop the replicas and leave the process group (idempotent)."""
        for pipe in self._pipes:
            with contextlib.suppress(OSError, EOFError, BrokenPipeError):
                pipe.send(("stop",))
        for process in self._processes:
            process.join(10.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._processes = [], []
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.destroy_process_group()
        self._broken = self._broken or "closed"

    # --- Session, replicated --------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "devices": [str(d) for d in self.devices],
                "accumulated_samples": self.accumulated_samples + sum(self._pending_samples[1:])}

    def train(self, samples: int, max_seconds: float | None, cancel: threading.Event,
              duty_cycle: float = 1.0) -> dict[str, Any]:
        self._check_usable()
        share = math.ceil(samples / self.world_size)
        start = time.perf_counter()
        self._send(("train", share, max_seconds, duty_cycle))
        local = super().train(share, max_seconds, cancel, duty_cycle)
        grace = ANSWER_GRACE_SECONDS + (max_seconds or 0.0) + local["seconds"]
        results = [local, *self._answers(grace, "train")]
        for rank, result in enumerate(results[1:], start=1):
            self._pending_samples[rank] += result["samples"]
            skipped = result.get("skipped_batches")  # (a replica's count, all calls)
            if isinstance(skipped, int) and skipped >= 0:
                self._replica_skipped[rank] = skipped
        seconds = time.perf_counter() - start
        done = sum(result["samples"] for result in results)
        rate = done / seconds if seconds > 0 and done else None
        if duty_cycle < 1.0:  # each rank's sustained speed (a call may carry rests over: Session)
            rates = [r.get("samples_per_second") for r in results]
            rate = sum(rates) if all(isinstance(x, int | float) and x > 0 for x in rates) else None
        if rate is not None:
            self.samples_per_second = rate
        return {"samples": done,  # 0 when every rank skipped every batch (NaN or Inf)
                "loss": sum(r["loss"] * r["samples"] for r in results) / done if done else 0.0,
                "seconds": seconds, "samples_per_second": rate,
                "accumulated_samples": self.accumulated_samples + sum(self._pending_samples[1:]),
                "skipped_batches": self.skipped_batches + sum(self._replica_skipped[1:]),
                "rested_seconds": local.get("rested_seconds", 0.0),
                "ranks": [{"device": str(device), "samples": r["samples"], "seconds": r["seconds"],
                           "rested_seconds": r.get("rested_seconds", 0.0)}
                          for device, r in zip(self.devices, results, strict=True)]}

    def zero_grad(self) -> None:
        super().zero_grad()
        if any(self._pending_samples[1:]):
            self._send(("zero",))
            self._answers(COLLECTIVE_TIMEOUT_SECONDS, "zero_grad")
            self._pending_samples = [0] * self.world_size

    def export(self, what: Kind, buffer: str, capacity: int) -> dict[str, Any]:
        self._check_usable()
        if what == "gradients":
            self._reduce_gradients()
        return super().export(what, buffer, capacity)

    def apply(self, what: Kind, buffer: str, numel: int, meta: Any) -> dict[str, Any]:
        self._check_usable()
        if what == "gradients":
            self._reduce_gradients()  # then the step clears them all
        answer = super().apply(what, buffer, numel, meta)
        self._broadcast_parameters()
        return answer

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        self._check_usable()
        answer = super().load_checkpoint(path)
        self._broadcast_parameters()
        return answer


# --- the replica process ----------------------------------------------------------------------------


def replica_main(spec: ReplicaSpec, pipe: Connection) -> None:
    """Rank `spec.rank`: build the session on its device, join the group, serve rank 0's commands."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != spec.parent_pid:  # rank 0 died before we set the signal
        return
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
                        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr))
    bound = log.bind(rank=spec.rank, device=spec.device)
    torch.set_num_threads(spec.threads)
    from .main import cap_gpu_memory

    cap_gpu_memory()  # the worker's cap, inherited through the environment
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        entry = WorkloadCatalog.load().get(spec.workload)
        session = Session(entry, spec.config, replica_seed(spec.seed, spec.rank), spec.init_seed, device)
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=START_TIMEOUT_SECONDS))
        dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                world_size=spec.world_size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS))
    except (PluginError, RuntimeError, ValueError, OSError) as exc:
        bound.exception("replica_start_failed")
        with contextlib.suppress(OSError):
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ok", {"total_numel": session.total_numel,
                      "task_fingerprint": session.task_fingerprint}))
    bound.info("replica_ready")
    try:
        serve_replica(session, pipe)
    finally:
        with contextlib.suppress(RuntimeError):
            dist.destroy_process_group()


def serve_replica(session: Session, pipe: Connection) -> None:
    """Answer rank 0's commands until it says stop or goes away."""
    never = threading.Event()
    tensors = [*session.params, *(b for _, b in session._float_buffers())]
    slots = pack((str(i), t.shape) for i, t in enumerate(tensors))
    while True:
        try:
            command = pipe.recv()
        except (EOFError, OSError):
            return
        name = command[0]
        try:
            if name == "stop":
                return
            if name == "train":
                _, samples, max_seconds, duty_cycle = command
                result = session.train(samples, max_seconds, never, duty_cycle)
            elif name == "reduce":
                dist.reduce(session._grad_sum, dst=0)
                session.zero_grad()
                result = {}
            elif name == "zero":
                session.zero_grad()
                result = {}
            elif name == "sync":
                _, step, scheduler_step = command
                flat = torch.empty(slots[-1].end, dtype=torch.float32, device=session.device)
                dist.broadcast(flat, src=0)
                with torch.no_grad():
                    for tensor, value in zip(tensors, scatter_views(slots, flat), strict=True):
                        tensor.copy_(value)
                # Workloads may read the global step from the scheduler (SwAV's frozen prototypes
                # and queue): a replica's follows rank 0's, though it never steps its optimizer.
                session.step = step
                if scheduler_step is not None and session.scheduler is not None:
                    position_scheduler(session.scheduler, scheduler_step, session._scheduler_start)
                result = {}
            else:
                pipe.send(("error", f"unknown command {name!r}"))
                continue
        except (PluginError, RuntimeError) as exc:
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        pipe.send(("ok", result))
