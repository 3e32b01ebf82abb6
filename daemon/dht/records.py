"""Signed, expiring DHT records: one value under a key, or under a (key, sub-key) pair.

Every entry carries its writer's peer id and an Ed25519 signature over a canonical encoding of
(key, sub-key, expiration, value). Rules, checked by `validate` on store and again by the reader:
- the signature must verify against the writer's peer id (peer ids embed the public key);
- a sub-key that is a peer id may only be written by that peer (`ForbiddenWrite`);
- key, sub-key and value sizes are bounded (`RecordTooLarge`);
- the expiration is an absolute unix time in (now, now + max_ttl] (`RecordExpired`).
Newer expiration wins for the same (key, sub-key); `RecordStore` (storage.py) enforces that.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass

from ..identity import Identity, public_key_of, verify
from .errors import BadSignature, ForbiddenWrite, RecordExpired, RecordTooLarge

_DOMAIN = b"dedloc-dht-record-v1\0"
MAX_PROOF_CHARS = 2048


@dataclass(frozen=True)
class RecordLimits:
    max_key_bytes: int = 512
    max_sub_key_bytes: int = 512
    max_value_bytes: int = 64 * 1024
    max_ttl: float = 7 * 24 * 3600.0
    max_entries: int = 100_000  # per node, all keys together
    max_bytes: int = 64 * 1024 * 1024  # per node: values + keys + sub-keys
    max_sub_keys: int = 1024  # per key
    max_key_total_bytes: int = 1024 * 1024  # per key, all its sub-keys together (bounds a reply)
    max_signer_bytes: int = 4 * 1024 * 1024  # per node, everything one signer wrote
    max_sub_keys_per_signer: int = 16  # per key (an honest peer writes its own sub-key only)
    max_signer_key_bytes: int = 128 * 1024  # per key, all of one signer's sub-keys together


@dataclass(frozen=True)
class Entry:
    """One stored value. `sub_key` is None for a plain value."""

    key: str
    sub_key: str | None
    value: bytes
    expiration: float
    signer: str
    signature: bytes
    # A closed run's membership token of the signer (not signed here: it is signed by the run's
    # owner and names the signer); nodes that store the entry check it and pass it on.
    proof: str | None = None

    @functools.cached_property
    def signature_hex(self) -> str:
        """The signature as the wire carries it (one entry is sent to many readers)."""
        return self.signature.hex()

    @property
    def size(self) -> int:
        return len(self.value) + len(self.key) + len(self.sub_key or "") + len(self.proof or "") + 160

    @classmethod
    def create(cls, identity: Identity, key: str, value: bytes, expiration: float,
               sub_key: str | None = None) -> Entry:
        value = bytes(value)
        signature = identity.sign(signing_bytes(key, sub_key, value, expiration))
        return cls(key, sub_key, value, float(expiration), identity.peer_id, signature)


def signing_bytes(key: str, sub_key: str | None, value: bytes, expiration: float) -> bytes:
    """The canonical bytes a writer signs: length-prefixed fields, the value by its SHA-256."""
    key_bytes = key.encode()
    sub_bytes = b"" if sub_key is None else sub_key.encode()
    return b"".join((
        _DOMAIN,
        struct.pack(">I", len(key_bytes)), key_bytes,
        struct.pack(">BI", sub_key is not None, len(sub_bytes)), sub_bytes,
        struct.pack(">d", expiration),
        hashlib.sha256(value).digest(),
    ))


@functools.lru_cache(maxsize=16384)
def _verified(signer: str, signature: bytes, message: bytes) -> bool:
    """Ed25519 verification, remembered: the same entry comes back from every replica."""
    return verify(signer, signature, message)


@functools.lru_cache(maxsize=16384)
def is_peer_id(text: str) -> bool:
    try:
        public_key_of(text)
    except ValueError:
        return False
    return True


def validate(entry: Entry, now: float, limits: RecordLimits) -> None:
    """Raise an `InvalidRecord` subclass unless `entry` may be stored or believed at `now`."""
    if len(entry.key.encode()) > limits.max_key_bytes:
        raise RecordTooLarge(f"key is over {limits.max_key_bytes} bytes")
    if entry.sub_key is not None and len(entry.sub_key.encode()) > limits.max_sub_key_bytes:
        raise RecordTooLarge(f"sub-key is over {limits.max_sub_key_bytes} bytes")
    if entry.proof is not None and len(entry.proof) > MAX_PROOF_CHARS:
        raise RecordTooLarge(f"proof is over {MAX_PROOF_CHARS} characters")
    if len(entry.value) > limits.max_value_bytes:
        raise RecordTooLarge(f"value of {len(entry.value)} bytes is over {limits.max_value_bytes}")
    if not entry.expiration > now:  # also refuses NaN
        raise RecordExpired(f"record for {entry.key!r} expired at {entry.expiration}")
    if entry.expiration > now + limits.max_ttl:
        raise RecordExpired(f"expiration {entry.expiration} is more than {limits.max_ttl} s ahead")
    if entry.sub_key is not None and entry.sub_key != entry.signer and is_peer_id(entry.sub_key):
        raise ForbiddenWrite(f"sub-key {entry.sub_key} of {entry.key!r} can only be written by "
                             f"that peer, not by {entry.signer}")
    message = signing_bytes(entry.key, entry.sub_key, entry.value, entry.expiration)
    if not _verified(entry.signer, entry.signature, message):
        raise BadSignature(f"bad signature on {entry.key!r}/{entry.sub_key} by {entry.signer}")


@dataclass(frozen=True)
class Record:
    """What `DHTNode.get` returns: the live entries of one key, either one plain entry or the
    sub-key entries (at most one per sub-key). `complete`: False when the read's lookup was cut
    short by its deadline (nodes it meant to ask were not asked: what they hold is missing)."""

    key: str
    entries: tuple[Entry, ...]
    complete: bool = True

    @property
    def has_sub_keys(self) -> bool:
        return any(entry.sub_key is not None for entry in self.entries)

    @property
    def value(self) -> bytes:
        """The plain value; ValueError if the key holds sub-keys."""
        if self.has_sub_keys or len(self.entries) != 1:
            raise ValueError(f"{self.key!r} holds sub-keys, not a plain value")
        return self.entries[0].value

    @property
    def sub_keys(self) -> dict[str, Entry]:
        return {entry.sub_key: entry for entry in self.entries if entry.sub_key is not None}

    @property
    def own_sub_keys(self) -> dict[str, Entry]:
        """The sub-keys that are their writer's own peer id: what a key with one entry per peer
        (progress boards, matchmaking, manifests) counts. Anyone may write a sub-key that is not
        a peer id ("1", "11", ...): one identity could write a thousand of those, so readers
        that count peers must take only these."""
        return {entry.sub_key: entry for entry in self.entries
                if entry.sub_key is not None and entry.sub_key == entry.signer}

    @property
    def expiration(self) -> float:
        return max(entry.expiration for entry in self.entries)


def merge_entries(entries: list[Entry], now: float) -> list[Entry]:
    """Resolve entries of one key gathered from several nodes by the store's rules: per
    (sub-)key the latest expiration wins, and a plain value wins over sub-keys only if it expires
    after all of them (sub-keys that expire before the plain value are shadowed by it)."""
    plain: Entry | None = None
    subs: dict[str, Entry] = {}
    for entry in entries:
        if entry.expiration <= now:
            continue
        if entry.sub_key is None:
            if plain is None or entry.expiration > plain.expiration:
                plain = entry
        else:
            old = subs.get(entry.sub_key)
            if old is None or entry.expiration > old.expiration:
                subs[entry.sub_key] = entry
    newest_sub = max((entry.expiration for entry in subs.values()), default=float("-inf"))
    if plain is not None and plain.expiration > newest_sub:
        return [plain]
    floor = plain.expiration if plain is not None else float("-inf")
    return sorted((entry for entry in subs.values() if entry.expiration > floor),
                  key=lambda entry: entry.sub_key or "")
