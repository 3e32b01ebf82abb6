"""A worker zygote: one process that imports torch once and forks a worker for each start.

Starting a worker costs 4-5 s of CPU: `import torch` (2.2 s), torch's compiler stack that the
first optimizer imports (1.4 s) and an interpreter teardown at exit (1 s). A test suite or a
benchmark that starts hundreds of workers on one machine pays that hundreds of times; forked from
a process that imported all of it, a worker starts and ends in about 0.4 s and shares those pages
with its siblings.

    python -m dedloc.plugins.worker.zygote --socket PATH [--parent-pid PID]

A `dedloc-worker` with `DEDLOC_WORKER_ZYGOTE=PATH` in its environment becomes the worker's
stand-in (stand_in.py, which also describes the wire). The daemon never starts a zygote.

What a forked worker gets from its stand-in: command line, environment, working directory, umask
and stdio. What it keeps of the zygote's, so the zygote refuses (and the stand-in starts the
worker itself) where they differ: the network and mount namespaces, and what is read at
interpreter or library start (`START_UP_ENV`). Each forked worker gets its own session and fresh
seeds from the OS for `random`, numpy's and torch's global generators, as a new process has them.

Fork-safety: the zygote only imports modules (torch, the worker's modules, the installed
workloads); it runs no torch operation and refuses to fork once CUDA is initialised, so a forked
worker starts as torch's DataLoader workers do.

Who may connect: the socket is made with mode 0600 and the zygote also checks each peer's uid
(SO_PEERCRED), since whoever connects runs a command line as the zygote's user. Requests are read
without blocking, each within `REQUEST_TIMEOUT_SECONDS`, at most `MAX_PENDING` at a time: a
connection that sends nothing delays nobody else's start or exit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import orjson

from .fork_order import ForkOrder, RefusedRequest, RunWorker, parse_order, run_forked
from .stand_in import HEADER, MAX_REQUEST_BYTES, namespaces

# torch._dynamo: the first optimizer a workload builds imports it; torchvision and transformers:
# SwAV's and ALBERT's models. A module that fails to import is skipped (and named on stderr).
PRELOAD = ("torch", "torch._dynamo", "torchvision", "transformers", "dedloc.plugins.worker.service")
REQUEST_TIMEOUT_SECONDS = 10.0
MAX_PENDING = 32
_UCRED = struct.Struct("3i")

@dataclass
class _Pending:
    """A stand-in whose request is still arriving."""

    deadline: float
    data: bytes = b""
    fds: list[int] = field(default_factory=list)


class Zygote:
    """Accepts stand-ins, forks a worker for each, and tells each stand-in how its worker ended.
    `serve()` returns when the zygote is told to stop; a forked child never returns from it (it
    runs `run_worker` and exits)."""

    def __init__(self, socket_path: Path, run_worker: RunWorker) -> None:
        self.socket_path = socket_path
        self._run_worker = run_worker
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.PollSelector()  # no kernel object shared with the children
        self._pending: dict[socket.socket, _Pending] = {}
        self._pid_of: dict[socket.socket, int] = {}
        self._stand_in_of: dict[int, socket.socket] = {}
        self._namespaces = namespaces()
        self._stopping = False

    def listen(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        self._listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._listener.listen(64)
        self._listener.setblocking(False)

    def serve(self) -> None:
        for sock in (self._wake_read, self._wake_write):
            sock.setblocking(False)
        signal.set_wakeup_fd(self._wake_write.fileno())
        signal.signal(signal.SIGCHLD, _ignore)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._stopping:
                self._expire_pending()
                timeout = min((p.deadline for p in self._pending.values()), default=None)
                if timeout is not None:
                    timeout = max(0.0, timeout - time.monotonic())
                for key, _events in self._selector.select(timeout):
                    sock: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        self._handle(sock)
                    except Exception:  # one stand-in's trouble must not end the others' workers
                        traceback.print_exc()
                        if sock not in (self._listener, self._wake_read):
                            self._drop(sock)
        finally:
            self._kill_all()

    def _stop(self, _signum: int, _frame: object) -> None:
        self._stopping = True

    def _handle(self, sock: socket.socket) -> None:
        if sock is self._wake_read:
            with contextlib.suppress(BlockingIOError):
                self._wake_read.recv(4096)
            self._reap()
        elif sock is self._listener:
            self._accept()
        elif sock in self._pending:
            self._read_request(sock)
        else:
            self._stand_in_gone(sock)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            conn.setblocking(False)
            _pid, uid, _gid = _UCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            conn.close()
            return
        if uid != os.geteuid() or len(self._pending) >= MAX_PENDING:
            conn.close()
            return
        self._pending[conn] = _Pending(time.monotonic() + REQUEST_TIMEOUT_SECONDS)
        self._selector.register(conn, selectors.EVENT_READ)

    def _read_request(self, conn: socket.socket) -> None:
        pending = self._pending[conn]
        try:
            chunk, fds, _flags, _address = socket.recv_fds(conn, 65536, 3)
        except BlockingIOError:
            return
        if fds and (pending.fds or pending.data):
            for fd in fds:
                os.close(fd)
            return self._refuse(conn, "descriptors come with the request's first bytes only")
        pending.fds += fds
        if not chunk:
            return self._refuse(conn, "the stand-in hung up before its request was complete")
        pending.data += chunk
        if len(pending.data) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(pending.data)
        if length > MAX_REQUEST_BYTES:
            return self._refuse(conn, f"a request of {length} bytes is over {MAX_REQUEST_BYTES}")
        if len(pending.data) < HEADER.size + length:
            return None
        try:
            request = pending.data[HEADER.size:HEADER.size + length]  # (not what follows it)
            order = parse_order(request, pending.fds, self._namespaces)
        except RefusedRequest as exc:
            return self._refuse(conn, str(exc))
        return self._fork(conn, order)

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        with contextlib.suppress(OSError):
            conn.send(orjson.dumps({"error": reason}) + b"\n")
        self._drop(conn)

    def _fork(self, conn: socket.socket, order: ForkOrder) -> None:
        fds = self._pending.pop(conn).fds
        self._selector.unregister(conn)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            self._refuse(conn, f"fork failed: {exc}")
            return
        if pid == 0:
            self._child(conn, fds, order)  # never returns
        for fd in fds:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # it exited already: a pidfd of a zombie is still fine; gone is not
            pidfd = None
        try:
            if pidfd is None:
                raise OSError("no pidfd for the worker")
            socket.send_fds(conn, [orjson.dumps({"pid": pid}) + b"\n"], [pidfd])
        except OSError:
            conn.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return  # (reaped, unreported, by _reap)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        self._pid_of[conn] = pid
        self._stand_in_of[pid] = conn
        self._selector.register(conn, selectors.EVENT_READ)
        self._reap()  # a worker that ended before it was registered is reported now

    def _child(self, conn: socket.socket, fds: list[int], order: ForkOrder) -> NoReturn:
        """The forked child's whole life. Nothing may unwind from here into the zygote's code:
        its `finally` would kill the child's siblings (a worker whose daemon died writes its
        last log lines into a pipe nobody reads, and the BrokenPipeError escaped from an
        `except` clause once)."""
        code = 1
        try:
            self._become_child(conn, fds, order)
            code = run_forked(self._run_worker, order)
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc()
        finally:
            os._exit(code)

    def _become_child(self, conn: socket.socket, fds: list[int], order: ForkOrder) -> None:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sock in (conn, self._listener, self._wake_read, self._wake_write, *self._pid_of,
                     *self._pending):
            sock.close()
        for pending in self._pending.values():
            for fd in pending.fds:
                os.close(fd)
        self._selector.close()
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:  # as multiprocessing does in a child it forks
            mp_util._finalizer_registry.clear()
            mp_util._run_after_forkers()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(order.cwd)
        os.umask(order.umask)
        os.environ.clear()
        os.environ.update(order.env)
        sys.argv = ["dedloc-worker", *order.argv]
        # `random` reseeds itself after a fork; numpy's and torch's generators do not
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.seed()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self._stand_in_of.pop(pid, None)
            if conn is None:
                continue
            del self._pid_of[conn]
            with contextlib.suppress(KeyError):  # not when its stand-in is gone already
                self._selector.unregister(conn)
            if os.WIFSIGNALED(status):
                ended: dict[str, int] = {"signal": os.WTERMSIG(status)}
            else:
                ended = {"exit_code": os.waitstatus_to_exitcode(status)}
            with contextlib.suppress(OSError):
                conn.send(orjson.dumps(ended) + b"\n")
            conn.close()

    def _stand_in_gone(self, conn: socket.socket) -> None:
        """A stand-in wrote or hung up while its worker runs: it died (or misbehaves), so its
        worker goes too (reaped, and not reported, when it has exited)."""
        pid = self._pid_of.get(conn)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(KeyError):
            self._selector.unregister(conn)

    def _drop(self, conn: socket.socket) -> None:
        pending = self._pending.pop(conn, None)
        for fd in pending.fds if pending is not None else ():
            os.close(fd)
        if pending is not None or conn not in self._pid_of:
            with contextlib.suppress(KeyError):
                self._selector.unregister(conn)
            conn.close()
        else:
            self._stand_in_gone(conn)

    def _expire_pending(self) -> None:
        now = time.monotonic()
        for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
            self._refuse(conn, f"no whole request within {REQUEST_TIMEOUT_SECONDS} s")

    def _kill_all(self) -> None:
        for pid in list(self._stand_in_of):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._listener.close()
        self.socket_path.unlink(missing_ok=True)


def _ignore(_signum: int, _frame: object) -> None:
    """SIGCHLD wakes the loop through the wakeup descriptor; nothing to do in the handler."""


def preload(names: Sequence[str]) -> list[str]:
    """Import each module of `names` (naming on stderr those that fail); return those imported."""
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a module that fails is only not preloaded
            sys.stderr.write(f"dedloc-worker-zygote: not preloading {name}: {exc!r}\n")
            continue
        loaded.append(name)
    from ..catalog import WorkloadCatalog

    WorkloadCatalog.load()  # imports the installed workloads' modules
    gc.freeze()  # what the preload made is never collected: its pages stay shared
    return loaded


def main(argv: Sequence[str] | None = None, *, run_worker: RunWorker | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc-worker-zygote", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", type=Path, required=True, help="unix socket to listen on")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parser.add_argument("--preload", default=",".join(PRELOAD),
                        help="comma-separated modules to import before forking")
    args = parser.parse_args(argv)
    from .main import die_with_parent, run

    if not die_with_parent(args.parent_pid):
        return 0
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() inits no CUDA
    loaded = preload([name for name in args.preload.split(",") if name])
    zygote = Zygote(args.socket, run_worker or run)
    zygote.listen()
    sys.stdout.write(orjson.dumps({"listening": str(args.socket), "pid": os.getpid(),
                                   "preloaded": loaded}).decode() + "\n")
    sys.stdout.flush()
    zygote.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
