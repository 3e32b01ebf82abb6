"""A closed run's secret: the key its members encrypt the run's DHT records with.

The owner draws 32 random bytes when it creates a closed run and keeps them with the run's
ledger (ownership.py); each token it issues carries them sealed to the token's peer (sealing.py,
tokens.py), so members learn the secret when they join and nobody else can. Every record
value under the run's keys, except the owner's (its public revocation list and its re-keying
records, which hold sealed boxes only), is then stored as

    b"dlc1" || key id (4) || nonce (12) || ChaCha20-Poly1305(writer's key, nonce, value, context)

where the writer's key (one per writer: random 96-bit nonces stay far from repeating within one
writer's records) and the key id come from the secret through HKDF (the secret itself never
encrypts anything), and the associated `context` is the record's writer, DHT key and sub-key:
a ciphertext moved to another key or sub-key, or re-signed by another writer, does not open.
The DHT nodes that hold the record, members or not, keep and serve these bytes and never read
them; only members can.

The secret changes when the owner revokes a token (rekeying.py): each revocation draws a new
*generation* of it, numbered from 0. A member holds several (`RunKeys`: the newest
`KEPT_GENERATIONS`), writes with one and reads a record with whichever its key id names, so that
records written before a change, and by members that change a little later, still open. The key
id tells a reader whether it holds the key a record was written with from a record that was
altered.
"""

from __future__ import annotations

import collections
import math
import os
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import CollaborationError

__all__ = ["KEPT_GENERATIONS", "MAX_GENERATION", "RECORD_OVERHEAD", "RUN_SECRET_BYTES",
           "RecordUnreadable", "RunKeys", "RunSecret", "join_secrets", "split_secrets"]

RUN_SECRET_BYTES = 32
MAGIC = b"dlc1"
_KEY_ID = 4
_NONCE = 12
_TAG = 16
RECORD_OVERHEAD = len(MAGIC) + _KEY_ID + _NONCE + _TAG
_RECORDS_INFO = b"dedloc-closed-records-v1\0"
_WRITER_KEYS = 4096  # writers whose derived keys are kept (one derivation each otherwise)
_KEY_ID_INFO = b"dedloc-closed-key-id-v1\0"
_CONTEXT_DOMAIN = b"dedloc-closed-record-v1\0"
MAX_GENERATION = 2**31 - 1  # (a generation read from the network is checked against it)
KEPT_GENERATIONS = 8  # generations of a run's secret a peer keeps (the newest)


class RecordUnreadable(CollaborationError):
    """A closed run's record that does not open with the run's key (altered, moved, foreign)."""


def _derive(secret: bytes, info: bytes, length: int) -> bytes:
    return HKDF(hashes.SHA256(), length, salt=None, info=info).derive(secret)


def _context(writer: str, key: str, sub_key: str | None) -> bytes:
    fields = [writer.encode(), key.encode(), b"" if sub_key is None else sub_key.encode()]
    return _CONTEXT_DOMAIN + struct.pack(">B", sub_key is not None) + b"".join(
        struct.pack(">I", len(field)) + field for field in fields)


