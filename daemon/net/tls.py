"""TLS 1.3 contexts with an ephemeral certificate, and the hellos that bind TLS to peer ids.

TLS gives an encrypted channel to *some* key; the peer ids are checked by our own handshake right
after TLS, in two HELLO frames (frames.py), before anything else is accepted:

1. The server (the side that accepted) sends
   {"v": protocol version, "id": its peer id, "nonce": 32 fresh random bytes (hex),
    "sig": Ed25519 signature (hex) by its identity key over
           SERVER_DOMAIN + SHA-256(its TLS certificate, DER),
    "addrs": its listen addresses}.
2. The client checks the version, that the signature verifies under the public key the peer id
   names, against the hash of the certificate TLS actually presented (`getpeercert(True)`): a
   relay/MITM that terminates TLS with its own certificate cannot reuse the real peer's hello; and
   if it dialed an address with /p2p/<id>, that the id is the one it meant (PeerIdMismatchError
   names both).
3. The client sends {"v", "id", "sig" over CLIENT_DOMAIN + SHA-256(server certificate) + the
   server's nonce, "addrs"}: fresh for this connection, bound to the same TLS session's
   certificate. The server verifies it with its own certificate and nonce.

The whole TLS handshake + hellos run under one deadline (the transport's `handshake_timeout`).
With `tls=False` (benchmarks/tests) the same hellos run over plain TCP with an all-zero certificate
hash: identities are checked, but nothing binds them to the channel.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import secrets
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..identity import Identity, verify
from .addresses import PeerAddress
from .errors import HandshakeError, PeerIdMismatchError

PROTOCOL_VERSION = 1
SERVER_DOMAIN = b"dedloc/net/hello/v1/server\x00"
CLIENT_DOMAIN = b"dedloc/net/hello/v1/client\x00"
PLAIN_CERT_HASH = bytes(32)
MAX_HELLO_ADDRESSES = 32
_NONCE_BYTES = 32


@dataclass(frozen=True)
class Certificate:
    """An ephemeral self-signed certificate and its key (PEM), made when the transport starts."""

    cert_pem: bytes
    key_pem: bytes
    der: bytes

    @property
    def sha256(self) -> bytes:
        return hashlib.sha256(self.der).digest()

    @classmethod
    def generate(cls, common_name: str = "dedloc") -> Certificate:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return cls(cert.public_bytes(serialization.Encoding.PEM), key_pem,
                   cert.public_bytes(serialization.Encoding.DER))


def server_context(certificate: Certificate) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0  # no session resumption: every link makes a fresh handshake
    # load_cert_chain reads files only: a private temporary directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="dedloc-tls-") as tmp:
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_path.write_bytes(certificate.cert_pem)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(certificate.key_pem)
        context.load_cert_chain(cert_path, key_path)
    return context


def client_context() -> ssl.SSLContext:
    """No CA check: the peer's identity is checked by the hello, not by a certificate chain."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def cert_hash(der: bytes | None) -> bytes:
    return PLAIN_CERT_HASH if der is None else hashlib.sha256(der).digest()


@dataclass(frozen=True)
class PeerHello:
    """A verified hello: who the peer is and where it listens."""

    peer_id: str
    addresses: tuple[PeerAddress, ...]


def server_hello(identity: Identity, server_cert_hash: bytes, nonce: bytes,
                 addresses: list[PeerAddress]) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "id": identity.peer_id,
        "nonce": nonce.hex(),
        "sig": identity.sign(SERVER_DOMAIN + server_cert_hash).hex(),
        "addrs": [str(a) for a in addresses[:MAX_HELLO_ADDRESSES]],
    }


def client_hello(identity: Identity, server_cert_hash: bytes, server_nonce: bytes,
                 addresses: list[PeerAddress]) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "id": identity.peer_id,
        "sig": identity.sign(CLIENT_DOMAIN + server_cert_hash + server_nonce).hex(),
        "addrs": [str(a) for a in addresses[:MAX_HELLO_ADDRESSES]],
    }


def new_nonce() -> bytes:
    return secrets.token_bytes(_NONCE_BYTES)


def _field(hello: dict[str, Any], key: str, kind: type) -> Any:
    value = hello.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HandshakeError(f"hello field {key!r} is missing or not a {kind.__name__}")
    return value


def _hex(hello: dict[str, Any], key: str, max_len: int) -> bytes:
    text = _field(hello, key, str)
    if len(text) > 2 * max_len:
        raise HandshakeError(f"hello field {key!r} is too long")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise HandshakeError(f"hello field {key!r} is not hex") from None


def _common(hello: dict[str, Any]) -> tuple[str, bytes, tuple[PeerAddress, ...]]:
    version = _field(hello, "v", int)
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"peer speaks protocol version {version}, we speak {PROTOCOL_VERSION}")
    peer_id = _field(hello, "id", str)
    if len(peer_id) > 128:
        raise HandshakeError("hello peer id is too long")
    signature = _hex(hello, "sig", 64)
    raw_addresses = hello.get("addrs", [])
    if not isinstance(raw_addresses, list) or len(raw_addresses) > MAX_HELLO_ADDRESSES:
        raise HandshakeError("hello addresses must be a list of at most "
                             f"{MAX_HELLO_ADDRESSES} strings")
    addresses = []
    for text in raw_addresses:
        try:
            address = PeerAddress.parse(text) if isinstance(text, str) and len(text) < 256 else None
        except ValueError:
            address = None
        if address is None:
            raise HandshakeError(f"hello address {str(text)[:80]!r} is not an address")
        addresses.append(address.with_peer(peer_id))
    return peer_id, signature, tuple(addresses)


def verify_server_hello(hello: dict[str, Any], server_cert_hash: bytes,
                        expected_peer_id: str | None) -> tuple[PeerHello, bytes]:
    """Check the server's hello against the certificate TLS presented; (hello, server nonce)."""
    peer_id, signature, addresses = _common(hello)
    nonce = _hex(hello, "nonce", _NONCE_BYTES)
    if len(nonce) != _NONCE_BYTES:
        raise HandshakeError("hello nonce has the wrong length")
    if not verify(peer_id, signature, SERVER_DOMAIN + server_cert_hash):
        raise HandshakeError(f"peer {peer_id} sent a hello not signed over the TLS certificate it "
                             "presented (a relay or an impersonator)")
    if expected_peer_id is not None and peer_id != expected_peer_id:
        raise PeerIdMismatchError(f"dialed peer {expected_peer_id} but peer {peer_id} answered "
                                  "at that address")
    return PeerHello(peer_id, addresses), nonce


def verify_client_hello(hello: dict[str, Any], server_cert_hash: bytes, nonce: bytes) -> PeerHello:
    peer_id, signature, addresses = _common(hello)
    if not verify(peer_id, signature, CLIENT_DOMAIN + server_cert_hash + nonce):
        raise HandshakeError(f"client {peer_id} sent a hello with a bad signature")
    return PeerHello(peer_id, addresses)
