"""Workload benchmark: training throughput and peak memory of the paper's two workloads on one device.

    python benchmarks/workloads.py [--workload albert|swav|all] [--device auto|cpu|cuda] [--steps N]
                                   [--warmup N] [--batch-size N] [--max-seq-length N] [--quick]
                                   [--cache-dir DIR] [--json]

Measures `albert` (preset albert-large, ~17.8M parameters) and `swav` (preset resnet50) through the
code path of the real worker: the catalog entry, `resolve_config`, `Session(entry, config, seed,
init_seed, device)`, then per step one `Session.train` of one batch (data, forward, backward and
the gradient accumulation: what the worker reports as its samples per second), followed by the
optimizer step as the collaboration does it: `Session.export("gradients")` into a shared-memory
buffer and `Session.apply("gradients")` from it (copy in, finiteness check, LAMB / LARS step and
the scheduler). `--warmup` steps (at least 1) run first and are not counted. `samples_per_second`
is the batch size over the median seconds of a step's `Session.train` (`samples_per_second_mean`:
the timed samples over the timed steps' total; one slow step, say from another process on the
machine, moves it); `samples_per_second_optimizer_every_step` adds the median export and apply
(as if every batch were a collaborative step; in a run, one optimizer step follows many batches).

Each workload runs in its own child process (this file with an internal flag), so that its memory
is its own: `peak_rss_mib` is the child's peak resident set (getrusage ru_maxrss),
`rss_before_build_mib` its resident set after importing torch, the worker and the workload's heavy
libraries (transformers, torchvision) and before building, `peak_rss_increase_mib` the difference
(model, optimizer state, data pipeline, activations, the shared-memory gradient buffer); on CUDA
also `cuda_max_allocated_mib` and `cuda_max_reserved_mib`. `data_seconds_per_batch_median` times
the data pipeline alone (a second iterator of the same config, after its first batch).

Defaults depend on the device: on a GPU the paper's settings (albert-large 8 x 512 tokens, mixed
precision auto; SwAV batch 64 of 2x224 + 6x96 crops, bf16, `--data-workers` 8 at most), 3
warm-up and 10 timed steps; on a CPU smaller batches (albert-large 1 x 512, SwAV 4 images of
2x224 + 6x96), 1 warm-up and 3 timed steps, a couple of minutes on 2 cores. `--batch-size 0` and
`--max-seq-length 0` take the preset's. `--quick` is for tests: albert-large 1 x 128 tokens, SwAV
resnet50 on 2 images of 2x64 + 6x32 crops, 1 warm-up and 2 timed steps. The settings used are in
each result (`user_config`, and the resolved fields).

Prints one JSON object with --json ({"benchmark": "workloads", "device", "torch", ..., "results":
[...]}), else a table. A workload that fails has an `error` in its result and the exit code is 1;
so is a child that leaves threads or processes behind.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

MIB = 1 << 20
WORKLOADS = ("albert", "swav")
CHILD_TIMEOUT_SECONDS = 1800.0
THREAD_JOIN_SECONDS = 10.0

# What the child imports before it takes the baseline resident set, so that the increase is the
# workload's memory and not the libraries' code.
HEAVY_IMPORTS = {"albert": ("transformers.models.albert.modeling_albert",), "swav": ("torchvision",)}


# --- the plan (parent) ----------------------------------------------------------------------------


def plan(workload: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The user config, steps and warm-up of one workload for these arguments on `device`."""
    gpu = device == "cuda"
    if workload == "albert":
        if args.quick:
            batch, seq = 1, 128
        else:
            batch, seq = (8, 512) if gpu else (1, 512)
        if args.batch_size is not None:
            batch = args.batch_size
        if args.max_seq_length is not None:
            seq = args.max_seq_length
        config: dict[str, Any] = {"preset": "albert-large", "batch_size": batch, "max_seq_length": seq}
        if args.cache_dir:
            config["cache_dir"] = str(Path(args.cache_dir).expanduser().absolute())
    else:
        if args.quick:
            config = {"preset": "resnet50", "batch_size": 2, "crops": "2,6", "crop_sizes": "64,32",
                      "synthetic_size": 80}
        else:
            config = {"preset": "resnet50", "batch_size": 64 if gpu else 4}
        if args.batch_size:  # 0: the workload's default (64); SwAV has no smaller preset batch
            config["batch_size"] = args.batch_size
        elif args.batch_size == 0:
            config.pop("batch_size")
        workers = args.data_workers
        if workers is None:
            workers = min(8, os.cpu_count() or 1) if gpu and not args.quick else 0
        config["data_workers"] = workers
    if args.quick:
        warmup, steps = 1, 2
    else:
        warmup, steps = (3, 10) if gpu else (1, 3)
    return {"workload": workload, "device": device, "config": config,
            "warmup": args.warmup if args.warmup is not None else warmup,
            "steps": args.steps if args.steps is not None else steps,
            "threads": args.threads, "seed": args.seed}


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Measure one workload in a child process (its own process group); its result or an error."""
    with tempfile.TemporaryDirectory(prefix="dedloc-bench-workloads-") as tmp:
        result_path = Path(tmp) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--child-spec", orjson.dumps(spec).decode(),
                "--child-result", str(result_path)]
        # The child's own output (warnings, logs) goes to our stderr: stdout is for the result.
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                   start_new_session=True)
        error = None
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
            returncode = None
        finally:
            if process.poll() is None:  # timed out, or Ctrl-C here
                _kill_group(process.pid)
                process.wait()
        if _kill_group(process.pid):
            error = error or "the child left processes behind (killed)"
        try:
            result = orjson.loads(result_path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            result = {"workload": spec["workload"], "device": spec["device"],
                      "user_config": spec["config"]}
            error = error or f"the child exited with code {returncode} without a result"
    if error:
        result["error"] = f"{result['error']}; {error}" if result.get("error") else error
    elif returncode != 0 and not result.get("error"):
        result["error"] = f"the child exited with code {returncode}"
    return result


def _kill_group(pgid: int) -> bool:
    """SIGKILL every process left in group `pgid`; whether there was one."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- the measurement (child) ----------------------------------------------------------------------


