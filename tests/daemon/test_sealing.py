"""Sealed boxes to a peer id: both sides meet on one X25519 key, and only the peer opens a box."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from dedloc.daemon.identity import Identity
from dedloc.daemon.sealing import (
    SEAL_OVERHEAD,
    SealError,
    open_sealed,
    seal,
    x25519_private_of,
    x25519_public_of,
)

RAW = serialization.Encoding.Raw


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(RAW, serialization.PublicFormat.Raw)


def test_the_conversion_matches_libsodiums_vector() -> None:
    # libsodium's test/default/ed25519_convert: the Ed25519 key pair of this seed maps to
    # these X25519 keys (crypto_sign_ed25519_pk_to_curve25519 and _sk_to_curve25519).
    identity = Identity.from_seed(bytes.fromhex(
        "421151a459faeade3d247115f94aedae42318124095afabe4d1451a559faedee"))
    assert x25519_public_of(identity.peer_id).hex() == (
        "f1814f0e8ff1043d8a44d25babff3cedcae6c22c3edaa48f857ae70de2baae50")
    private = x25519_private_of(identity)
    assert private.private_bytes(RAW, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption()).hex() == (
        "8052030376d47112be7f73ed7a019293dd12ad910b654455798b4667d73de166")


@pytest.mark.parametrize("seed", range(8))
def test_both_sides_reach_the_same_shared_secret(seed: int) -> None:
    identity = Identity.from_seed(bytes([seed]) * 32)
    public = x25519_public_of(identity.peer_id)
    # the private scalar's own public key is the converted peer id
    assert _public_bytes(x25519_private_of(identity)) == public
    other = X25519PrivateKey.from_private_bytes(bytes([seed + 100]) * 32)
    ours = other.exchange(X25519PublicKey.from_public_bytes(public))
    theirs = x25519_private_of(identity).exchange(X25519PublicKey.from_public_bytes(
        _public_bytes(other)))
    assert ours == theirs and ours != bytes(32)


def test_a_box_opens_for_its_peer_and_context_only() -> None:
    peer, stranger = Identity.generate(), Identity.generate()
    box = seal(peer.peer_id, b"the run key", b"owner/club")
    assert len(box) == len(b"the run key") + SEAL_OVERHEAD
    assert open_sealed(peer, box, b"owner/club") == b"the run key"
    assert seal(peer.peer_id, b"the run key", b"owner/club") != box  # a fresh key each time
    with pytest.raises(SealError, match="not sealed to this peer"):
        open_sealed(stranger, box, b"owner/club")
    with pytest.raises(SealError, match="not sealed to this peer"):
        open_sealed(peer, box, b"owner/other-run")
    for index in (0, 31, 32, len(box) - 1):  # the ephemeral key, the ciphertext, the tag
        altered = bytearray(box)
        altered[index] ^= 1
        with pytest.raises(SealError):
            open_sealed(peer, bytes(altered), b"owner/club")
    with pytest.raises(SealError, match="at least"):
        open_sealed(peer, box[:40], b"owner/club")


def test_peer_ids_that_name_no_usable_key_are_refused() -> None:
    for text in ("not-a-peer-id", "0OIl", Identity.generate().peer_id[:-4]):
        with pytest.raises(SealError):
            seal(text, b"x", b"")
