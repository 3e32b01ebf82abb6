"""State download: a trainer that is behind (a newcomer, or one whose round failed) takes the
run's latest state from a peer that has it.

The donor exports its trainer's full state (parameters, optimizer state, buffers) and streams it
in chunks, with the head (epoch and lineage) it is at; the receiver loads it into its own
trainer. Donors are picked at random among the trainers at the run's head, so newcomers spread
over them, and a donor streams to at most `MAX_CONCURRENT_SERVES` peers at once (it refuses more
as busy); a donor in the middle of a round serves the state it steps to, once the round is over
(it awaits its engine's phase). Every step has a deadline; a failed download is retried after a
backoff with another donor (`DonorChoice`).

A flash crowd: newcomers pick donors by the download counts the donors publish (donors.py), and
those are seconds old when dozens of newcomers arrive at once, so one donor could serve several
of them back to back while others served none (64 peers, 50 joining in 4 s: one donor served 4
of 73 downloads, 3 times the mean). So a receiver says how many other donors it could ask
(`others` in its request), and a donor that served `RECENT_SERVES` downloads in the last
`RECENT_SERVE_SECONDS` (those under way count; requests that ended early do not: a stranger's
aborted requests would shed everyone) sheds a request that has others to ask: it answers busy,
with when it will take one again, and the receiver asks another meanwhile (so does a donor
serving `MAX_CONCURRENT_SERVES`, for `FULL_RETRY_SECONDS`: the receiver then tries the donors
that shed it for recent serves, saying it has no others, before this one). A receiver with no other donor
(`others` 0, or a peer of an earlier version that does not say) is served as before, within
`MAX_CONCURRENT_SERVES`: shedding never leaves a newcomer without a donor, and a receiver that
understates its options only gets what it got before.

Before a receiver loads a state, it asks witnesses at the same head for a sketch of their
parameters under a seed of its own (`SKETCH_METHOD`, state_check.py); a state they refute is not
loaded. A peer answers `MAX_CONCURRENT_SKETCHES` at a time and one per asking peer every
`SKETCH_INTERVAL` seconds (each costs it an export of its state).

Both ends bound what a stranger can make them hold. A donor serves one stream per asking peer
and cuts a stream slower than `MIN_SERVE_RATE` over the whole state (32 KiB/s, far below a home
uplink shared by two readers: two readers that read a byte a second no longer keep a donor busy
for hours). A receiver allocates only what its own model can need (`max_numel`, from the run's
parameter count) and, into shared memory, never more than is free there (a header announcing
more would end the daemon with SIGBUS); it gives up on a donor slower than the same rate.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import secrets
from collections.abc import Callable

import numpy as np
import structlog

from .. import timebase
from ..net import Message, PeerTransport, RequestContext, Stream, TransportError
from ..workers.buffers import SharedBuffer
from .engine import IN_ROUND
from .errors import DonorBusy, DonorContradicted, LocalStateError, StateSyncError
from .estimate import Head
from .lineage import is_lineage
from .membership import MembershipRegistry, NotAMember
from .ports import DownloadedState, StateBuffer, StateDonor
from .state_check import MAX_SEED, SKETCH_BUCKETS, TOLERANCE, sketch, sketch_distance

log = structlog.get_logger(__name__)

METHOD = "collab.state"
CHUNK_BYTES = 4 << 20
MAX_STATE_BYTES = 64 << 30
MAX_CONCURRENT_SERVES = 2  # a donor streams its state to at most this many peers at once
BUSY_RETRY_SECONDS = 0.2
RECENT_SERVES = 2  # downloads served within RECENT_SERVE_SECONDS (or under way) after which ...
RECENT_SERVE_SECONDS = 10.0  # ... a donor sheds a request whose receiver has other donors to ask
FULL_RETRY_SECONDS = 1.0  # a donor serving MAX_CONCURRENT_SERVES sheds for this long
MAX_OTHERS = 1 << 16  # (a receiver's `others` past this is taken as this)
MAX_GROUP = 1024  # peer ids of the round that made the state's head, at most
MAX_PEER_ID = 128
ROUND_WAIT_SECONDS = 20.0  # a donor mid-round serves its state after the round, waiting this long
MIN_SERVE_RATE = 32 << 10  # bytes/s over a whole transfer, both ways; slower streams are cut
SERVE_GRACE_SECONDS = 60.0  # on top of the state's size at MIN_SERVE_RATE
STATE_SLOTS_PER_PARAMETER = 8  # a state holds the parameters, an optimizer's slots and buffers
STATE_EXTRA_ELEMENTS = 1 << 20  # (scalars, small buffers)
SHARED_MEMORY = "/dev/shm"
SKETCH_METHOD = "collab.sketch"
SKETCH_INTERVAL = 1.0  # seconds between two sketches for one asking peer
MAX_CONCURRENT_SKETCHES = 2
SKETCH_ROUND_WAIT = 5.0  # a witness mid-round answers once the round is over, waiting this long
SKETCH_SECONDS = 120.0  # the longest a receiver waits for a witness's sketch
MAX_SKETCH_ASKERS = 4096  # asking peers whose last sketch time is remembered


def transfer_seconds(numel: int) -> float:
    """The longest a state transfer of `numel` float32 may take, either end."""
    return SERVE_GRACE_SECONDS + numel * 4 / MIN_SERVE_RATE


def max_state_numel(parameters: int) -> int:
    """The most elements a run's state can have for a model of `parameters` elements."""
    return STATE_SLOTS_PER_PARAMETER * parameters + STATE_EXTRA_ELEMENTS


