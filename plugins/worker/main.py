"""`dedloc-worker`: the process that holds a model and serves the worker protocol on a unix socket.

    dedloc-worker --socket PATH [--parent-pid PID] [--threads N]
    dedloc-worker --list-workloads

It exits 0 after `worker.stop`, on SIGTERM/SIGINT, when the daemon's connection closes (after one
was made) and when its parent dies; non-zero when it crashes. Logs are JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import orjson
import structlog

from dedloc import __version__
from dedloc.rpc import JsonRpcServer, MethodRegistry
from dedloc.rpc.worker_protocol import MIN_DUTY_CYCLE

from ..catalog import WorkloadCatalog

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1
GPU_MEMORY_ENV = "DEDLOC_GPU_MEMORY_FRACTION"
ZYGOTE_ENV = "DEDLOC_WORKER_ZYGOTE"  # plugins/worker/stand_in.py
PARENT_POLL_SECONDS = 0.5
CLOSE_TIMEOUT_SECONDS = 30.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dedloc-worker", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", type=Path, help="unix socket path to serve the worker protocol on")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.0,
                        help="most of each GPU's memory this worker (and its replicas) may take, "
                             "as a fraction; 0: no cap")
    parser.add_argument("--duty-cycle", type=float, default=1.0,
                        help="the share of the time training computes, from 0.05 to 1: below 1 "
                             "it rests after each batch (1: no rest)")
    parser.add_argument("--list-workloads", action="store_true",
                        help="print the installed workloads as one JSON object and exit")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--version", action="version", version=f"dedloc-worker {__version__}")
    args = parser.parse_args(argv)
    if not args.list_workloads and args.socket is None:
        parser.error("--socket is required (or --list-workloads)")
    if args.threads < 0:
        parser.error("--threads must be 0 or more")
    if not 0.0 <= args.gpu_memory_fraction <= 1.0:
        parser.error("--gpu-memory-fraction must be between 0 and 1")
    if not MIN_DUTY_CYCLE <= args.duty_cycle <= 1.0:
        parser.error(f"--duty-cycle must be between {MIN_DUTY_CYCLE} and 1")
    return args


def configure_logging(level: str) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(serializer=lambda obj, **kw: orjson.dumps(
                obj, default=repr).decode()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def list_workloads() -> int:
    # A plugin that prints while importing must not spoil the JSON on stdout.
    with contextlib.redirect_stdout(sys.stderr):
        listing = WorkloadCatalog.load().describe()
    sys.stdout.write(orjson.dumps(listing).decode() + "\n")
    sys.stdout.flush()
    return 0


def cap_gpu_memory() -> float | None:
    """Apply the GPU memory cap of $DEDLOC_GPU_MEMORY_FRACTION to every visible GPU (torch's
    per-process fraction: an allocation beyond it fails with an out-of-memory error)."""
    text = os.environ.get(GPU_MEMORY_ENV)
    if not text:
        return None
    import torch

    fraction = float(text)
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(fraction, index)
        log.info("gpu_memory_capped", fraction=fraction, devices=torch.cuda.device_count())
    return fraction


def die_with_parent(parent_pid: int | None) -> bool:
    """Ask Linux for SIGTERM when our parent exits; False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            log.warning("pdeathsig_failed", errno=ctypes.get_errno())
    return parent_pid is None or parent_alive(parent_pid)


def parent_alive(parent_pid: int) -> bool:
    if os.getppid() == parent_pid:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return os.getppid() != 1 or parent_pid == 1


async def watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set `stop` when process `parent_pid` exits (a pidfd on Linux, else polling)."""
    try:
        fd: int | None = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        fd = None
        gone_already = True
    except (AttributeError, OSError):  # no pidfd_open (not Linux >= 5.3)
        fd = None
        gone_already = False
    if fd is not None:
        exited = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, exited.set)
        try:
            await exited.wait()
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    elif not gone_already:
        while parent_alive(parent_pid):  # noqa: ASYNC110 - nothing to wait on without a pidfd
            await asyncio.sleep(PARENT_POLL_SECONDS)
    log.info("worker_parent_gone", parent_pid=parent_pid)
    stop.set()


async def serve(args: argparse.Namespace) -> int:
    from .service import ERROR_MAP, PROTOCOL_VERSION, WorkerService

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    catalog = await asyncio.to_thread(WorkloadCatalog.load)
    service = WorkerService(catalog, stop.set, args.duty_cycle)
    registry = MethodRegistry(
        "dedloc-worker", __version__,
        f"The dedloc worker protocol, version {PROTOCOL_VERSION} (docs/worker-protocol.md).",
        error_map=ERROR_MAP)
    registry.register_object(service)
    disconnected = asyncio.Event()
    server = JsonRpcServer(registry, args.socket, mode=0o600, idle_timeout=None,
                           max_request_bytes=16 << 20, max_connections=8,
                           on_hangup=lambda: server.clients == 0 and disconnected.set())
    await server.start()
    log.info("worker_listening", socket=str(args.socket), pid=os.getpid(), workloads=catalog.names)
    async with asyncio.TaskGroup() as tasks:
        waiters = [tasks.create_task(stop.wait()), tasks.create_task(disconnected.wait())]
        if args.parent_pid is not None:
            waiters.append(tasks.create_task(watch_parent(args.parent_pid, stop)))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        reason = "connection closed" if disconnected.is_set() else "stop requested"
        log.info("worker_stopping", reason=reason)
        for waiter in waiters:
            waiter.cancel()
    await server.close()
    await service.close(CLOSE_TIMEOUT_SECONDS)
    log.info("worker_stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`dedloc-worker`: run the worker, or have the worker zygote named by $DEDLOC_WORKER_ZYGOTE
    fork it and stand in for it (stand_in.py; where none forks it, run it here)."""
    zygote_socket = os.environ.get(ZYGOTE_ENV)
    if zygote_socket:
        from .stand_in import ZygoteUnavailable, note, run_through_zygote

        arguments = list(sys.argv[1:] if argv is None else argv)
        try:
            return run_through_zygote(zygote_socket, arguments)
        except ZygoteUnavailable as exc:
            if not exc.quiet:
                note("worker_zygote_unused", f"{exc}; starting without it")
    return run(argv)


def run(argv: Sequence[str] | None = None) -> int:
    """The worker itself (what `main` runs in this process, and a zygote in a forked one)."""
    args = parse_args(argv)
    configure_logging(args.log_level)
    if args.list_workloads:
        return list_workloads()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
        with contextlib.suppress(RuntimeError):  # only settable before any parallel work
            torch.set_num_interop_threads(args.threads)
    if args.gpu_memory_fraction > 0:
        os.environ[GPU_MEMORY_ENV] = repr(args.gpu_memory_fraction)  # replicas inherit it
    cap_gpu_memory()
    if not die_with_parent(args.parent_pid):
        log.info("worker_parent_gone", parent_pid=args.parent_pid)
        return 0
    try:
        return asyncio.run(serve(args))
    except Exception:
        log.exception("worker_crashed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