class RunSecret:
    """Encrypts and decrypts one closed run's record values (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) != RUN_SECRET_BYTES:
            raise ValueError(f"a run's secret is {RUN_SECRET_BYTES} bytes")
        self.secret = secret
        self.key_id = _derive(secret, _KEY_ID_INFO, _KEY_ID)
        self._writers: collections.OrderedDict[str, ChaCha20Poly1305] = collections.OrderedDict()

    @classmethod
    def generate(cls) -> RunSecret:
        return cls(os.urandom(RUN_SECRET_BYTES))

    def __repr__(self) -> str:  # never the secret itself
        return f"RunSecret(key_id={self.key_id.hex()})"

    def _aead(self, writer: str) -> ChaCha20Poly1305:
        aead = self._writers.pop(writer, None)
        if aead is None:
            aead = ChaCha20Poly1305(_derive(self.secret, _RECORDS_INFO + writer.encode(), 32))
        self._writers[writer] = aead
        while len(self._writers) > _WRITER_KEYS:
            self._writers.popitem(last=False)
        return aead

    def encrypt(self, writer: str, key: str, sub_key: str | None, value: bytes) -> bytes:
        """`value` as stored under (key, sub_key) by `writer`; a fresh random nonce each time
        (96 bits, under a key of the writer's own: a peer writes far fewer than the 2^32 records
        past which a repeat would become likely)."""
        nonce = os.urandom(_NONCE)
        return b"".join((MAGIC, self.key_id, nonce,
                         self._aead(writer).encrypt(nonce, value, _context(writer, key, sub_key))))

    def decrypt(self, writer: str, key: str, sub_key: str | None, stored: bytes) -> bytes:
        """The value `writer` stored under (key, sub_key); RecordUnreadable if it is not one."""
        if len(stored) < RECORD_OVERHEAD or not stored.startswith(MAGIC):
            raise RecordUnreadable("not an encrypted record (written in clear, or by another "
                                   "version)")
        head = len(MAGIC)
        if stored[head:head + _KEY_ID] != self.key_id:
            raise RecordUnreadable("written with another key of the run than the ones this "
                                   "peer holds (a newer generation not learned yet, or a "
                                   "foreign key)")
        nonce = stored[head + _KEY_ID:head + _KEY_ID + _NONCE]
        try:
            return self._aead(writer).decrypt(nonce, stored[head + _KEY_ID + _NONCE:],
                                      _context(writer, key, sub_key))
        except InvalidTag:
            raise RecordUnreadable("it does not authenticate: altered, or moved from another "
                                   "key, sub-key or writer") from None


def join_secrets(secrets: Sequence[RunSecret]) -> bytes:
    """Secrets of consecutive generations, newest first, as one byte string (to seal)."""
    return b"".join(secret.secret for secret in secrets)


def split_secrets(data: bytes, most: int) -> list[RunSecret]:
    """`join_secrets` undone; ValueError unless `data` holds 1 to `most` secrets."""
    count, rest = divmod(len(data), RUN_SECRET_BYTES)
    if rest or not 1 <= count <= most:
        raise ValueError(f"{len(data)} bytes are not 1 to {most} run secrets")
    return [RunSecret(data[i * RUN_SECRET_BYTES:(i + 1) * RUN_SECRET_BYTES]) for i in range(count)]


class RunKeys:
    """The generations of one closed run's secret that a peer holds: it reads records written
    with any of them (by key id) and writes with one, `writing`, which moves to the newest a
    grace after that was drawn or learned (so that the other members learn it first).

    The owner's word is final: a generation learned again with another secret (the owner's
    ledger was restored from a backup, or drew a number twice) replaces the one held, and
    generations held past the one learned (which the owner no longer has) are dropped; both are
    counted in `conflicts`. The generation written with is kept even when more than
    `KEPT_GENERATIONS` newer ones arrive at once."""

    def __init__(self, generation: int, secrets: Sequence[RunSecret]) -> None:
        """`secrets`: those of `generation`, `generation - 1`, ... (newest first)."""
        self._secrets: dict[int, RunSecret] = {}
        self.newest = -1
        self.writing = generation
        self._switch_at: float | None = None
        self.conflicts = 0
        self.learn(generation, secrets, now=0.0, grace=0.0)

    def learn(self, generation: int, secrets: Sequence[RunSecret], now: float, grace: float,
              rekeyed: float | None = None) -> bool:
        """Keep the secrets of `generation` and the ones before it (newest first); True if
        `generation` is newer than any held. It is written with from `grace` seconds after it
        reached the members (`rekeyed`, the owner's clock: at once if that is long past) or, if
        that is unknown, after `now`; never later than `now + grace` (an owner's clock ahead of
        ours does not hold it back). Learning the newest again can bring that time forward."""
        if not 0 <= generation <= MAX_GENERATION or not 1 <= len(secrets) <= KEPT_GENERATIONS:
            raise ValueError(f"generation {generation} with {len(secrets)} secrets is out of "
                             f"bounds (0..{MAX_GENERATION}, 1..{KEPT_GENERATIONS} secrets)")
        replaced = {generation - offset for offset, secret in enumerate(secrets)
                    if generation - offset >= 0 and (held := self._secrets.get(
                        generation - offset)) is not None and held.secret != secret.secret}
        dropped = {g for g in self._secrets if g > generation}
        newer = generation > self.newest
        for offset, secret in enumerate(secrets):
            if generation - offset >= 0 and (generation - offset in replaced
                                             or generation - offset not in self._secrets):
                self._secrets[generation - offset] = secret
        for gone in dropped:
            del self._secrets[gone]
        switch_at = min(now + grace, math.inf if rekeyed is None else rekeyed + grace)
        if replaced or dropped:  # (the owner's newest word wins: write with it at once)
            self.conflicts += 1
            self.newest = self.writing = generation
            self._switch_at = None
        elif newer:
            self.newest, self._switch_at = generation, switch_at
        elif generation == self.newest and self._switch_at is not None:
            self._switch_at = min(self._switch_at, switch_at)
        if self._switch_at is not None and self._switch_at <= now:
            self.writing, self._switch_at = self.newest, None
        kept = {*sorted(self._secrets)[-KEPT_GENERATIONS:], self.writing}
        for old in set(self._secrets) - kept:  # (the one written with stays: readers hold it)
            del self._secrets[old]
        return newer

    def generations(self) -> list[int]:
        return sorted(self._secrets)

    def secret(self, generation: int) -> RunSecret | None:
        return self._secrets.get(generation)

    def newest_first(self, most: int) -> list[RunSecret]:
        """The newest `most` secrets of consecutive generations, newest first."""
        found = []
        for generation in range(self.newest, max(-1, self.newest - most), -1):
            secret = self._secrets.get(generation)
            if secret is None:
                break
            found.append(secret)
        return found

    def writer(self, now: float) -> RunSecret:
        """The secret to write with at `now`."""
        if self._switch_at is not None and now >= self._switch_at:
            self.writing, self._switch_at = self.newest, None
        return self._secrets[self.writing]

    def decrypt(self, writer: str, key: str, sub_key: str | None, stored: bytes) -> bytes:
        """`RunSecret.decrypt` with the generation whose key id `stored` carries."""
        key_id = stored[len(MAGIC):len(MAGIC) + _KEY_ID] if stored.startswith(MAGIC) else None
        matching = [s for s in self._secrets.values() if s.key_id == key_id]
        if not matching or len(stored) < RECORD_OVERHEAD:
            return self._secrets[self.writing].decrypt(writer, key, sub_key, stored)  # (says why)
        for secret in matching[:-1]:  # (two generations with one key id: 2^-32 a pair)
            try:
                return secret.decrypt(writer, key, sub_key, stored)
            except RecordUnreadable:
                continue
        return matching[-1].decrypt(writer, key, sub_key, stored)