def shared_memory_free() -> int | None:
    """Bytes free in the shared-memory filesystem (None where there is none to ask)."""
    try:
        stats = os.statvfs(SHARED_MEMORY)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


class StateSharing:
    """Serves the state of this daemon's collaborative runs (their engines, found by run key)
    to peers that ask."""

    def __init__(self, transport: PeerTransport, find_run: Callable[[str], StateDonor | None],
                 membership: MembershipRegistry | None = None) -> None:
        self._find_run = find_run
        self._membership = membership
        self.served = 0
        self.refused_busy = 0
        self.shed = 0  # requests sent to another donor: we served RECENT_SERVES lately
        # when our last downloads were served in full (a request that ended early, refused or
        # aborted, is not counted: a stranger's two aborted requests would shed everyone)
        self._served_at: collections.deque[float] = collections.deque(maxlen=RECENT_SERVES)
        self.cut_slow = 0  # streams cut for reading slower than MIN_SERVE_RATE
        self._serving: set[str] = set()  # the peers being served (one stream each)
        self.sketched = 0
        self.refused_sketches = 0
        self._sketching = 0
        self._sketched_for: collections.OrderedDict[str, float] = collections.OrderedDict()
        transport.add_stream_handler(METHOD, self._serve)
        transport.add_unary_handler(SKETCH_METHOD, self._sketch)

    async def _sketch(self, ctx: RequestContext, message: Message) -> Message:
        """A witness's answer: the sketch of this peer's parameters under the asker's seed, if it
        is at the head the asker names; otherwise only the head it is at."""
        header = message.header
        key, seed, count = header.get("key"), header.get("seed"), header.get("count")
        if not isinstance(key, str) or isinstance(seed, bool) or not isinstance(seed, int) \
                or not 0 <= seed <= MAX_SEED or isinstance(count, bool) or not isinstance(count, int) \
                or count <= 0:
            self.refused_sketches += 1
            raise StateSyncError("a sketch request needs a run key, a seed in [0, 2**63) and a "
                                 "positive count")
        if self._membership is not None:  # a closed run's witnesses answer its members only
            try:
                self._membership.check_key(ctx.peer_id, key, header.get("token"), "state_download")
            except NotAMember:
                self.refused_sketches += 1
                raise
        run = self._find_run(key)
        if run is None or not run.holds_state:
            raise StateSyncError("this peer has no active run of that key")
        now = timebase.monotonic()
        last = self._sketched_for.get(ctx.peer_id)
        if self._sketching >= MAX_CONCURRENT_SKETCHES \
                or (last is not None and now - last < SKETCH_INTERVAL):
            self.refused_sketches += 1
            raise DonorBusy("busy with another sketch, or asked by this peer moments ago")
        self._sketching += 1
        self._sketched_for[ctx.peer_id] = now
        self._sketched_for.move_to_end(ctx.peer_id)
        while len(self._sketched_for) > MAX_SKETCH_ASKERS:
            self._sketched_for.popitem(last=False)
        try:
            # mid-round its parameters are about to move on: answer with the state after the step
            if not await run.phase.wait_until(lambda phase: phase not in IN_ROUND,
                                              timeout=SKETCH_ROUND_WAIT):
                raise DonorBusy("in an averaging round")
            exported = await run.export_state()
            try:
                head = {"epoch": exported.epoch, "lineage": exported.lineage}
                if header.get("epoch") != exported.epoch or header.get("lineage") != exported.lineage:
                    return Message(head)
                if count > exported.numel:
                    raise StateSyncError(f"this peer's state has {exported.numel} values, fewer "
                                         f"than the {count} asked for")
                values = exported.buffer.array[:count]
                found = await asyncio.to_thread(sketch, values, seed)
            finally:
                exported.buffer.close()
        finally:
            self._sketching -= 1
        self.sketched += 1
        return Message({**head, "sketch": [float(v) for v in found]})

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
        if run is None or not run.holds_state:
            await stream.abort("this peer has no active run of that key")
            return
        if ctx.peer_id in self._serving:
            await self._refuse(stream, "already sending its state to this peer")
            return
        others = header.get("others")
        has_others = isinstance(others, int) and not isinstance(others, bool) and others > 0
        if len(self._serving) >= MAX_CONCURRENT_SERVES:
            self.shed += has_others
            await self._refuse(stream, "already sending its state to others",
                               retry_after=FULL_RETRY_SECONDS if has_others else None)
            return
        shed_for = self._shed_for() if has_others else 0.0
        if shed_for > 0:
            self.shed += 1
            await self._refuse(stream, f"served {RECENT_SERVES} peers in the last "
                               f"{RECENT_SERVE_SECONDS:g} s: ask another donor", retry_after=shed_for)
            return
        self._serving.add(ctx.peer_id)
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
            self._serving.discard(ctx.peer_id)

    def _shed_for(self) -> float:
        """Seconds until this donor takes a request whose receiver has other donors to ask (0:
        now): once the downloads it served in the last RECENT_SERVE_SECONDS and those under way
        are RECENT_SERVES, until the oldest of those served is that old."""
        now = timebase.monotonic()
        recent = [at for at in self._served_at if now - at < RECENT_SERVE_SECONDS]
        if not recent or len(recent) + len(self._serving) < RECENT_SERVES:
            return 0.0
        return recent[0] + RECENT_SERVE_SECONDS - now

    async def _refuse(self, stream: Stream, busy: str, retry_after: float | None = None) -> None:
        self.refused_busy += 1
        header: dict[str, object] = {"busy": busy, "retry_after": BUSY_RETRY_SECONDS}
        if retry_after is not None:
            header.update(retry_after=round(retry_after, 3), shed=True)
        await stream.send(Message(header), timeout=10)
        await stream.close()

    async def _send_state(self, ctx: RequestContext, stream: Stream, run: StateDonor, key: str) -> None:
        exported = await run.export_state()
        try:
            await stream.send(Message({"meta": exported.meta, "numel": exported.numel,
                                       "epoch": exported.epoch, "lineage": exported.lineage,
                                       "group": list(exported.group[:MAX_GROUP])}),
                              timeout=30)
            view = memoryview(exported.buffer.array).cast("B")[: exported.numel * 4]
            try:
                async with asyncio.timeout(transfer_seconds(exported.numel)):
                    for offset in range(0, len(view), CHUNK_BYTES):
                        await stream.send(Message({"o": offset}, view[offset:offset + CHUNK_BYTES]),
                                          timeout=120)
            except TimeoutError:
                self.cut_slow += 1
                log.warning("state_serve_too_slow", peer=ctx.peer_id[:12], run=key,
                            bytes=len(view), min_rate=MIN_SERVE_RATE)
                await stream.abort(f"slower than {MIN_SERVE_RATE} B/s: cut off")
                return
            finally:
                view.release()
            await stream.close()
            self.served += 1
            self._served_at.append(timebase.monotonic())
            run.progress.states_served += 1
            log.info("state_served", peer=ctx.peer_id[:12], run=key, epoch=exported.epoch)
        finally:
            exported.buffer.close()


