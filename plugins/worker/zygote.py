"""A worker zygote: one process that imports torch once and forks a worker for each start.

Starting a worker costs about 3 s of CPU, 2.2 s of it `import torch`. A test suite or a benchmark
that starts hundreds of workers on one machine pays that hundreds of times; forked from a process
that has already imported torch and the workloads, a worker starts in a tenth of it and shares
those pages with its siblings.

    python -m dedloc.plugins.worker.zygote --socket PATH [--parent-pid PID]

With `DEDLOC_WORKER_ZYGOTE=PATH` in its environment, `dedloc-worker` hands its whole command line
to the zygote listening there instead of running it (`run_through_zygote`) and stays as the
worker's stand-in: the daemon still owns a child process with the worker's command line, signals
it and reads its exit code. The stand-in passes its stdin, stdout and stderr to the zygote (the
forked worker writes to the daemon's pipes directly), forwards SIGTERM, SIGINT and SIGHUP to the
worker, and exits as the worker did (its code, or the same signal). When the stand-in dies (say
SIGKILL), the zygote kills the worker. Where no zygote answers, `dedloc-worker` runs as usual.

Fork-safety: the zygote only imports modules (torch, the worker's modules, the installed
workloads). It runs no torch operation and never touches CUDA, so the forked worker starts as
torch's DataLoader workers do. Each forked worker gets its own session, its environment and
working directory from the stand-in, and fresh seeds from the OS for `random`, numpy's and
torch's global generators, as a new process has them (forked as they are, every worker would draw
the same numbers).

The socket is created with mode 0600 in a directory only its owner can enter: anyone who can
connect can run a command as the zygote's user. The daemon never starts a zygote; it is for test
suites and benchmarks that start many workers on one machine.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import random
import selectors
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# What a zygote imports before it forks anything (names that fail to import are skipped).
# torch._dynamo: the first optimizer a workload builds imports it (1.4 s of CPU); torchvision and
# transformers: SwAV's and ALBERT's models.
PRELOAD = ("torch", "torch._dynamo", "torchvision", "transformers", "dedloc.plugins.worker.service")
MAX_REQUEST_BYTES = 1 << 20
REQUEST_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 10.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_HEADER = struct.Struct(">I")


class ZygoteError(Exception):
    """A zygote could not start a worker (the caller runs the worker itself)."""


@dataclass(frozen=True)
class ForkOrder:
    """What a forked child runs: a worker's command line, environment and directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


# --------------------------------------------------------------------------- the stand-in's side


