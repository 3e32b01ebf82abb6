"""What the exchanges after a round share (accusations.py, answers.py, audits.py): one unary
method served, the rounds remembered for it (by group id, the newest last, at most `limit`), and
calls to other members made in the background, which `close` stops."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

import structlog

from ..net import PeerTransport
from ..net.interface import UnaryHandler
from .bans import BanList

log = structlog.get_logger(__name__)

T = TypeVar("T")


class RoundCalls(Generic[T]):
    def __init__(self, transport: PeerTransport, bans: BanList, counters: collections.Counter[str],
                 method: str, handler: UnaryHandler, limit: int) -> None:
        self.transport = transport
        self.bans = bans
        self.counters = counters
        self._rounds: collections.OrderedDict[str, T] = collections.OrderedDict()
        self._limit = limit
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._log = log.bind(peer_id=transport.peer_id)
        transport.add_unary_handler(method, handler)

    def _keep(self, group_id: str, value: T) -> None:
        self._rounds[group_id] = value
        while len(self._rounds) > self._limit:
            self._rounds.popitem(last=False)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._closed:  # (a call handled while the service closed: nothing starts after it)
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Stop the calls under way (the service is closing), and start no more."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
