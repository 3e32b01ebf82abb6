"""A donor asked for its state in the middle of a round serves the state after the round (it used
to answer busy, and in a run of fast rounds the peers behind never caught up)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dedloc.daemon.collab import state_sync
from dedloc.daemon.collab.state_sync import StateSharing


class _RunInRound:
    def __init__(self, rounds_left: float | None) -> None:
        self._ends_at = None if rounds_left is None else asyncio.get_running_loop().time() + rounds_left

    @property
    def in_round(self) -> bool:
        return self._ends_at is None or asyncio.get_running_loop().time() < self._ends_at


async def test_a_donor_mid_round_waits_for_the_round_to_end() -> None:
    run: Any = _RunInRound(0.1)
    assert run.in_round
    assert await StateSharing._wait_out_round(run) is True
    assert not run.in_round


async def test_a_round_that_never_ends_is_waited_out_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_sync, "ROUND_WAIT_SECONDS", 0.05)
    run: Any = _RunInRound(None)
    assert await StateSharing._wait_out_round(run) is False
