"""State download: a trainer that is behind (a newcomer, or one whose round failed) takes the
run's latest state from a peer that has it.

The donor exports its trainer's full state (parameters, optimizer state, buffers) and streams it
in chunks, with the head (epoch and lineage) it is at; the receiver loads it into its own
trainer. Donors are picked at random among the trainers at the run's head, so newcomers spread
over them, and a donor streams to at most `MAX_CONCURRENT_SERVES` peers at once (it refuses more
as busy); a donor in the middle of a round serves the state it steps to, once the round is over
(it awaits its engine's phase). Every step has a deadline; a failed download is retried after a
backoff with another donor (`DonorChoice`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ..net import Message, PeerTransport, RequestContext, Stream, TransportError
from ..workers.buffers import SharedBuffer
from .engine import IN_ROUND
from .errors import DonorBusy, StateSyncError
from .lineage import is_lineage
from .membership import MembershipRegistry, NotAMember
from .ports import DownloadedState, StateBuffer

if TYPE_CHECKING:
    from .engine import RunEngine

log = structlog.get_logger(__name__)

METHOD = "collab.state"
CHUNK_BYTES = 4 << 20
MAX_STATE_BYTES = 64 << 30
MAX_CONCURRENT_SERVES = 2  # a donor streams its state to at most this many peers at once
BUSY_RETRY_SECONDS = 0.2
MAX_GROUP = 1024  # peer ids of the round that made the state's head, at most
MAX_PEER_ID = 128
ROUND_WAIT_SECONDS = 20.0  # a donor mid-round serves its state after the round, waiting this long


class StateSharing:
    """Serves the state of this daemon's collaborative runs (their engines, found by run key)
    to peers that ask."""

    def __init__(self, transport: PeerTransport, find_run: Callable[[str], RunEngine | None],
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
        if run is None or run.trainer is None or run.stopping:
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
            if not await run.phase.wait_until(lambda phase: phase not in IN_ROUND,
                                              timeout=ROUND_WAIT_SECONDS):
                await self._refuse(stream, "in an averaging round")
                return
            await self._send_state(ctx, stream, run, key)
        finally:
            self._serving -= 1

    async def _refuse(self, stream: Stream, busy: str) -> None:
        self.refused_busy += 1
        await stream.send(Message({"busy": busy, "retry_after": BUSY_RETRY_SECONDS}), timeout=10)
        await stream.close()

    async def _send_state(self, ctx: RequestContext, stream: Stream, run: RunEngine, key: str) -> None:
        exported = await run.export_state()
        try:
            await stream.send(Message({"meta": exported.meta, "numel": exported.numel,
                                       "epoch": exported.epoch, "lineage": exported.lineage,
                                       "group": list(exported.group[:MAX_GROUP])}),
                              timeout=30)
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


async def download_state(transport: PeerTransport, donor: str, key: str, token: str | None = None,
                         *, allocate: Callable[[int], StateBuffer] = SharedBuffer) -> DownloadedState:
    """Fetch a run's state from `donor` (a closed run's with our membership `token`) into a
    buffer of `allocate(numel)`; StateSyncError (and nothing half-loaded) on failure."""
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
    lineage, group = first.header.get("lineage"), first.header.get("group", [])
    if not 0 < numel * 4 <= MAX_STATE_BYTES or not isinstance(epoch, int) or epoch < 0 \
            or not isinstance(meta, dict) or not (lineage is None or is_lineage(lineage)) \
            or not isinstance(group, list) or len(group) > MAX_GROUP \
            or not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in group):
        raise StateSyncError(f"{donor[:12]} sent a malformed state header")
    buffer = allocate(numel)
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
    return DownloadedState(buffer, numel, meta, epoch, lineage, tuple(group))


class NetworkStates:
    """The `StateSource` of a collaborative run: downloads over the node's transport, into
    buffers of `allocate` (shared memory, for a worker to load)."""

    def __init__(self, transport: PeerTransport, membership: MembershipRegistry, key: str,
                 allocate: Callable[[int], StateBuffer] = SharedBuffer) -> None:
        self.transport = transport
        self.membership = membership
        self.key = key
        self.allocate = allocate

    async def download(self, donor: str) -> DownloadedState:
        return await download_state(self.transport, donor, self.key,
                                    self.membership.credential(self.key), allocate=self.allocate)
