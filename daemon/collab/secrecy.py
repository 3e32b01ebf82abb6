"""A closed run's secret: the key its members encrypt the run's DHT records with.

The owner draws 32 random bytes when it creates a closed run and keeps them with the run's
ledger (ownership.py); each token it issues carries them sealed to the token's peer (sealing.py,
membership.py), so members learn the secret when they join and nobody else can. Every record
value under the run's keys, except the owner's public revocation list, is then stored as

    b"dlc1" || key id (4) || nonce (12) || ChaCha20-Poly1305(writer's key, nonce, value, context)

where the writer's key (one per writer: random 96-bit nonces stay far from repeating within one
writer's records) and the key id come from the secret through HKDF (the secret itself never
encrypts anything), and the associated `context` is the record's writer, DHT key and sub-key:
a ciphertext moved to another key or sub-key, or re-signed by another writer, does not open.
The DHT nodes that hold the record, members or not, keep and serve these bytes and never read
them; only members can. The key id tells a reader whether it holds the key a record was written
with (a run whose secret changed) from a record that was altered.
"""

from __future__ import annotations

import collections
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import CollaborationError

__all__ = ["RECORD_OVERHEAD", "RUN_SECRET_BYTES", "RecordUnreadable", "RunSecret"]

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
            raise RecordUnreadable("written with another key of the run than the one this peer "
                                   "holds")
        nonce = stored[head + _KEY_ID:head + _KEY_ID + _NONCE]
        try:
            return self._aead(writer).decrypt(nonce, stored[head + _KEY_ID + _NONCE:],
                                      _context(writer, key, sub_key))
        except InvalidTag:
            raise RecordUnreadable("it does not authenticate: altered, or moved from another "
                                   "key, sub-key or writer") from None