async def download_state(transport: PeerTransport, donor: str, key: str, token: str | None = None,
                         *, allocate: Callable[[int], StateBuffer] = SharedBuffer,
                         max_numel: int = MAX_STATE_BYTES // 4,
                         free_bytes: Callable[[], int | None] = shared_memory_free,
                         expect: Head | None = None, others: int = 0) -> DownloadedState:
    """Fetch a run's state from `donor` (a closed run's with our membership `token`) into a
    buffer of `allocate(numel)`, refusing a header of more than `max_numel` elements or than
    `free_bytes()` can hold; StateSyncError (and nothing half-loaded) on failure.
    `expect`: the head the donor reported; a header behind it or beside it (its epoch on another
    lineage) is refused before the state is downloaded (DonorContradicted: a donor's state only
    moves on from what it reported; before, the whole state came first, and a trainer whose round
    was forming spent that time on the state of an identity lying about its head, and missed the
    round). `others`: how many other donors we could ask (a donor that served others lately
    sheds the request if there are some: DonorBusy with `shed`)."""
    header: dict[str, object] = {"key": key} if token is None else {"key": key, "token": token}
    if others > 0:
        header["others"] = min(others, MAX_OTHERS)
    try:
        stream = await transport.open_stream(donor, METHOD, header, timeout=15)
        first = await stream.receive(timeout=60)
    except (TransportError, TimeoutError) as exc:
        raise StateSyncError(f"state download from {donor[:12]} failed: {exc}") from exc
    if first is not None and "busy" in first.header:
        await stream.abort("busy")
        retry_after = first.header.get("retry_after")
        retry_after = float(retry_after) if isinstance(retry_after, int | float) \
            and not isinstance(retry_after, bool) and 0 <= retry_after <= RECENT_SERVE_SECONDS \
            else BUSY_RETRY_SECONDS  # (a donor's word: bounded; NaN fails the comparison too)
        raise DonorBusy(f"{donor[:12]} is busy ({str(first.header['busy'])[:200]}); ask again "
                        "shortly", shed=first.header.get("shed") is True and others > 0,
                        retry_after=retry_after)
    if first is None or not isinstance(first.header.get("numel"), int):
        raise StateSyncError(f"{donor[:12]} sent no state header")
    numel, epoch, meta = first.header["numel"], first.header.get("epoch"), first.header.get("meta")
    lineage, group = first.header.get("lineage"), first.header.get("group", [])
    if not 0 < numel * 4 <= MAX_STATE_BYTES or not isinstance(epoch, int) or epoch < 0 \
            or not isinstance(meta, dict) or not (lineage is None or is_lineage(lineage)) \
            or not isinstance(group, list) or len(group) > MAX_GROUP \
            or not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in group):
        await stream.abort("malformed header")
        raise StateSyncError(f"{donor[:12]} sent a malformed state header")
    if expect is not None and (epoch < expect.epoch
                               or (epoch == expect.epoch and lineage != expect.lineage)):
        await stream.abort("not the head you reported")
        raise DonorContradicted(f"the donor reported the run's head (epoch {expect.epoch}) but "
                                f"offered a state at epoch {epoch}, lineage {lineage}")
    free = free_bytes()
    if numel > max_numel:  # (an honest donor's state is the size of our model's)
        await stream.abort("state too large")
        raise StateSyncError(f"{donor[:12]} announced a state of {numel} elements, more than "
                             f"{max_numel} elements for this model: refused before allocating it")
    if free is not None and numel * 4 > free:
        await stream.abort("no room for the state")
        raise LocalStateError(f"the run's state ({numel * 4} bytes) does not fit in this "
                              f"machine's free shared memory ({free} bytes): free some, or give "
                              "/dev/shm more room (e.g. docker run --shm-size)")
    buffer = allocate(numel)
    view = memoryview(buffer.array).cast("B")
    try:
        received = 0
        async with asyncio.timeout(transfer_seconds(numel)):  # a donor that trickles is left
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
        await stream.abort("download failed")
        view.release()
        buffer.close()
        raise StateSyncError(f"state download from {donor[:12]} failed: {exc}") from exc
    view.release()
    return DownloadedState(buffer, numel, meta, epoch, lineage, tuple(group))


