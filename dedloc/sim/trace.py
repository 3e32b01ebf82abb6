"""A trace of every callback a simulation's loop runs, to find where two runs of one seed part.

A simulation is meant to be one run per seed: virtual time, seeded randomness, executors run
inline and `PYTHONHASHSEED=0` (`__main__`). Where two runs of one command still differ, the first
line where their traces differ names the task and the line of code that ran in another order, or
saw another value: `python -m dedloc.sim ... --trace FILE` twice, then `cmp` the files and read
around the first difference.

Each line is the loop's time, the task's name (`Task-N` counts creations, so it is the same in
two runs that created tasks in the same order) and where each coroutine of its await chain stands
(`function:line`, outermost first), or the callback's qualified name where it is not a task's.
"""

from __future__ import annotations

import asyncio
import asyncio.events
import contextlib
from collections.abc import Iterator
from types import CoroutineType, GeneratorType
from typing import IO, Any

__all__ = ["tracing"]


def _chain(coro: Any) -> str:
    """`function:line` of each coroutine in the await chain from `coro`, outermost first."""
    steps: list[str] = []
    while isinstance(coro, CoroutineType | GeneratorType):
        frame = coro.cr_frame if isinstance(coro, CoroutineType) else coro.gi_frame
        if frame is None:
            break
        steps.append(f"{frame.f_code.co_qualname}:{frame.f_lineno}")
        coro = coro.cr_await if isinstance(coro, CoroutineType) else coro.gi_yieldfrom
    return ">".join(steps)


def describe(handle: asyncio.Handle) -> str:
    """What `handle` will run: a task's name and await chain, or the callback's name."""
    callback = getattr(handle, "_callback", None)
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        return f"{owner.get_name()} {_chain(owner.get_coro())}"
    return getattr(callback, "__qualname__", type(callback).__qualname__)


@contextlib.contextmanager
def tracing(out: IO[str]) -> Iterator[None]:
    """Write a line to `out` for each callback any loop runs while this is entered (the loop's
    own handles included). Slow (a line per callback): for finding divergences, not for runs."""
    original = asyncio.events.Handle._run

    def run(handle: asyncio.Handle) -> None:
        loop = getattr(handle, "_loop", None)
        when = loop.time() if loop is not None else 0.0
        out.write(f"{when!r} {describe(handle)}\n")
        original(handle)

    asyncio.events.Handle._run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        asyncio.events.Handle._run = original  # type: ignore[method-assign]
