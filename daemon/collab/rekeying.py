"""Re-keying a closed run: a new generation of its secret reaches every remaining member.

Each revocation makes the owner's ledger draw a new generation of the run's secret
(ownership.py); tokens issued from then on carry it. The members that hold a token already
learn it from the owner's re-keying records: the new secret (and the one before) sealed to each
member peer with the sealing that tokens use (sealing.py), spread over `chunks` records
`closed/<owner>/<run>/rekey/<n>` (n < chunks), each under the owner's own sub-key (so that the
DHT's signature check makes them the owner's alone; membership.py refuses anyone else's too)
and stored in clear (the boxes are the secret part). A record's value is

    b"dlk1" || generation (4) || chunk (2) || chunks (2) || secrets per box (1)
            || entries x (peer tag (8) || sealed box (48 + 32 x secrets per box))

A member's entry is in record `chunk_of(peer, chunks)`, found by its tag (8 bytes of a hash of
its peer id); its box opens only with its identity and only for this owner, run and generation.
The revocation list names the generation and the number of records, so a member knows when to
look and where. The members are the peers that held an unexpired, unrevoked token when the
generation was drawn (later tokens carry it).

Bounds: a record holds at most `CHUNK_MOST` entries (120 bytes each: under the DHT's 64 KiB
value), `CHUNK_TARGET` on average; a run has at most `MAX_REKEY_CHUNKS` records, so at most
`MAX_REKEYED_PEERS` member peers: the owner is refused tokens past that (ownership.py).

A member (`KeyCatchUp`, stepped where board.py refreshes the revocation list) reads its record
when the list names a newer generation than it holds (or, with another key id, one it holds: a
number the owner drew twice; the list wins), opens and checks its entry and reads the new
generation's records from then on; it writes with it `REKEY_GRACE` seconds after the owner first
stored the records (the list's `rekeyed`: at once for an old rotation; never later than
`REKEY_GRACE` after it learned it), once every member has refreshed the list, so that nobody is
left unable to read the others' records for a while (members keep the earlier generations to
read by key id: secrecy.py); the owner switches then too (ownership.py). A member that could not
learn it by then says so as an error (`rekey_overdue`), once a generation, and writes on. A revoked member has
no entry and reads nothing written with the new generation. Anything read is checked; a record
that is missing, malformed or holds no entry of ours is counted and logged once a generation.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from ..dht.errors import InvalidRecord
from ..identity import Identity
from ..net import TransportError
from ..sealing import SEAL_OVERHEAD, SealError, open_sealed, seal
from .errors import MembershipError
from .membership import rekey_key
from .revocations import MAX_REKEY_CHUNKS, REVOCATIONS_REFRESH
from .secrecy import MAX_GENERATION, RUN_SECRET_BYTES, RunSecret, join_secrets, split_secrets
from .tokens import SEALED_GENERATIONS

if TYPE_CHECKING:
    from ..dht import DHTNode
    from .membership import MembershipRegistry
    from .revocations import Revocations
    from .secrecy import RunKeys

log = structlog.get_logger(__name__)

__all__ = ["CHUNK_MOST", "MAX_REKEYED_PEERS", "REKEY_GRACE", "KeyCatchUp", "RekeyError",
           "chunk_of", "open_chunk", "plan_chunks", "publish_rekeying", "seal_chunks"]

MAGIC = b"dlk1"
_HEADER = struct.Struct(">4sIHHB")
_TAG = 8
_TAG_DOMAIN = b"dedloc-rekey-tag-v1\0"
_CONTEXT_DOMAIN = b"dedloc-rekey-v1\0"
CHUNK_TARGET = 256  # entries per record, on average
CHUNK_MOST = 480  # entries in one record (the hash spreads peers unevenly): 57.6 kB at most
MAX_REKEYED_PEERS = CHUNK_TARGET * MAX_REKEY_CHUNKS
# members (and the owner) write with a new generation this long after its records were first
# stored: every member refreshes the list every REVOCATIONS_REFRESH s, so by then all have it
REKEY_GRACE = 2 * REVOCATIONS_REFRESH
DHT_TIMEOUT = 5.0
PUBLISH_TIMEOUT = 30.0
_SEAL_IN_THREAD = 64  # peers past which sealing (an X25519 exchange each) leaves the loop
_LOGGED = 256  # (reason, generation) pairs whose first occurrence was logged (then forgotten)


class RekeyError(MembershipError):
    """The run's new secret cannot be sealed to all of its members (too many of them)."""


def _tag(peer: str) -> bytes:
    return hashlib.sha256(_TAG_DOMAIN + peer.encode()).digest()[:_TAG]


def chunk_of(peer: str, chunks: int) -> int:
    """The re-keying record that holds `peer`'s entry, of `chunks`."""
    return int.from_bytes(_tag(peer)[:4], "big") % chunks


def _context(owner: str, run: str, generation: int) -> bytes:
    return _CONTEXT_DOMAIN + owner.encode() + b"\0" + run.encode() + b"\0" + struct.pack(
        ">I", generation)


