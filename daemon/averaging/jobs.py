"""Numpy work on chunks, off the event loop when it is big enough to be worth a thread hop.

`ChunkJobs.submit` runs a function inline for chunks under `inline_elements` (a thread hop costs
~60 us on 2 cores) and in the shared pool otherwise, and gives its outcome as an asyncio future.
Callers await those futures shielded: a job that started always finishes, so bookkeeping done in
its callbacks stays right even when the awaiting task is cancelled. `drain()` waits for the jobs
still running before a round returns, so no thread touches the caller's vector afterwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (whoever needed it has handled it)."""
    if not future.cancelled():
        future.exception()


class ChunkJobs:
    def __init__(self, pool: concurrent.futures.Executor, inline_elements: int) -> None:
        self.pool = pool
        self.inline_elements = inline_elements
        self.loop = asyncio.get_running_loop()
        self._running: list[concurrent.futures.Future[Any]] = []

    def submit(self, size: int, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """fn(*args) for a chunk of `size` elements; its result (or exception) as a future."""
        if size < self.inline_elements:
            future: asyncio.Future[T] = self.loop.create_future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # delivered to whoever awaits the future
                future.set_exception(exc)
        else:
            job = self.pool.submit(fn, *args)
            if len(self._running) > 64:
                self._running = [j for j in self._running if not j.done()]
            self._running.append(job)
            future = asyncio.wrap_future(job, loop=self.loop)
        future.add_done_callback(retrieve)
        return future

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.shield(self.submit(size, fn, *args))

    async def drain(self) -> None:
        """Wait for the jobs still running (they take milliseconds), even if cancelled meanwhile."""
        cancelled = False
        while pending := [job for job in self._running if not job.done()]:
            waiters = [asyncio.wrap_future(job, loop=self.loop) for job in pending]
            for waiter in waiters:
                waiter.add_done_callback(retrieve)
            try:
                await asyncio.wait(waiters)
            except asyncio.CancelledError:
                cancelled = True
        self._running.clear()
        if cancelled:
            raise asyncio.CancelledError
