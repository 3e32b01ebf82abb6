"""A worker's stand-in: the process a daemon started, when a worker zygote forks the real worker.

With `DEDLOC_WORKER_ZYGOTE=PATH` in its environment, `dedloc-worker` sends its command line,
environment, working directory, umask and namespaces, and its stdin, stdout and stderr
(SCM_RIGHTS), to the zygote listening at PATH (zygote.py), which forks the worker. The zygote
answers with the worker's pid and a pidfd for it, and later with how it ended. Meanwhile the
stand-in forwards SIGTERM, SIGINT and SIGHUP to the worker (through the pidfd: never to a reused
pid), and when the worker ends it exits with the same status, or dies of the same signal. Where
the zygote goes away first, the stand-in kills the worker and waits until it is gone. Where the
stand-in is killed, the zygote kills the worker.

The wire, on a unix stream socket: the stand-in sends a 4-byte big-endian length and a JSON object
(`argv`, `env`, `cwd`, `umask`, `namespaces`) with its three descriptors; the zygote answers one
JSON line `{"pid": N}` with the pidfd (or `{"error": "..."}`), then, when the worker ends, one line
`{"exit_code": N}` or `{"signal": N}`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

import orjson

MAX_REQUEST_BYTES = 1 << 20
MAX_ANSWER_BYTES = 4096
CONNECT_TIMEOUT_SECONDS = 10.0
# after the zygote vanished: how long the worker may take to die of SIGKILL
KILL_WAIT_SECONDS = 30.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
HEADER = struct.Struct(">I")
# Read once, at interpreter or library start: a forked worker keeps the zygote's, so the zygote
# refuses a stand-in whose values differ (it then starts the worker itself).
START_UP_ENV = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONSAFEPATH",
                "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD",
                "LD_LIBRARY_PATH")
# connecting failed this way: no zygote listens (yet); the worker starts itself without a word
NOT_LISTENING = (errno.ENOENT, errno.ECONNREFUSED)


class ZygoteUnavailable(Exception):
    """No worker was forked (no zygote, or it refused): the caller starts the worker itself.
    `quiet`: nothing listens at the path, which is not worth a log line."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def namespaces() -> dict[str, int]:
    """The inodes of this process's network and mount namespaces (a forked worker lives in the
    zygote's: it forks only for stand-ins in the same ones)."""
    found = {}
    for kind in ("net", "mnt"):
        with contextlib.suppress(OSError):
            found[kind] = os.stat(f"/proc/self/ns/{kind}").st_ino
    return found


def current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def run_through_zygote(socket_path: str, argv: Sequence[str]) -> int:
    """Have the zygote at `socket_path` fork `dedloc-worker argv` and stand in for it until it
    ends; return its exit code (or die of the signal it died of). Raises ZygoteUnavailable where
    no worker was forked."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_SECONDS)
    try:
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise ZygoteUnavailable(f"no worker zygote at {socket_path}: {exc}",
                                    quiet=exc.errno in NOT_LISTENING) from exc
        request = orjson.dumps({"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(),
                                "umask": current_umask(), "namespaces": namespaces()})
        message = HEADER.pack(len(request)) + request
        try:
            sent = socket.send_fds(sock, [message], [0, 1, 2])
            if sent < len(message):
                # (not when all is sent: a zygote that refused at once may have hung up, and
                # even an empty send to it fails with EPIPE before its answer is read)
                with contextlib.suppress(BrokenPipeError):
                    sock.sendall(message[sent:])
            started, pidfd, rest = _first_answer(sock)
        except (OSError, ValueError) as exc:
            raise ZygoteUnavailable(f"the worker zygote at {socket_path} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    if pidfd is None:
        sock.close()
        raise ZygoteUnavailable(f"the worker zygote at {socket_path} refused: "
                                f"{started.get('error', 'no pidfd')}")
    return _stand_in(sock, pidfd, rest)


def _first_answer(sock: socket.socket) -> tuple[dict[str, Any], int | None, bytes]:
    """The zygote's first line, the pidfd that came with it, and whatever followed it."""
    data = b""
    received: list[int] = []
    while b"\n" not in data:
        chunk, fds, _flags, _address = socket.recv_fds(sock, MAX_ANSWER_BYTES, 1)
        received += fds
        if not chunk or len(data) + len(chunk) > MAX_ANSWER_BYTES:
            for fd in received:
                os.close(fd)
            raise ValueError("the zygote closed the connection or sent too much")
        data += chunk
    line, _, rest = data.partition(b"\n")
    answer = orjson.loads(line)
    if not isinstance(answer, dict) or ("pid" in answer) != (len(received) == 1):
        for fd in received:
            os.close(fd)
        if isinstance(answer, dict) and "error" in answer:
            return answer, None, b""
        raise ValueError("the zygote's answer is not a pid with its pidfd")
    return answer, (received[0] if received else None), rest


def _stand_in(sock: socket.socket, pidfd: int, rest: bytes) -> int:
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    sock.settimeout(None)  # the worker runs as long as it runs; the zygote says when it ends
    ended = _last_answer(sock, rest)
    sock.close()
    if ended is None:  # the zygote is gone: the worker must not outlive us
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        with contextlib.suppress(InterruptedError):
            select.select([pidfd], [], [], KILL_WAIT_SECONDS)  # readable once it has exited
        ended = {"signal": int(signal.SIGKILL)}
    os.close(pidfd)
    if "signal" in ended:
        signum = int(ended["signal"])
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum
    code = ended.get("exit_code", 1)
    return code if isinstance(code, int) else 1


def _last_answer(sock: socket.socket, data: bytes) -> dict[str, Any] | None:
    """The zygote's line on how the worker ended; None when the zygote hung up without one."""
    while b"\n" not in data:
        try:
            chunk = sock.recv(MAX_ANSWER_BYTES)
        except OSError:
            return None
        if not chunk or len(data) > MAX_ANSWER_BYTES:
            return None
        data += chunk
    try:
        answer = orjson.loads(data.partition(b"\n")[0])
    except orjson.JSONDecodeError:
        return None
    return answer if isinstance(answer, dict) else None


def note(event: str, reason: str) -> None:
    """One JSON log line on stderr, as the worker's own (structlog is not configured yet)."""
    sys.stderr.write(orjson.dumps({"event": event, "reason": reason, "level": "info"}).decode()
                     + "\n")
    sys.stderr.flush()