def plan_chunks(peers: Sequence[str]) -> int:
    """How many re-keying records `peers` need; RekeyError if more than MAX_REKEY_CHUNKS."""
    if len(peers) > MAX_REKEYED_PEERS:
        raise RekeyError(f"{len(peers)} member peers are more than the {MAX_REKEYED_PEERS} that "
                         "a revocation can re-key: revoke or let expire the tokens of peers "
                         "that no longer take part, or start a new run for the rest")
    for chunks in range(max(1, -(-len(peers) // CHUNK_TARGET)), MAX_REKEY_CHUNKS + 1):
        counts = collections.Counter(chunk_of(peer, chunks) for peer in peers)
        if max(counts.values(), default=0) <= CHUNK_MOST:
            return chunks
    raise RekeyError(f"the {len(peers)} member peers do not spread over {MAX_REKEY_CHUNKS} "
                     "re-keying records; revoke or let expire the tokens of peers that no longer "
                     "take part")


def seal_chunks(owner: str, run: str, generation: int, secrets: Sequence[RunSecret],
                peers: Sequence[str], chunks: int) -> list[bytes]:
    """The `chunks` re-keying records' values: `secrets` (of `generation`, `generation - 1`, ...,
    newest first) sealed to each of `peers` (ones that are not peer ids are left out)."""
    secrets = list(secrets[:SEALED_GENERATIONS])
    plain, context = join_secrets(secrets), _context(owner, run, generation)
    bodies: list[list[bytes]] = [[] for _ in range(chunks)]
    for peer in sorted(set(peers)):
        try:
            box = seal(peer, plain, context)
        except SealError as exc:
            log.warning("rekey_peer_skipped", run=run, peer=peer[:16], error=str(exc))
            continue
        bodies[chunk_of(peer, chunks)].append(_tag(peer) + box)
    if max(map(len, bodies)) > CHUNK_MOST:
        raise RekeyError(f"a re-keying record of run {run!r} would hold more than {CHUNK_MOST} "
                         "entries (plan_chunks decides how many records)")
    return [_HEADER.pack(MAGIC, generation, chunk, chunks, len(secrets)) + b"".join(body)
            for chunk, body in enumerate(bodies)]


def open_chunk(identity: Identity, owner: str, run: str, data: bytes, chunk: int,
               chunks: int) -> tuple[int, list[RunSecret]] | None:
    """(generation, secrets newest first) from `identity`'s entry in re-keying record `chunk` of
    `chunks`; None if it holds no entry of ours; MembershipError if it is malformed."""
    if len(data) < _HEADER.size:
        raise MembershipError(f"a re-keying record of {len(data)} bytes is too short")
    magic, generation, found_chunk, found_chunks, per_box = _HEADER.unpack_from(data)
    if magic != MAGIC or not 1 <= generation <= MAX_GENERATION:
        raise MembershipError(f"not a re-keying record of a known format (generation {generation})")
    if (found_chunk, found_chunks) != (chunk, chunks):
        raise MembershipError(f"re-keying record {found_chunk} of {found_chunks} is filed as "
                              f"{chunk} of {chunks}")
    if not 1 <= per_box <= min(SEALED_GENERATIONS, generation + 1):
        raise MembershipError(f"a re-keying record with {per_box} secrets in a box")
    size = _TAG + SEAL_OVERHEAD + per_box * RUN_SECRET_BYTES
    body = memoryview(data)[_HEADER.size:]
    if len(body) % size or len(body) // size > CHUNK_MOST:
        raise MembershipError(f"a re-keying record's {len(body)} bytes are not at most "
                              f"{CHUNK_MOST} entries of {size}")
    tag, context = _tag(identity.peer_id), _context(owner, run, generation)
    for start in range(0, len(body), size):
        if body[start:start + _TAG] != tag:
            continue
        try:
            plain = open_sealed(identity, bytes(body[start + _TAG:start + size]), context)
            return generation, split_secrets(plain, per_box)
        except (SealError, ValueError):
            continue  # (another peer's entry with our tag, or a forged one: look on)
    return None


async def publish_rekeying(dht: DHTNode, owner: str, run: str, generation: int,
                           secrets: Sequence[RunSecret], peers: Sequence[str], chunks: int,
                           expiration: float) -> bool:
    """Seal and store a generation's re-keying records (see the module docstring); True if
    every one of them was stored somewhere."""
    if len(peers) > _SEAL_IN_THREAD:
        values = await asyncio.to_thread(seal_chunks, owner, run, generation, secrets, peers,
                                         chunks)
    else:
        values = seal_chunks(owner, run, generation, secrets, peers, chunks)
    try:
        async with asyncio.timeout(PUBLISH_TIMEOUT):  # (each store has half of it: all end)
            stored = await asyncio.gather(*(
                dht.store(rekey_key(owner, run, chunk), value, expiration, sub_key=owner,
                          timeout=PUBLISH_TIMEOUT / 2) for chunk, value in enumerate(values)),
                return_exceptions=True)
    except TimeoutError as exc:
        stored = [exc]
    failed = [r for r in stored if isinstance(r, BaseException)]
    for problem in failed:
        if not isinstance(problem, TransportError | TimeoutError | InvalidRecord):
            raise problem
    if failed:
        log.warning("rekey_publish_failed", run=run, generation=generation, error=str(failed[0]),
                    failed=len(failed), records=len(values),
                    hint="republished every few hours; a DHT whose values must be smaller than "
                         f"{len(max(values, key=len))} bytes cannot carry them (dht.max_value_bytes)")
        return False
    return all(isinstance(count, int) and count > 0 for count in stored)


class KeyCatchUp:
    """A member's side: learns the run's newer generations from the owner's re-keying records."""

    def __init__(self, dht: DHTNode, membership: MembershipRegistry, owner: str, run: str) -> None:
        self.dht = dht
        self.membership = membership
        self.owner = owner
        self.run = run
        self.problems: collections.Counter[str] = collections.Counter()
        self._logged: set[tuple[str, int]] = set()

    def _problem(self, reason: str, generation: int, **context: object) -> None:
        self.problems[reason] += 1
        if self._once(reason, generation):
            log.warning("rekey_not_learned", run=self.run, generation=generation, reason=reason,
                        **context)

    def _once(self, reason: str, generation: int) -> bool:
        """Is this the first (reason, generation) to log (bounded)?"""
        if (reason, generation) in self._logged:
            return False
        if len(self._logged) >= _LOGGED:
            self._logged.clear()
        self._logged.add((reason, generation))
        return True

    def _overdue(self, revocations: Revocations, keys: RunKeys) -> None:
        """Say loudly when the grace of a generation we could not learn is over: we still write
        with one that the owner superseded (which the revoked member reads)."""
        if revocations.rekeyed is None or self.membership.now() < revocations.rekeyed + REKEY_GRACE:
            return
        self.problems["overdue"] += 1
        if self._once("overdue", revocations.generation):
            log.error("rekey_overdue", run=self.run, generation=revocations.generation,
                      writing=keys.writing,
                      hint="this peer still writes with a generation of the run's secret that a "
                           "revoked member holds, and cannot read what the others write with the "
                           "new one: check that it reaches the DHT (dedloc info), or ask the "
                           "run's owner for a new token (dedloc token issue) and join with it")

    async def step(self) -> bool:
        """Learn the generation the owner's revocation list names if we do not hold it (a newer
        one, or one that contradicts ours); True if one was learned."""
        membership, owner = self.membership, self.owner
        revocations, keys = membership.revocations(owner, self.run), membership.keys(owner, self.run)
        if revocations is None or keys is None:
            return False
        generation, chunks = revocations.generation, revocations.chunks
        held = keys.secret(generation)
        conflict = bool(revocations.key_id) and held is not None and (
            held.key_id.hex() != revocations.key_id)
        if generation <= keys.newest and not conflict:
            return False
        if conflict:  # (a number drawn twice: the owner's ledger went back)
            self.problems["conflict"] += 1
            if self._once("conflict", generation):
                log.error("rekey_conflict", run=self.run, generation=generation,
                          held=held.key_id.hex() if held else None, listed=revocations.key_id,
                          hint="the run's owner drew this generation of its secret twice (its "
                               "ledger was restored from a backup, or could not be saved): this "
                               "peer takes the one its newest list names, as every member does; "
                               "the owner should check its ledger (dedloc token list)")
        if chunks < 1:
            return False
        chunk = chunk_of(membership.identity.peer_id, chunks)
        try:
            record = await self.dht.get(rekey_key(owner, self.run, chunk), timeout=DHT_TIMEOUT)
        except (TransportError, TimeoutError) as exc:
            self._problem("unreachable", generation, error=str(exc))
            self._overdue(revocations, keys)
            return False
        entry = None if record is None or not record.has_sub_keys else record.sub_keys.get(owner)
        opened = None
        if entry is None or entry.signer != owner:
            self._problem("missing", generation, chunk=chunk)
        else:
            try:
                opened = open_chunk(membership.identity, owner, self.run, entry.value, chunk,
                                    chunks)
            except MembershipError as exc:
                self._problem("malformed", generation, error=str(exc))
            else:
                if opened is None:  # (revoked; or this record is an older one, being replaced)
                    self._problem("no_entry", generation, chunk=chunk)
                elif opened[0] != generation or (revocations.key_id and (
                        opened[1][0].key_id.hex() != revocations.key_id)):
                    self._problem("stale", generation, found=opened[0])  # (an older record)
                    opened = None
        if opened is None:
            self._overdue(revocations, keys)
            return False
        membership.learn_keys(owner, self.run, generation, opened[1], grace=REKEY_GRACE,
                              rekeyed=revocations.rekeyed)
        log.info("run_rekeyed", run=self.run, generation=generation, writing=keys.writing,
                 writes_in=round(max(0.0, min(REKEY_GRACE, (revocations.rekeyed or math.inf)
                                              + REKEY_GRACE - membership.now())), 1))
        return True
