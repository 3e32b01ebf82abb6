"""The handshake's I/O: TLS, then the two HELLO frames of tls.py, on a fresh socket or on a pipe
(pipes.py: a relayed stream) or a secured channel of another kind (webrtc.py: DTLS).

The caller bounds the whole exchange with one deadline. Hellos are read with exact-size reads
(never past the hello), so frames the peer pipelines after its hello stay in the socket for the
link's reader.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..identity import Identity
from .addresses import PeerAddress
from .errors import HandshakeError, ProtocolViolation, TransportClosed
from .frames import FrameDecoder, FrameType, encode_head
from .pipes import BioTlsIO, Pipe
from .sockio import PlainIO, SocketIO, TlsIO
from .tls import (
    PLAIN_CERT_HASH,
    PeerHello,
    cert_hash,
    client_hello,
    new_nonce,
    server_hello,
    verify_client_hello,
    verify_server_hello,
)

HELLO_MAX_HEADER = 16 * 1024


@dataclass
class Handshaken:
    io: SocketIO | Pipe
    peer: PeerHello


async def _read_hello(io: SocketIO | Pipe) -> dict[str, Any]:
    decoder = FrameDecoder(max_header=HELLO_MAX_HEADER, max_payload=0)
    while True:
        target = decoder.next_target()
        count = await io.recv_into(target)
        if not count:
            raise HandshakeError("the peer closed the connection during the handshake")
        try:
            frame = decoder.advance(count)
        except ProtocolViolation as exc:
            raise HandshakeError(f"bad hello frame: {exc}") from exc
        if frame is None:
            continue
        if frame.type != FrameType.HELLO or frame.stream_id != 0:
            raise HandshakeError(f"expected a hello frame, got {frame.type.name}")
        return frame.header


async def _send_hello(io: SocketIO | Pipe, hello: dict[str, Any]) -> None:
    await io.send_all([encode_head(FrameType.HELLO, 0, hello, 0)])


async def _start_tls(sock: socket.socket, context: ssl.SSLContext, *, server_side: bool) -> TlsIO:
    """TLS on the fresh socket; HandshakeError (socket closed) if it fails."""
    tls = TlsIO(context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False))
    try:
        await tls.handshake()
    except (ssl.SSLError, OSError) as exc:
        tls.close()
        raise HandshakeError(f"TLS handshake failed: {exc}") from exc
    except BaseException:
        tls.close()
        raise
    return tls


async def _exchange(io: SocketIO | Pipe, hellos: Callable[[], Awaitable[PeerHello]]) -> Handshaken:
    """Run the hello exchange; on any failure the connection is closed."""
    try:
        peer = await hellos()
    except TransportClosed as exc:
        io.close()
        raise HandshakeError(f"connection lost during the handshake: {exc}") from exc
    except BaseException:
        io.close()
        raise
    return Handshaken(io, peer)


async def hello_as_server(io: Pipe, identity: Identity, own_hash: bytes,
                          addresses: list[PeerAddress]) -> Handshaken:
    """The hellos on a secured pipe where this side holds the certificate whose hash is
    `own_hash` (TLS server, or the WebRTC side whose DTLS fingerprint is hashed)."""

    async def hellos() -> PeerHello:
        nonce = new_nonce()
        await _send_hello(io, server_hello(identity, own_hash, nonce, addresses))
        return verify_client_hello(await _read_hello(io), own_hash, nonce)

    return await _exchange(io, hellos)


async def hello_as_client(io: Pipe, identity: Identity, server_hash: bytes,
                          expected_peer_id: str | None, addresses: list[PeerAddress]) -> Handshaken:
    """The hellos on a secured pipe whose other end holds the certificate hashed `server_hash`."""

    async def hellos() -> PeerHello:
        peer, nonce = verify_server_hello(await _read_hello(io), server_hash, expected_peer_id)
        await _send_hello(io, client_hello(identity, server_hash, nonce, addresses))
        return peer

    return await _exchange(io, hellos)


async def server_handshake(sock: socket.socket, identity: Identity, context: ssl.SSLContext | None,
                           own_cert_der: bytes | None, addresses: list[PeerAddress]) -> Handshaken:
    """Run on an accepted socket (non-blocking); the caller owns the deadline and the socket."""
    if context is None:
        return await hello_as_server(PlainIO(sock), identity, PLAIN_CERT_HASH, addresses)
    tls = await _start_tls(sock, context, server_side=True)
    return await hello_as_server(tls, identity, cert_hash(own_cert_der), addresses)


async def client_handshake(sock: socket.socket, identity: Identity, context: ssl.SSLContext | None,
                           expected_peer_id: str | None, addresses: list[PeerAddress]) -> Handshaken:
    """Run on a connected socket (non-blocking); the caller owns the deadline."""
    if context is None:
        return await hello_as_client(PlainIO(sock), identity, PLAIN_CERT_HASH, expected_peer_id,
                                     addresses)
    tls = await _start_tls(sock, context, server_side=False)
    return await hello_as_client(tls, identity, _server_hash(tls), expected_peer_id, addresses)


def _server_hash(tls: TlsIO | BioTlsIO) -> bytes:
    """The hash of the certificate the TLS server presented (closes the connection if none)."""
    der = tls.peer_certificate()
    if der is None:
        tls.close()
        raise HandshakeError("the peer presented no TLS certificate")
    return cert_hash(der)


async def _pipe_tls(pipe: Pipe, context: ssl.SSLContext, *, server_side: bool) -> BioTlsIO:
    tls = BioTlsIO(pipe, context, server_side=server_side)
    try:
        await tls.handshake()
    except TransportClosed as exc:
        tls.close()
        raise HandshakeError(str(exc)) from exc
    except BaseException:
        tls.close()
        raise
    return tls


async def pipe_server_handshake(pipe: Pipe, identity: Identity, context: ssl.SSLContext,
                                own_cert_der: bytes, addresses: list[PeerAddress]) -> Handshaken:
    """TLS (server side) and the hellos over a pipe that is not our socket (a relayed stream)."""
    tls = await _pipe_tls(pipe, context, server_side=True)
    return await hello_as_server(tls, identity, cert_hash(own_cert_der), addresses)


async def pipe_client_handshake(pipe: Pipe, identity: Identity, context: ssl.SSLContext,
                                expected_peer_id: str | None, addresses: list[PeerAddress]) -> Handshaken:
    """TLS (client side) and the hellos over a pipe; the far end is checked to be `expected_peer_id`
    end to end, whatever carries the bytes."""
    tls = await _pipe_tls(pipe, context, server_side=False)
    return await hello_as_client(tls, identity, _server_hash(tls), expected_peer_id, addresses)
