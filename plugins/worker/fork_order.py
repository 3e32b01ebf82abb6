"""What a worker zygote forks for: a stand-in's request, checked (`parse_order`), and the forked
worker's run to its end (`run_forked`). zygote.py is the loop around them, stand_in.py the other
side of the wire."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from .stand_in import START_UP_ENV

RunWorker = Callable[[Sequence[str]], int]


class RefusedRequest(ValueError):
    """A request the zygote does not fork for (the stand-in starts the worker itself)."""


@dataclass(frozen=True)
class ForkOrder:
    """What a forked child runs: a worker's command line, environment, directory and umask."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    umask: int


def parse_order(data: bytes, fds: list[int], namespaces: dict[str, int]) -> ForkOrder:
    """The order in a request's JSON `data` that came with `fds`, for a zygote in `namespaces`;
    RefusedRequest where it is malformed or a forked worker would not be what the stand-in would
    have started."""
    if len(fds) != 3:
        raise RefusedRequest("a request carries the stand-in's stdin, stdout and stderr")
    try:
        request = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise RefusedRequest(f"a request is one JSON object: {exc}") from exc
    if not isinstance(request, dict):
        raise RefusedRequest("a request is one JSON object")
    argv, env, cwd, umask = (request.get(k) for k in ("argv", "env", "cwd", "umask"))
    if not (isinstance(argv, list) and all(isinstance(arg, str) for arg in argv)):
        raise RefusedRequest("argv must be a list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) and "\0" not in v + k
                                          for k, v in env.items())):
        raise RefusedRequest("env must map names to strings")
    if not isinstance(cwd, str) or not isinstance(umask, int) or not 0 <= umask <= 0o777:
        raise RefusedRequest("cwd must be a string and umask 0 to 0o777")
    if request.get("namespaces") != namespaces:
        raise RefusedRequest("the stand-in is in other namespaces than the zygote")
    differ = [name for name in START_UP_ENV if env.get(name) != os.environ.get(name)]
    if differ:
        raise RefusedRequest(f"the stand-in's {', '.join(differ)} differ from the zygote's")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RefusedRequest("CUDA is initialised in the zygote: forking is not safe")
    return ForkOrder(argv=argv, env=env, cwd=cwd, umask=umask)


def run_forked(run_worker: RunWorker, order: ForkOrder) -> int:
    """Run the forked worker and end it as the interpreter would (wait for its other threads,
    run the exit handlers, flush the streams; the same status for SystemExit and
    KeyboardInterrupt); return the exit code for `os._exit`. The interpreter is not torn down:
    with torch loaded that takes a second of CPU and copies every page shared with the zygote."""
    die_of: int | None = None
    try:
        code = run_worker(order.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            with contextlib.suppress(Exception):
                sys.stderr.write(f"{exc.code}\n")
    except KeyboardInterrupt:
        code, die_of = 1, signal.SIGINT
    except Exception:
        code = 1
        with contextlib.suppress(Exception):
            traceback.print_exc()
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # (what the interpreter calls)
    atexit._run_exitfuncs()  # (prints, and goes past, a handler's error)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if die_of is not None:
        signal.signal(die_of, signal.SIG_DFL)
        os.kill(os.getpid(), die_of)
    return code
