"""The workers' settings: the `[workers]` section of the daemon's configuration: how a worker
process is started and how long its calls may take."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from dedloc.rpc.worker_protocol import MIN_DUTY_CYCLE

from ..errors import ConfigError
from ..settings import documented


@dataclass(frozen=True)
class WorkerSettings:
    command: list[str] = documented(
        "Command that starts a worker; the daemon appends --socket PATH --parent-pid PID. "
        "Empty: this Python running dedloc.plugins.worker.", default_factory=list)
    start_timeout: float = documented("Seconds a worker may take to start and load its workload.",
                                      default=180.0)
    call_timeout: float = documented("Seconds one worker call (train, export, ...) may take.",
                                     default=600.0)
    stop_timeout: float = documented("Seconds a worker may take to stop before it is killed.",
                                     default=20.0)
    threads: int = documented("CPU threads a worker may use for compute; 0: the library's default.",
                              default=0)
    device: str = documented('Device for workers: "auto" (a GPU if there is one), "cpu", "cuda", '
                             '"cuda:N", several comma-separated ("cuda:0,cuda:1") or "cuda:all": one '
                             "worker process per device, data-parallel, still one peer.", default="auto")
    log_lines: int = documented("Lines of each worker's output kept for run.status.", default=50)
    list_cache_seconds: float = documented("Seconds the list of installed workloads is cached.",
                                           default=60.0)
    gpu_memory_fraction: float = documented("Most of each GPU's memory a worker may take, as a fraction "
                                            "(torch's per-process cap); 0: no cap.", default=0.0)
    duty_cycle: float = documented(
        "Share of the time a worker computes while it trains, from 0.05 to 1. Below 1 it rests "
        "after each batch for (1 / duty_cycle - 1) times as long as the batch took, so that the "
        "machine stays usable (a desktop, a laptop's fan) and shared cores are left to others; "
        "this peer's speed, and so its share of each epoch's samples, falls in proportion. "
        "1: no rest.", default=1.0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ConfigError("workers.gpu_memory_fraction", "must be between 0 (no cap) and 1")
        if not MIN_DUTY_CYCLE <= self.duty_cycle <= 1.0:
            raise ConfigError("workers.duty_cycle", f"must be between {MIN_DUTY_CYCLE} and 1 "
                              "(1: no rest)")

    def command_line(self) -> list[str]:
        """The command that starts a worker: `command`, else this Python running our worker."""
        return list(self.command) or [sys.executable, "-m", "dedloc.plugins.worker"]
