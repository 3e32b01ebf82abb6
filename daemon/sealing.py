"""Sealed boxes: a few bytes that only one peer can open, sealed to its peer id.

A peer id is an Ed25519 public key (identity.py), a signing key. To encrypt to it, its point is
mapped onto Curve25519 (the birational map between the twisted Edwards curve and the Montgomery
curve: u = (1 + y) / (1 - y) mod 2^255 - 19), and its owner's X25519 private scalar is the one
Ed25519 itself signs with (the clamped first half of SHA-512 of the seed), so both sides meet on
one X25519 key without a second key pair. A box is

    ephemeral X25519 public key (32) || ChaCha20-Poly1305(key, nonce 0, plaintext, context)

with `key` = HKDF-SHA256 of the ephemeral Diffie-Hellman secret, salted with both public keys and
bound to `context` (what the box is for, e.g. a run's name): a fresh key per box, so the fixed
nonce is never used twice with one key. Opening checks the tag: a box for another peer or
another context, or one altered in transit, raises `SealError`.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import DaemonError
from .identity import Identity, base58_decode

__all__ = ["SEAL_OVERHEAD", "SealError", "open_sealed", "seal", "x25519_private_of",
           "x25519_public_of"]

_P = 2**255 - 19
_DOMAIN = b"dedloc-sealed-box-v1\0"
_NONCE = bytes(12)
_RAW = serialization.Encoding.Raw
SEAL_OVERHEAD = 32 + 16  # the ephemeral public key and the tag


class SealError(DaemonError):
    """A sealed box cannot be made (no such peer) or opened (not ours, or altered)."""


def x25519_public_of(peer_id: str) -> bytes:
    """The X25519 public key (32 bytes, little-endian u) of an Ed25519 peer id."""
    try:
        raw = base58_decode(peer_id)
    except ValueError as exc:
        raise SealError(f"{peer_id[:60]!r} is not a peer id: {exc}") from None
    if len(raw) != 34 or raw[:2] != b"\xed\x01":
        raise SealError(f"{peer_id[:60]!r} is not a dedloc peer id")
    y = int.from_bytes(raw[2:], "little") & ((1 << 255) - 1)  # (the top bit is x's sign)
    if y >= _P or y == 1:  # not a field element, or the neutral point (u would be infinite)
        raise SealError(f"peer id {peer_id[:16]} does not name a usable key")
    u = (1 + y) * pow(1 - y, _P - 2, _P) % _P
    return u.to_bytes(32, "little")


def x25519_private_of(identity: Identity) -> X25519PrivateKey:
    """The X25519 private key matching `x25519_public_of(identity.peer_id)`."""
    seed = identity.private_key.private_bytes(_RAW, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())
    scalar = bytearray(hashlib.sha512(seed).digest()[:32])
    scalar[0] &= 248
    scalar[31] &= 127
    scalar[31] |= 64
    return X25519PrivateKey.from_private_bytes(bytes(scalar))


def _box_key(shared: bytes, ephemeral: bytes, recipient: bytes, context: bytes) -> ChaCha20Poly1305:
    key = HKDF(hashes.SHA256(), 32, salt=ephemeral + recipient,
               info=_DOMAIN + context).derive(shared)
    return ChaCha20Poly1305(key)


def seal(peer_id: str, plaintext: bytes, context: bytes) -> bytes:
    """A box of `plaintext` that only `peer_id` opens, and only with the same `context`."""
    recipient = x25519_public_of(peer_id)
    ephemeral = X25519PrivateKey.generate()
    ephemeral_public = ephemeral.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
    try:
        shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient))
    except ValueError as exc:  # a low-order point: no secret to share
        raise SealError(f"peer id {peer_id[:16]} does not name a usable key") from exc
    aead = _box_key(shared, ephemeral_public, recipient, context)
    return ephemeral_public + aead.encrypt(_NONCE, plaintext, context)


def open_sealed(identity: Identity, box: bytes, context: bytes) -> bytes:
    """What `seal(identity.peer_id, ..., context)` sealed; SealError if it was not that."""
    if not isinstance(box, bytes) or len(box) < SEAL_OVERHEAD:
        raise SealError("a sealed box is at least 48 bytes")
    private = x25519_private_of(identity)
    own_public = private.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(box[:32]))
        return _box_key(shared, box[:32], own_public, context).decrypt(_NONCE, box[32:], context)
    except (InvalidTag, ValueError):
        raise SealError("the box was not sealed to this peer for this purpose, or was "
                        "altered") from None
