"""The hellos that bind TLS certificates to peer ids (pure: no sockets)."""

from __future__ import annotations

import ssl

import pytest

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import HandshakeError, PeerAddress, PeerIdMismatchError
from dedloc.daemon.net.tls import (
    Certificate,
    cert_hash,
    client_context,
    client_hello,
    new_nonce,
    server_context,
    server_hello,
    verify_client_hello,
    verify_server_hello,
)

ADDR = PeerAddress.parse("/ip4/127.0.0.1/tcp/4100")


def test_hellos_verify_and_carry_addresses() -> None:
    server, client = Identity.generate(), Identity.generate()
    cert = Certificate.generate()
    nonce = new_nonce()
    hello, got_nonce = verify_server_hello(server_hello(server, cert.sha256, nonce, [ADDR]),
                                           cert.sha256, server.peer_id)
    assert hello.peer_id == server.peer_id
    assert hello.addresses == (ADDR.with_peer(server.peer_id),)
    assert got_nonce == nonce
    peer = verify_client_hello(client_hello(client, cert.sha256, nonce, []), cert.sha256, nonce)
    assert peer.peer_id == client.peer_id


def test_server_hello_over_another_certificate_is_refused() -> None:
    """A relay that terminates TLS with its own certificate cannot reuse the real hello."""
    server = Identity.generate()
    real, relay = Certificate.generate(), Certificate.generate()
    hello = server_hello(server, real.sha256, new_nonce(), [])
    with pytest.raises(HandshakeError, match="not signed over the TLS certificate"):
        verify_server_hello(hello, relay.sha256, None)


def test_wrong_peer_names_both_ids() -> None:
    server, expected = Identity.generate(), Identity.generate()
    cert = Certificate.generate()
    with pytest.raises(PeerIdMismatchError) as info:
        verify_server_hello(server_hello(server, cert.sha256, new_nonce(), []), cert.sha256,
                            expected.peer_id)
    assert expected.peer_id in str(info.value)
    assert server.peer_id in str(info.value)


def test_client_hello_is_bound_to_the_nonce_and_certificate() -> None:
    client = Identity.generate()
    cert, other = Certificate.generate(), Certificate.generate()
    nonce = new_nonce()
    hello = client_hello(client, cert.sha256, nonce, [])
    with pytest.raises(HandshakeError):
        verify_client_hello(hello, cert.sha256, new_nonce())  # a replay on another connection
    with pytest.raises(HandshakeError):
        verify_client_hello(hello, other.sha256, nonce)  # relayed through another TLS session


def test_a_forged_peer_id_fails() -> None:
    """Claiming another peer's id without its key: the signature does not verify."""
    honest, forger = Identity.generate(), Identity.generate()
    cert = Certificate.generate()
    hello = server_hello(forger, cert.sha256, new_nonce(), [])
    hello["id"] = honest.peer_id
    with pytest.raises(HandshakeError):
        verify_server_hello(hello, cert.sha256, honest.peer_id)


@pytest.mark.parametrize("mutate", [
    lambda h: h.update(v=2),
    lambda h: h.update(v="1"),
    lambda h: h.pop("sig"),
    lambda h: h.update(sig="zz"),
    lambda h: h.update(sig="00" * 5000),
    lambda h: h.update(id=7),
    lambda h: h.update(id="not-a-peer-id"),
    lambda h: h.update(nonce="00"),
    lambda h: h.update(addrs="x"),
    lambda h: h.update(addrs=["/bad"]),
    lambda h: h.update(addrs=[str(ADDR)] * 33),
])
def test_malformed_server_hellos_are_handshake_errors(mutate: object) -> None:
    server = Identity.generate()
    cert = Certificate.generate()
    hello = server_hello(server, cert.sha256, new_nonce(), [ADDR])
    mutate(hello)  # type: ignore[operator]
    with pytest.raises(HandshakeError):
        verify_server_hello(hello, cert.sha256, None)


def test_contexts_are_tls13_only() -> None:
    assert server_context(Certificate.generate()).minimum_version == ssl.TLSVersion.TLSv1_3
    context = client_context()
    assert context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert context.verify_mode == ssl.CERT_NONE
    assert cert_hash(None) == bytes(32)
