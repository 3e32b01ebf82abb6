"""The Ed25519 identity: created once with mode 0600, stable, and the peer id names the key."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dedloc.daemon.errors import IdentityError
from dedloc.daemon.identity import (
    Identity,
    base58_decode,
    base58_encode,
    public_key_of,
    verify,
)


def test_created_once_with_private_mode(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = Identity.load_or_create(state)
    key_file = state / "identity.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = Identity.load_or_create(state)
    assert again.peer_id == first.peer_id


def test_loose_permissions_are_tightened(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path)
    os.chmod(tmp_path / "identity.key", 0o644)
    Identity.load_or_create(tmp_path)
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600


def test_a_corrupt_key_is_reported_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "identity.key").write_bytes(b"garbage")
    with pytest.raises(IdentityError, match="not a valid key"):
        Identity.load_or_create(tmp_path)
    assert (tmp_path / "identity.key").read_bytes() == b"garbage"


def test_peer_id_carries_the_public_key() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"hello")
    assert verify(identity.peer_id, signature, b"hello")
    assert not verify(identity.peer_id, signature, b"hellO")
    assert not verify(Identity.generate().peer_id, signature, b"hello")
    assert public_key_of(identity.peer_id) is not None
    with pytest.raises(ValueError):
        public_key_of("not-a-peer-id")


@pytest.mark.parametrize("data", [b"", b"\0", b"\0\0abc", bytes(range(256)), b"\xff" * 40])
def test_base58_round_trip(data: bytes) -> None:
    assert base58_decode(base58_encode(data)) == data