def current_rss_bytes() -> int:
    """This process's resident set now (Linux: /proc/self/statm; elsewhere the peak so far)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


@contextlib.contextmanager
def gradient_buffer(numel: int) -> Iterator[str]:
    """A shared-memory segment of `numel` float32 values, as the daemon hands a worker; its name.

    On Linux it is made as /dev/shm/<name> directly (no resource tracker process to outlive the
    child); elsewhere through the daemon's SharedBuffer.
    """
    shm_dir = Path("/dev/shm")
    if not shm_dir.is_dir():
        from dedloc.daemon.workers.buffers import SharedBuffer

        with SharedBuffer(numel, prefix="dedloc-bench") as shared:
            yield shared.name
        return
    name = f"dedloc-bench-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(shm_dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, numel * 4)
    finally:
        os.close(fd)
    try:
        yield name
    finally:
        (shm_dir / name).unlink(missing_ok=True)


def close_iterator(iterator: Any) -> None:
    """Stop an iterator's background work (albert's prefetch thread, a DataLoader's processes)."""
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


def close_session(session: Any) -> None:
    """Stop what the session started: its own close() when it has one, else its train iterator."""
    close = getattr(session, "close", None)
    if callable(close):
        close()
    else:
        close_iterator(getattr(session, "_train_data", None))


def parameters_by_module(model: Any) -> dict[str, int]:
    """Trainable parameters by the model's top-level child (a tied tensor counted once)."""
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            top = name.split(".", 1)[0]
            counts[top] = counts.get(top, 0) + param.numel()
    return counts


def resolved_fields(workload: str, session: Any) -> dict[str, Any]:
    """The resolved config fields that set the cost of a step, and the precision used."""
    config = session.config
    if workload == "albert":
        from dedloc.plugins.albert.workload import settings

        resolved = settings(config)
        dtype = getattr(session.model, "autocast_dtype", None)
        return {"preset": resolved.preset, "batch_size": resolved.batch_size,
                "max_seq_length": resolved.max_seq_length, "vocab_size": resolved.vocab_size,
                "data_prefetch": config["data_prefetch"],
                "mixed_precision_config": config["mixed_precision"],
                "mixed_precision": str(dtype).removeprefix("torch.") if dtype is not None else "off"}
    on = bool(config["mixed_precision"]) and session.device.type == "cuda"
    return {"preset": config["preset"], "batch_size": config["batch_size"], "crops": config["crops"],
            "crop_sizes": config["crop_sizes"], "synthetic_size": config["synthetic_size"],
            "prototypes": config["prototypes"], "data_workers": config["data_workers"],
            "mixed_precision_config": config["mixed_precision"],
            "mixed_precision": "bfloat16" if on else "off"}


