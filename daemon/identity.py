"""The peer's Ed25519 identity: a key in the state directory and the peer id derived from it.

The peer id is the base58btc text of the multicodec-tagged public key (0xed 0x01 + 32 bytes), so
anyone holding a peer id can check that peer's signatures without asking for its key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import IdentityError

log = structlog.get_logger(__name__)

_ED25519_PUB_TAG = b"\xed\x01"
_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
KEY_FILE = "identity.key"


def base58_encode(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    text = ""
    while number:
        number, digit = divmod(number, 58)
        text = _ALPHABET[digit] + text
    zeros = len(data) - len(data.lstrip(b"\0"))
    return _ALPHABET[0] * zeros + text


def base58_decode(text: str) -> bytes:
    number = 0
    for char in text:
        digit = _ALPHABET.find(char)
        if digit < 0:
            raise ValueError(f"{char!r} is not a base58 character")
        number = number * 58 + digit
    zeros = len(text) - len(text.lstrip(_ALPHABET[0]))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * zeros + body


def peer_id_of(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base58_encode(_ED25519_PUB_TAG + raw)


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The public key a peer id names; ValueError if the text is not a peer id."""
    raw = base58_decode(peer_id)
    if len(raw) != 34 or not raw.startswith(_ED25519_PUB_TAG):
        raise ValueError(f"{peer_id!r} is not a dedloc peer id")
    return Ed25519PublicKey.from_public_bytes(raw[2:])


def verify(peer_id: str, signature: bytes, message: bytes) -> bool:
    try:
        public_key_of(peer_id).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey
    peer_id: str

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    @classmethod
    def generate(cls) -> Identity:
        key = Ed25519PrivateKey.generate()
        return cls(key, peer_id_of(key.public_key()))

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte private key (for reproducible simulations and tests)."""
        key = Ed25519PrivateKey.from_private_bytes(seed)
        return cls(key, peer_id_of(key.public_key()))

    @classmethod
    def load_or_create(cls, state_dir: Path) -> Identity:
        """Read `identity.key` from the state directory, creating it (mode 0600) on first start."""
        path = state_dir / KEY_FILE
        try:
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            return cls._read(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise IdentityError(f"cannot use state directory {state_dir}: {exc}") from exc
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            os.link(tmp, path)  # fails if another process created it meanwhile: theirs wins
        except FileExistsError:
            return cls._read(path)
        except OSError as exc:
            raise IdentityError(f"cannot write identity key {path}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        identity = cls(key, peer_id_of(key.public_key()))
        log.info("identity_created", peer_id=identity.peer_id, path=str(path))
        return identity

    @classmethod
    def _read(cls, path: Path) -> Identity:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("identity_key_permissions_fixed", path=str(path), mode=oct(mode))
            os.chmod(path, 0o600)
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except ValueError as exc:
            raise IdentityError(f"{path} is not a valid key: {exc}; move it away to create a "
                                "new identity (the peer id will change)") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key, peer_id_of(key.public_key()))