class NetworkStates:
    """The `StateSource` of a collaborative run: downloads over the node's transport, into
    buffers of `allocate` (shared memory, for a worker to load)."""

    def __init__(self, transport: PeerTransport, membership: MembershipRegistry, key: str,
                 allocate: Callable[[int], StateBuffer] = SharedBuffer,
                 parameters: int | None = None, rng: random.Random | None = None) -> None:
        self.transport = transport
        self.parameters = parameters
        self.rng = rng  # the witnesses' seeds (the simulator's are seeded; by default: secrets)
        self.membership = membership
        self.key = key
        self.allocate = allocate
        self.max_numel = MAX_STATE_BYTES // 4 if parameters is None else max_state_numel(parameters)
        # (the free shared memory bounds only what goes there; the simulator's buffers do not)
        self.free_bytes = shared_memory_free if allocate is SharedBuffer else (lambda: None)

    async def download(self, donor: str, expect: Head | None = None,
                       others: int = 0) -> DownloadedState:
        return await download_state(self.transport, donor, self.key,
                                    self.membership.credential(self.key), allocate=self.allocate,
                                    max_numel=self.max_numel, free_bytes=self.free_bytes,
                                    expect=expect, others=others)

    async def witness(self, peer: str, state: DownloadedState) -> bool | None:
        """Whether `peer`, at the state's head, holds parameters that agree with the state's
        (state_check.py); None when it could not say (another head, busy, gone)."""
        count = min(state.numel, self.parameters or state.numel)
        seed = self.rng.randrange(MAX_SEED + 1) if self.rng is not None else secrets.randbits(63)
        header = {"key": self.key, "seed": seed, "count": count, "epoch": state.epoch,
                  "lineage": state.lineage}
        token = self.membership.credential(self.key)
        if token is not None:
            header["token"] = token
        try:
            reply = await self.transport.call(peer, SKETCH_METHOD, Message(header),
                                              timeout=SKETCH_SECONDS)
        except (TransportError, TimeoutError) as exc:
            log.debug("state_witness_failed", witness=peer[:12], error=str(exc))
            return None
        found = reply.header.get("sketch")
        if reply.header.get("epoch") != state.epoch or reply.header.get("lineage") != state.lineage \
                or found is None:
            return None  # it has moved on (or was not there yet): it cannot say
        if not isinstance(found, list) or len(found) != SKETCH_BUCKETS \
                or not all(isinstance(v, float | int) and not isinstance(v, bool) for v in found):
            log.info("state_witness_malformed", witness=peer[:12])
            return None
        own = await asyncio.to_thread(sketch, state.buffer.array[:count], seed)
        distance = sketch_distance(own, np.asarray(found, np.float64))
        if distance > TOLERANCE:
            log.warning("state_witness_disagrees", witness=peer[:12], distance=round(distance, 6),
                        epoch=state.epoch)
            return False
        return True
