"""State download: a trainer that is behind (a newcomer, or one whose round failed) takes the
run's latest state from a peer that has it.

The donor exports its worker's full state (parameters, optimizer state, buffers) into shared
memory and streams it in chunks; the receiver loads it into its own worker. Donors are picked at
random among the trainers at the run's epoch, so newcomers spread over them, and a donor streams
to at most `MAX_CONCURRENT_SERVES` peers at once (it refuses more as busy); a donor in the middle of
a round serves the state it steps to, once the round is over. Every step has a
deadline; a failed download is retried after a backoff with another donor (`DonorChoice`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from ..net import Message, PeerTransport, RequestContext, Stream, TransportError
from ..workers.buffers import SharedBuffer
from .errors import DonorBusy, StateSyncError
from .membership import MembershipRegistry, NotAMember

if TYPE_CHECKING:
    from .run import Run

log = structlog.get_logger(__name__)

METHOD = "collab.state"
CHUNK_BYTES = 4 << 20
MAX_STATE_BYTES = 64 << 30
MAX_CONCURRENT_SERVES = 2  # a donor streams its state to at most this many peers at once
BUSY_RETRY_SECONDS = 0.2
ROUND_WAIT_SECONDS = 20.0  # a donor mid-round serves its state after the round, waiting this long
ROUND_POLL_SECONDS = 0.01


@dataclass
class StateSnapshot:
    buffer: SharedBuffer
    numel: int
    meta: dict[str, Any]
    epoch: int


class StateSharing:
    """Serves the state of this daemon's collaborative runs to peers that ask by run key."""

    def __init__(self, transport: PeerTransport, find_run: Callable[[str], Run | None],
                 membership: MembershipRegistry | None = None) -> None:
        self._find_run = find_run
        self._membership = membership
        self.served = 0
        self.refused_busy = 0
        self._serving = 0
        transport.add_stream_handler(METHOD, self._serve)

    async def _serve(self, ctx: RequestContext, stream: Stream) -> None:
        header = getattr(stream, "header", {})
        key = header.get("key")
        if isinstance(key, str) and self._membership is not None:
            try:  # a closed run's state goes to its members only
                self._membership.check_key(ctx.peer_id, key, header.get("token"), "state_download")
            except NotAMember as exc:
                await stream.abort(str(exc))
                return
        run = self._find_run(key) if isinstance(key, str) else None
        if run is None or not (run.active or run.lingering):
            await stream.abort("this peer has no active run of that key")
            return
        if self._serving >= MAX_CONCURRENT_SERVES:
            await self._refuse(stream, "already sending its state to others")
            return
        self._serving += 1
        try:
            # Mid-round, the state is about to move on with the round's step: serve the state
            # after it. Refusing instead (asking again later) never ends in a run whose rounds
            # come faster than the asker's retries: the donor is always in one (seen with fast
            # epochs: peers behind kept asking and never caught up while two others raced on).
            if not await self._wait_out_round(run):
                await self._refuse(stream, "in an averaging round")
                return
            await self._send_state(ctx, stream, run, key)
        finally:
            self._serving -= 1

    async def _refuse(self, stream: Stream, busy: str) -> None:
        self.refused_busy += 1
        await stream.send(Message({"busy": busy, "retry_after": BUSY_RETRY_SECONDS}), timeout=10)
        await stream.close()

    @staticmethod
    async def _wait_out_round(run: Run) -> bool:
        """Wait (at most ROUND_WAIT_SECONDS) for the run to leave its round; True if it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROUND_WAIT_SECONDS
        while run.in_round:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(ROUND_POLL_SECONDS)
        return True

    async def _send_state(self, ctx: RequestContext, stream: Stream, run: Run, key: str) -> None:
        exported = await run.export_state()
        try:
            await stream.send(Message({"meta": exported.meta, "numel": exported.numel,
                                       "epoch": exported.epoch}), timeout=30)
            view = memoryview(exported.buffer.array).cast("B")[: exported.numel * 4]
            try:
                for offset in range(0, len(view), CHUNK_BYTES):
                    await stream.send(Message({"o": offset}, view[offset:offset + CHUNK_BYTES]),
                                      timeout=120)
            finally:
                view.release()
            await stream.close()
            self.served += 1
            log.info("state_served", peer=ctx.peer_id[:12], run=key, epoch=exported.epoch)
        finally:
            exported.buffer.close()


async def download_state(transport: PeerTransport, donor: str, key: str,
                         token: str | None = None) -> StateSnapshot:
    """Fetch a run's state from `donor` (a closed run's with our membership `token`);
    StateSyncError (and nothing half-loaded) on failure."""
    header = {"key": key} if token is None else {"key": key, "token": token}
    try:
        stream = await transport.open_stream(donor, METHOD, header, timeout=15)
        first = await stream.receive(timeout=60)
    except (TransportError, TimeoutError) as exc:
        raise StateSyncError(f"state download from {donor[:12]} failed: {exc}") from exc
    if first is not None and "busy" in first.header:
        await stream.abort("busy")
        raise DonorBusy(f"{donor[:12]} is busy ({first.header['busy']}); ask again shortly")
    if first is None or not isinstance(first.header.get("numel"), int):
        raise StateSyncError(f"{donor[:12]} sent no state header")
    numel, epoch, meta = first.header["numel"], first.header.get("epoch"), first.header.get("meta")
    if not 0 < numel * 4 <= MAX_STATE_BYTES or not isinstance(epoch, int) or not isinstance(meta, dict):
        raise StateSyncError(f"{donor[:12]} sent a malformed state header")
    buffer = SharedBuffer(numel)
    view = memoryview(buffer.array).cast("B")
    try:
        received = 0
        while received < len(view):
            message = await stream.receive(timeout=120)
            if message is None:
                raise StateSyncError(f"{donor[:12]} closed the stream after {received} bytes")
            payload = memoryview(message.payload).cast("B")
            if message.header.get("o") != received or received + len(payload) > len(view):
                raise StateSyncError(f"{donor[:12]} sent a chunk out of place")
            view[received:received + len(payload)] = payload
            received += len(payload)
    except (TransportError, TimeoutError, StateSyncError) as exc:
        view.release()
        buffer.close()
        raise StateSyncError(f"state download from {donor[:12]} failed: {exc}") from exc
    view.release()
    return StateSnapshot(buffer, numel, meta, epoch)


@dataclass
class DonorChoice:
    """Which peer to download the state from: a random one among those at the run's epoch (so
    newcomers spread over the donors), skipping donors that failed in the last `avoid_seconds`,
    and waiting `backoff` seconds (doubling per failure in a row, at most `max_backoff`) after a
    failure before trying again."""

    avoid_seconds: float = 60.0
    backoff: float = 0.5
    max_backoff: float = 30.0
    rng: random.Random = field(default_factory=random.Random)
    _failed_at: dict[str, float] = field(default_factory=dict)
    _failures_in_a_row: int = 0
    _not_before: float = 0.0

    def pick(self, donors: list[str], now: float) -> str | None:
        if now < self._not_before or not donors:
            return None
        fresh = [d for d in donors if now - self._failed_at.get(d, float("-inf")) >= self.avoid_seconds]
        if not fresh:  # every donor failed lately: the one that failed longest ago
            fresh = [min(donors, key=lambda d: self._failed_at[d])]
        return self.rng.choice(sorted(fresh))

    def failed(self, donor: str, now: float) -> None:
        self._failed_at[donor] = now
        self._failures_in_a_row += 1
        self._not_before = now + self.wait(now)

    def wait(self, now: float) -> float:
        """Seconds to wait after the current run of failures."""
        if self._failures_in_a_row == 0:
            return 0.0
        # the exponent is bounded: 2 ** 1024 no longer converts to a float (OverflowError after
        # 1024 failures in a row), and the cap is reached long before
        doublings = min(self._failures_in_a_row - 1, 1000)
        return min(self.max_backoff, self.backoff * 2.0 ** doublings)

    def succeeded(self) -> None:
        self._failures_in_a_row = 0
        self._not_before = 0.0