def run_through_zygote(socket_path: str, argv: Sequence[str]) -> int:
    """Have the zygote at `socket_path` run `dedloc-worker argv` and wait for it to end; return its
    exit code (or die of the signal it died of). Raises ZygoteError where the zygote cannot be
    reached or refuses, before any worker started."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_SECONDS)
    try:
        sock.connect(socket_path)
        request = orjson.dumps({"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd()})
        message = _HEADER.pack(len(request)) + request
        sent = socket.send_fds(sock, [message], [0, 1, 2])
        sock.sendall(message[sent:])
        reader = sock.makefile("rb")
        started = _read_message(reader)
    except (OSError, ValueError) as exc:
        sock.close()
        raise ZygoteError(f"no worker zygote at {socket_path}: {exc}") from exc
    if "pid" not in started:
        sock.close()
        raise ZygoteError(f"the worker zygote at {socket_path} refused: {started.get('error')}")
    pid = int(started["pid"])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    sock.settimeout(None)  # the worker runs as long as it runs; the zygote answers when it ends
    try:
        ended = _read_message(reader)
    except (OSError, ValueError):
        ended = {"signal": int(signal.SIGKILL)}  # the zygote is gone, and with it the worker
    finally:
        sock.close()
    if "signal" in ended:
        signum = int(ended["signal"])
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum
    return int(ended.get("exit_code", 1))


def _read_message(reader: Any) -> dict[str, Any]:
    line = reader.readline(MAX_REQUEST_BYTES)
    if not line:
        raise ValueError("the zygote closed the connection")
    message = orjson.loads(line)
    if not isinstance(message, dict):
        raise ValueError("the zygote sent something other than an object")
    return message


# --------------------------------------------------------------------------- the zygote's side


class Zygote:
    """Accepts stand-ins, forks a worker for each, and reports each worker's end to its stand-in.

    `serve()` returns in the parent only when told to stop (None); in each forked child it returns
    that child's ForkOrder, with every descriptor of the zygote closed."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.PollSelector()  # no kernel object shared with the children
        self._pid_of: dict[socket.socket, int] = {}
        self._stand_in_of: dict[int, socket.socket] = {}
        self._stopping = False

    def listen(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        self._listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._listener.listen(64)

    def serve(self) -> ForkOrder | None:
        for sock in (self._wake_read, self._wake_write):
            sock.setblocking(False)
        signal.set_wakeup_fd(self._wake_write.fileno())
        signal.signal(signal.SIGCHLD, _ignore)
        signal.signal(signal.SIGTERM, self._stop)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        while not self._stopping:
            for key, _events in self._selector.select():
                if key.fileobj is self._wake_read:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_read.recv(4096)
                    self._reap()
                elif key.fileobj is self._listener:
                    order = self._accept()
                    if order is not None:
                        return order  # in the child
                else:
                    self._stand_in_gone(key.fileobj)  # type: ignore[arg-type]
        self._kill_all()
        return None

    def _stop(self, _signum: int, _frame: object) -> None:
        self._stopping = True

    def _accept(self) -> ForkOrder | None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return None
        conn.settimeout(REQUEST_TIMEOUT_SECONDS)
        fds: list[int] = []
        try:
            order, fds = _receive_order(conn)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(orjson.dumps({"error": str(exc)}) + b"\n")
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_child(conn, fds, order)
            return order
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(orjson.dumps({"pid": pid}) + b"\n")
        except OSError:
            conn.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return None
        self._pid_of[conn] = pid
        self._stand_in_of[pid] = conn
        self._selector.register(conn, selectors.EVENT_READ)
        return None

    def _become_child(self, conn: socket.socket, fds: list[int], order: ForkOrder) -> None:
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sock in (conn, self._listener, self._wake_read, self._wake_write, *self._pid_of):
            sock.close()
        self._selector.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(order.cwd)
        os.environ.clear()
        os.environ.update(order.env)
        random.seed()  # a new process draws its seeds from the OS: so does each forked one
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
                conn.sendall(orjson.dumps(ended) + b"\n")
            conn.close()

    def _stand_in_gone(self, conn: socket.socket) -> None:
        """A stand-in wrote or hung up while its worker runs: it died (or misbehaves), so its
        worker goes too (reaped, and not reported, when it has exited)."""
        pid = self._pid_of.get(conn)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._selector.unregister(conn)

    def _kill_all(self) -> None:
        for pid in list(self._stand_in_of):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._listener.close()
        self.socket_path.unlink(missing_ok=True)


def _ignore(_signum: int, _frame: object) -> None:
    """SIGCHLD wakes the loop through the wakeup descriptor; nothing to do in the handler."""


def _receive_order(conn: socket.socket) -> tuple[ForkOrder, list[int]]:
    """Read one request (a length, JSON, and the stand-in's stdin/stdout/stderr) from `conn`."""
    data, fds, _flags, _address = socket.recv_fds(conn, 65536, 3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request must carry the stand-in's stdin, stdout and stderr")
    try:
        while len(data) < _HEADER.size:
            data += _recv_some(conn)
        (length,) = _HEADER.unpack_from(data)
        if length > MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {length} bytes is over {MAX_REQUEST_BYTES}")
        while len(data) < _HEADER.size + length:
            data += _recv_some(conn)
        request = orjson.loads(data[_HEADER.size:_HEADER.size + length])
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
        if not (isinstance(argv, list) and all(isinstance(arg, str) for arg in argv)):
            raise ValueError("argv must be a list of strings")
        if not (isinstance(env, dict) and all(isinstance(value, str) for value in env.values())):
            raise ValueError("env must map names to strings")
        if not isinstance(cwd, str):
            raise ValueError("cwd must be a string")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return ForkOrder(argv=argv, env=env, cwd=cwd), fds


def _recv_some(conn: socket.socket) -> bytes:
    chunk = conn.recv(65536)
    if not chunk:
        raise ValueError("the stand-in hung up before its request was complete")
    return chunk


def preload(names: Sequence[str]) -> list[str]:
    """Import each module of `names` that is installed; return those imported."""
    loaded = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        loaded.append(name)
    from ..catalog import WorkloadCatalog

    WorkloadCatalog.load()  # imports the installed workloads' modules
    return loaded


def main(argv: Sequence[str] | None = None, *,
         run_worker: Callable[[Sequence[str]], int] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc-worker-zygote", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", type=Path, required=True, help="unix socket to listen on")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parser.add_argument("--preload", default=",".join(PRELOAD),
                        help="comma-separated modules to import before forking")
    args = parser.parse_args(argv)
    from .main import die_with_parent, run

    if not die_with_parent(args.parent_pid):
        return 0
    loaded = preload([name for name in args.preload.split(",") if name])
    zygote = Zygote(args.socket)
    zygote.listen()
    sys.stdout.write(orjson.dumps({"listening": str(args.socket), "pid": os.getpid(),
                                   "preloaded": loaded}).decode() + "\n")
    sys.stdout.flush()
    order = zygote.serve()
    if order is None:
        return 0
    exit_forked((run_worker or run), order)
    return 1  # not reached: exit_forked does not return


def exit_forked(run_worker: Callable[[Sequence[str]], int], order: ForkOrder) -> None:
    """Run the forked worker, then end the process as multiprocessing ends a forked child: the
    exit handlers run and the streams are flushed, but the interpreter is not torn down (with
    torch loaded that takes a second of CPU and copies every page shared with the zygote)."""
    try:
        code = run_worker(order.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a forked worker must never return into the zygote
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