def measure(spec: dict[str, Any], result: dict[str, Any]) -> None:
    """Build the workload and time its steps, filling `result` as it goes (kept on an error)."""
    import torch

    from dedloc.plugins.catalog import WorkloadCatalog
    from dedloc.plugins.worker.main import configure_logging
    from dedloc.plugins.worker.session import Session

    configure_logging("warning")  # as the worker: JSON logs on stderr
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(spec["threads"])
    name = spec["workload"]
    device = torch.device(spec["device"])
    result.update({"torch_threads": torch.get_num_threads(),
                   "torch_interop_threads": torch.get_num_interop_threads()})
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    entry = WorkloadCatalog.load().get(name)
    config = entry.workload.resolve_config(spec["config"])
    for module in HEAVY_IMPORTS.get(name, ()):
        importlib.import_module(module)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    baseline_threads = set(threading.enumerate())
    rss_before = current_rss_bytes()
    result["rss_before_build_mib"] = round(rss_before / MIB, 1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    session = data = None
    try:
        started = time.perf_counter()
        session = Session(entry, config, spec["seed"], 0, device)
        result["build_seconds"] = round(time.perf_counter() - started, 3)
        result.update(resolved_fields(name, session))
        result["parameters"] = session.total_numel
        result["parameters_by_module"] = parameters_by_module(session.model)
        batch_size = result["batch_size"]
        cancel = threading.Event()
        train_seconds: list[float] = []
        export_seconds: list[float] = []
        apply_seconds: list[float] = []
        losses: list[float] = []
        with gradient_buffer(session.total_numel) as buffer:
            for index in range(spec["warmup"] + spec["steps"]):
                trained = session.train(batch_size, None, cancel)  # one batch
                if trained["samples"] != batch_size:
                    raise RuntimeError(f"train({batch_size}) did {trained['samples']} samples")
                began = time.perf_counter()
                exported = session.export("gradients", buffer, session.total_numel)
                middle = time.perf_counter()
                session.apply("gradients", buffer, exported["numel"], None)
                sync()
                ended = time.perf_counter()
                losses.append(float(trained["loss"]))
                if index >= spec["warmup"]:
                    train_seconds.append(trained["seconds"])
                    export_seconds.append(middle - began)
                    apply_seconds.append(ended - middle)
        samples = batch_size * len(train_seconds)
        step_median = statistics.median(train_seconds)
        optimizer_median = statistics.median(export_seconds) + statistics.median(apply_seconds)
        result.update({
            "samples_per_second": round(batch_size / step_median, 4),
            "samples_per_second_mean": round(samples / sum(train_seconds), 4),
            "seconds_per_step_median": round(step_median, 4),
            "seconds_per_step": [round(s, 4) for s in train_seconds],
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "losses": [round(v, 4) for v in losses],
            "optimizer_timed": "Session.export('gradients') into a shared-memory buffer, then "
                               "Session.apply('gradients') from it (optimizer and scheduler step)",
            "export_seconds_median": round(statistics.median(export_seconds), 4),
            "apply_seconds_median": round(statistics.median(apply_seconds), 4),
            "samples_per_second_optimizer_every_step": round(
                batch_size / (step_median + optimizer_median), 4),
        })
        if name == "albert":
            result["tokens_per_second"] = round(result["samples_per_second"] * result["max_seq_length"], 1)
        # The data pipeline alone: a second iterator, timed after its first batch.
        began = time.perf_counter()
        data = iter(entry.workload.build_data(config, spec["seed"] + 1, "train"))
        next(data)
        result["data_first_batch_seconds"] = round(time.perf_counter() - began, 3)
        data_seconds = []
        for _ in range(spec["steps"]):
            began = time.perf_counter()
            next(data)
            data_seconds.append(time.perf_counter() - began)
        result["data_seconds_per_batch_median"] = round(statistics.median(data_seconds), 4)
    finally:
        result["peak_rss_mib"] = round(peak_rss_bytes() / MIB, 1)
        result["peak_rss_increase_mib"] = round((peak_rss_bytes() - rss_before) / MIB, 1)
        if device.type == "cuda":
            result["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
            result["cuda_max_reserved_mib"] = round(torch.cuda.max_memory_reserved(device) / MIB, 1)
        close_iterator(data)
        close_session(session)
        del data, session
        gc.collect()
        result["leftover_threads"] = leftover_threads(baseline_threads)


def leftover_threads(baseline: set[threading.Thread]) -> list[str]:
    """Names of the threads started since `baseline` still alive after waiting for them to end."""
    deadline = time.monotonic() + THREAD_JOIN_SECONDS
    for thread in set(threading.enumerate()) - baseline:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in set(threading.enumerate()) - baseline if t.is_alive())


def child_main(spec_json: str, result_path: str) -> int:
    import multiprocessing

    spec = orjson.loads(spec_json)
    result: dict[str, Any] = {"workload": spec["workload"], "device": spec["device"],
                              "user_config": spec["config"], "warmup_steps": spec["warmup"],
                              "steps": spec["steps"]}
    started = time.perf_counter()
    try:
        measure(spec, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
        child.join(5)
    problems = []
    if result.get("leftover_threads"):
        problems.append(f"threads left running: {', '.join(result['leftover_threads'])}")
    if children:
        problems.append(f"child processes left running (killed): {len(children)}")
    if problems and "error" not in result:
        result["error"] = "; ".join(problems)
    result["seconds"] = round(time.perf_counter() - started, 2)
    Path(result_path).write_bytes(orjson.dumps(result))
    return 1 if "error" in result else 0


# --- output ---------------------------------------------------------------------------------------


def table(summary: dict[str, Any]) -> str:
    header = (f"{'workload':8} {'batch':>9} {'samples/s':>10} {'s/step':>8} {'opt s':>7} {'data s':>7} "
              f"{'peak RSS MiB (+)':>18} {'CUDA MiB':>9} {'params':>11} {'loss first->last':>17}")
    device = summary["device"] + (f" ({summary['device_name']})" if summary.get("device_name") else "")
    lines = [f"device {device}, torch {summary['torch']}, {summary['cpus']} CPUs", header]
    for r in summary["results"]:
        if "samples_per_second" not in r:
            lines.append(f"{r['workload']:8} error: {r.get('error')}")
            continue
        shape = (f"{r['batch_size']}x{r['max_seq_length']}" if r["workload"] == "albert"
                 else f"{r['batch_size']}")
        optimizer = r["export_seconds_median"] + r["apply_seconds_median"]
        cuda = f"{r['cuda_max_allocated_mib']:.0f}" if "cuda_max_allocated_mib" in r else "-"
        memory = f"{r['peak_rss_mib']:.0f} (+{r['peak_rss_increase_mib']:.0f})"
        losses = f"{r['loss_first']:.3f}->{r['loss_last']:.3f}"
        lines.append(f"{r['workload']:8} {shape:>9} {r['samples_per_second']:>10.3f} "
                     f"{r['seconds_per_step_median']:>8.3f} {optimizer:>7.3f} "
                     f"{r.get('data_seconds_per_batch_median', float('nan')):>7.3f} {memory:>18} "
                     f"{cuda:>9} {r['parameters']:>11,} {losses:>17}")
        if r.get("error"):
            lines.append(f"{'':8} error: {r['error']}")
    lines.append(f"total {summary['total_seconds']} s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, help="timed steps (default: 10 on a GPU, 3 on a CPU, 2 quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, at least 1 (default: 3 on a "
                                                   "GPU, 1 on a CPU and quick)")
    parser.add_argument("--batch-size", type=int, help="per step, both workloads; 0: the preset's "
                                                       "(default: see above)")
    parser.add_argument("--max-seq-length", type=int, help="albert's tokens per example; 0: the preset's "
                                                           "(512)")
    parser.add_argument("--data-workers", type=int, help="swav's DataLoader processes (default: 0 on a "
                                                         "CPU, min(8, CPUs) on a GPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's "
                                                               "default)")
    parser.add_argument("--cache-dir", help="albert's corpus and tokenizer cache (default: the workload's, "
                                            "~/.cache/dedloc/albert)")
    parser.add_argument("--quick", action="store_true", help="small settings for a test on a CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=CHILD_TIMEOUT_SECONDS,
                        help="seconds per workload before its child is killed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    parser.add_argument("--child-result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_spec is not None:
        return child_main(args.child_spec, args.child_result)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.warmup is not None and args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step allocates the optimizer state)")
    for option in ("batch_size", "max_seq_length", "data_workers", "threads"):
        if (getattr(args, option) or 0) < 0:
            parser.error(f"--{option.replace('_', '-')} must not be negative")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    names = WORKLOADS if args.workload == "all" else (args.workload,)
    results = [run_child(plan(name, args, device), args.timeout) for name in names]
    summary: dict[str, Any] = {
        "benchmark": "workloads", "device": device, "torch": torch.__version__,
        "python": sys.version.split()[0], "cpus": os.cpu_count(), "quick": args.quick,
        "results": results, "total_seconds": round(time.perf_counter() - started, 1)}
    if device == "cuda":
        summary["device_name"] = torch.cuda.get_device_name()
    if args.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        sys.stdout.write(table(summary) + "\n")
    failed = any("error" in r or not math.isfinite(r.get("samples_per_second", math.nan)) for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
