"""Audits of a reducer's own contribution: the one entry of its account nobody else can check.

A reducer's own contribution to its part reaches nobody, so its entry (projections, norm) was its
word, and since the signs r come from the answer, a reducer could pick its answer first and then
state whatever own projections make the answer agree (accounts.py). Two things close that:
- **Commitment.** The reducer's own entry names a digest of its own contribution (`commitment`:
  a BLAKE3 digest of each segment's float32 bytes, and of those and of each segment's L2 norm,
  the root), and the signs r are drawn from the answer *and* every entry's digest
  (accounts.answer_digest). To state true projections
  of another contribution than the one it committed to, the reducer must change the digest,
  which changes r: it cannot aim its own entry at the signs.
- **Audits** (method "avg.audit", unary). After a round, each member asks up to
  `AUDITS_PER_ROUND` of the reducers whose answers it applied (at random) for one segment of
  one chunk of their own contribution, both drawn at random:
      header {"g": group_id, "c": chunk, "k": segment}
  and the reducer answers header {"d": [each segment's digest, hex], "n": [each segment's norm]}
  with the segment's float32 values as payload. The member checks that the digests and norms give
  the committed root, that the segment has its digest and its committed norm, that its
  projection is the one the entry states, and that the chunk's norm the entry states is the one
  the committed segments' norms make. A reducer that fails is banned at once (`offences_forged_account`,
  `audits_failed`); one that does not answer commits an offence (`offences_audit_unanswered`,
  three within the ban window ban it).
A reducer that states false own projections in a fraction f of its segments is caught by each
auditor with probability f per round; so is one that states its chunk's norm under or over its
contribution's (to escape the norm-clipped mean's scale, or to widen the answer's checks): the
stated norm must be the one its committed segment norms make, so it must misstate those of a
fraction f of its segments, each caught when audited. (Before the norms were committed, a norm
stated up to sqrt(segments) times under, or any amount over, passed every audit.) Each member
bans on its own audits (it cannot show others a reducer's reply).

Bounds: a reducer keeps its own contributions until `KEPT_SECONDS` past the round's deadline
(members audit within half of that), for at most `KEPT_ROUNDS` rounds, and beyond `KEPT_BYTES`
only while their audits may still come; it answers one audit per member and round, only to
members that sent in that round. Cost: per member and round, up to 4
segments (an eighth of a chunk each, 512 KiB for 4 MiB chunks) and a hash of them; a reducer
copies its own part once per round.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog
from blake3 import blake3

from .. import timebase
from ..net import Message, PeerTransport, RequestContext, TransportError
from .accounts import FLOAT32_UNIT, Entry, misstates, project, signs_of
from .aggregation import l2_norm
from .bans import BanList
from .group import Group
from .round_calls import RoundCalls
from .wire import PeerFault

log = structlog.get_logger(__name__)

METHOD = "avg.audit"
AUDITS_PER_ROUND = 4
KEPT_ROUNDS = 8
# ... and no more than this of rounds whose audits are over (the newest is always kept)
KEPT_BYTES = 256 << 20
KEPT_SECONDS = 120.0  # after the round's deadline (members audit within half of it)
MAX_SQUARED = 1.9e19  # past this a float32 value's square is inf: no finite norm has more a value
CALL_TIMEOUT = 15.0


def segment_digest(values: np.ndarray) -> bytes:
    data = memoryview(np.ascontiguousarray(values, np.float32)).cast("B")
    return blake3(data, max_threads=1).digest()


def root_of(group_id: str, reducer: int, chunk: int, digests: Sequence[bytes],
            norms: Sequence[float]) -> str:
    """The commitment a reducer's own entry names: a digest of its segments' digests and
    norms (float64, as the audit's JSON carries them)."""
    root = blake3(f"dedloc-own-contribution\0{group_id}\0{reducer}\0{chunk}\0".encode(),
                  max_threads=1)
    for digest in digests:
        root.update(digest)
    root.update(struct.pack(f">{len(norms)}d", *norms))
    return root.hexdigest()


@dataclass(frozen=True)
class Own:
    """A reducer's own contribution to a chunk as it committed to it (`commitment`)."""

    values: np.ndarray
    digests: tuple[bytes, ...]
    norms: tuple[float, ...]


def commitment(group_id: str, reducer: int, chunk: int, values: np.ndarray,
               parts: Sequence[tuple[int, int]]) -> tuple[str, Own]:
    """(the root, what it commits to) of a reducer's own contribution to a chunk."""
    digests = tuple(segment_digest(values[a:b]) for a, b in parts)
    norms = tuple(l2_norm(values[a:b]) for a, b in parts)
    return root_of(group_id, reducer, chunk, digests, norms), Own(values, digests, norms)


def audit_failure(entry: Entry, applied: Applied, *, group_id: str, reducer: int, chunk: int,
                  segment: int, digests: Sequence[bytes], norms: Sequence[float],
                  values: np.ndarray) -> str | None:
    """Why the reducer's reply to an audit of its own `entry` fails (None: it passes)."""
    parts = applied.parts
    if len(digests) != len(parts) or len(norms) != len(parts) \
            or root_of(group_id, reducer, chunk, digests, norms) != entry.digest:
        return "its segments' digests and norms do not give the commitment its account named"
    n = parts[-1][1]
    # (committed, so its own: no honest segment's norm is past sqrt(n) float32 squares' limit,
    # and one of 1e200 would make the chunk's norm inf, next to which any stated norm passes)
    limit = math.sqrt(n) * MAX_SQUARED
    if not all(0.0 <= k <= limit for k in norms):  # (NaN fails too)
        return "it committed to a segment norm no float32 contribution has"
    a, b = parts[segment]
    if values.size != b - a or segment_digest(values) != digests[segment]:
        return f"segment {segment} is not the one it committed to"
    if not np.isfinite(values).all():
        return f"segment {segment} holds non-finite values"
    norm = l2_norm(values)
    # (the slack from what was measured, not stated: a stated norm of 1e30 widens nothing)
    stated = Entry(entry.sender, entry.weight, (entry.projections[segment],), norm)
    projection = project(signs_of(applied.answer, n)[a:b], values, [(0, b - a)])
    if misstates(stated, projection, norm, n):
        return f"its account misstated the projection of its own segment {segment}"
    if _apart(norm, norms[segment], n):
        return f"its own segment {segment} has a norm of {norm:.6g}, not the {norms[segment]:.6g} " \
               "it committed to"
    whole = math.hypot(*norms)
    if _apart(entry.norm, whole, n):
        return f"its account stated a norm of {entry.norm:.6g} for its own contribution, not the " \
               f"{whole:.6g} its committed segments make"
    return None


def _apart(stated: float, measured: float, n: int) -> bool:
    """Whether two L2 norms of (parts of) one n-element float32 contribution differ by more than
    their float64 sums' order on two machines allows (both ways)."""
    if not (math.isfinite(stated) and math.isfinite(measured)):
        return True
    scale = max(abs(stated), abs(measured))
    slack = n * 2.0**-53 * math.sqrt(n) * scale * 4 + 4 * FLOAT32_UNIT * scale + 1e-30
    return not abs(stated - measured) <= slack  # (NaN: apart)


@dataclass(frozen=True)
class Applied:
    """What a member applied of a reducer's answer to one chunk: the account's entries and the
    answer's digest (its signs, accounts.signs_of), over the chunk's segments."""

    entries: tuple[Entry, ...]
    answer: bytes
    parts: tuple[tuple[int, int], ...]


@dataclass
class _Kept:
    group: Group
    own: dict[int, Own]  # chunk -> our own contribution as committed
    asked: set[str] = field(default_factory=set)

    def expired(self, now: float, share: float = 1.0) -> bool:
        """Past the round's deadline by `share` of KEPT_SECONDS (every member knows when)."""
        return now > self.group.deadline + share * KEPT_SECONDS


class OwnAudits(RoundCalls[_Kept]):
    """Serves audits of this peer's own contributions and makes this member's (module
    docstring)."""

    def __init__(self, transport: PeerTransport, bans: BanList, counters: collections.Counter[str],
                 rng: random.Random) -> None:
        super().__init__(transport, bans, counters, METHOD, self._serve, KEPT_ROUNDS)
        self.rng = rng

    # --- as a reducer ---------------------------------------------------------------------------
    def keep(self, group: Group, own: dict[int, Own]) -> None:
        """A round starts here in which we reduce and send: `own` fills with our own
        contributions, chunk by chunk, as they are averaged. Kept until KEPT_SECONDS past its
        deadline; members audit only within half of that, so no honest reducer refuses them
        for having let go (but past KEPT_ROUNDS rounds, a count no run reaches in that time)."""
        self._keep(group.group_id, _Kept(group, own))
        now = timebase.now()
        while len(self._rounds) > 1 and next(iter(self._rounds.values())).expired(now, 0.5) \
                and sum(values.nbytes for kept in self._rounds.values()
                        for values in (o.values for o in kept.own.values())) > KEPT_BYTES:
            self._rounds.popitem(last=False)

    async def _serve(self, ctx: RequestContext, message: Message) -> Message:
        header = message.header
        group_id, chunk, segment = header.get("g"), header.get("c"), header.get("k")
        kept = self._rounds.get(group_id) if isinstance(group_id, str) else None
        if kept is not None and kept.expired(timebase.now()):
            del self._rounds[group_id]
            kept = None
        if kept is None or not any(m.peer_id == ctx.peer_id and m.sends for m in kept.group.members):
            self.counters["audits_refused"] += 1
            raise PeerFault(f"no round {group_id} kept here in which {ctx.peer_id} sent")
        if ctx.peer_id in kept.asked:
            self.counters["audits_refused"] += 1
            raise PeerFault("one audit per member and round")
        own = kept.own.get(chunk) if _index(chunk) else None
        if own is None or not _index(segment) or segment >= len(own.digests):
            self.counters["audits_refused"] += 1
            raise PeerFault(f"no own contribution to chunk {chunk}, segment {segment} here")
        kept.asked.add(ctx.peer_id)
        bounds = _bounds(own.values.size, len(own.digests), segment)
        self.counters["audits_served"] += 1
        return Message({"d": [d.hex() for d in own.digests], "n": list(own.norms)},
                       np.ascontiguousarray(own.values[bounds[0]:bounds[1]]).tobytes())

    # --- as a member ----------------------------------------------------------------------------
    def audit(self, group: Group, index: int, applied: dict[tuple[int, int], Applied]) -> None:
        """Our round is over: audit up to AUDITS_PER_ROUND of the reducers whose answers we
        applied, one random segment of one random chunk each (in the background); none once
        half of KEPT_SECONDS past the round's deadline (reducers keep their own for all of it)."""
        if timebase.now() > group.deadline + KEPT_SECONDS / 2:
            return
        chunks: dict[int, list[int]] = {}
        for j, c in applied:
            if j != index and group.members[j].sends:
                chunks.setdefault(j, []).append(c)
        reducers = sorted(chunks)
        for j in self.rng.sample(reducers, min(AUDITS_PER_ROUND, len(reducers))):
            c = self.rng.choice(sorted(chunks[j]))
            entry = next((e for e in applied[(j, c)].entries if e.sender == j), None)
            if entry is None:  # it left its own contribution out of that chunk
                continue
            k = self.rng.randrange(len(applied[(j, c)].parts))
            self._spawn(self._audit_one(group, j, c, k, entry, applied[(j, c)]),
                        f"allreduce-audit-{j}")

    async def _audit_one(self, group: Group, j: int, c: int, k: int, entry: Entry,
                         applied: Applied) -> None:
        peer = group.members[j].peer_id
        self.counters["audits_made"] += 1
        try:
            reply = await self.transport.call(peer, METHOD, Message({"g": group.group_id, "c": c, "k": k}),
                                              timeout=CALL_TIMEOUT)
            raw, norms = reply.header.get("d"), reply.header.get("n")
            a, b = applied.parts[k]
            if not isinstance(raw, list) or len(raw) != len(applied.parts) \
                    or not all(isinstance(d, str) and len(d) == 64 for d in raw) \
                    or not isinstance(norms, list) or len(norms) != len(applied.parts) \
                    or not all(isinstance(x, int | float) and not isinstance(x, bool)
                               for x in norms) \
                    or len(reply.payload) != 4 * (b - a):
                raise PeerFault("an audit's reply is not {\"d\": segment digests, \"n\": segment "
                                "norms} and the segment")
            digests = [bytes.fromhex(d) for d in raw]
            values = np.frombuffer(bytes(reply.payload), np.float32)
        except (TransportError, TimeoutError, PeerFault, ValueError) as exc:
            self.counters["audits_unanswered"] += 1
            self.bans.offence(peer, "audit_unanswered", f"no answer to an audit of its own "
                              f"contribution in round {group.group_id}: {str(exc)[:200]}")
            return
        why = await asyncio.to_thread(audit_failure, entry, applied, group_id=group.group_id,
                                      reducer=j, chunk=c, segment=k, digests=digests,
                                      norms=[float(x) for x in norms], values=values)
        if why is None:
            self.counters["audits_passed"] += 1
            return
        self.counters["audits_failed"] += 1
        self.bans.offence(peer, "forged_account", f"an audit of its own contribution to chunk {c} "
                          f"of round {group.group_id}: {why}", conclusive=True)


def _bounds(n: int, count: int, segment: int) -> tuple[int, int]:
    """Segment `segment` of `count` over n elements, as accounts.segments cuts them."""
    return n * segment // count, n * (segment + 1) // count


def _index(raw: object) -> bool:
    return isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 1 << 31
