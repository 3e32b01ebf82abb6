"""A WebRTC data channel as the byte pipe under a `Link` (for peers behind NATs).

`webrtc_connect` runs on both sides of a connection that a signalling path (`Signaller`, in
practice a relayed link) sets up: the offerer sends an SDP offer, the answerer an SDP answer, ICE
finds a path, DTLS encrypts it, one SCTP data channel (ordered, reliable) carries the link's bytes.
Then the same two HELLO frames as over TLS (tls.py, handshake.py) bind each side's peer id to the
DTLS certificates; the result is a `Handshaken` whose `io` (a `DataChannelIO`) is a drop-in pipe
for `Link` (`kind`, `recv_into`, `send_all`, `close`).

Why the hellos stop a relay in the middle
-----------------------------------------
The relay that carries the SDP could swap the DTLS fingerprints in the offer and the answer for its
own and terminate DTLS with each side (each side's DTLS then checks the relay's certificate against
the relay's fingerprint, and succeeds). The hellos defeat that, exactly as they defeat a TLS MITM:

- the answerer plays "server": it signs SERVER_DOMAIN + SHA-256 of *its own* DTLS certificate;
- the offerer plays "client": its `server_hash` is the SHA-256 fingerprint the answer it applied
  announced, i.e. the certificate its DTLS session actually verified (aiortc fails DTLS unless
  every supported fingerprint of the remote description matches the presented certificate), and
  it signs CLIENT_DOMAIN + that hash + the answerer's fresh nonce.

With a relay in the middle, the offerer's DTLS peer is the relay, so the hash the offerer expects
(the relay's) differs from the one the answerer signed (its own), and the hash the offerer signs
differs from the answerer's own: both checks fail, and the relay cannot re-sign without the peers'
Ed25519 keys. A relay that leaves the fingerprints alone cannot complete DTLS at all (no private
key). Either way the connection fails; it never succeeds with a relay in the middle.

Bounds and hygiene
------------------
- The whole exchange (signalling, ICE, DTLS, SCTP, hellos) is bounded by the caller's `deadline`
  (a `loop.time()`); on expiry the peer connection is closed and PeerUnreachableError (no path) or
  HandshakeError (the hellos) is raised at once, not after aiortc's own ICE timeouts.
- `ice_servers` is always passed to aiortc, even empty: with no list at all aiortc would query a
  public STUN server (stun.l.google.com), which a daemon must never do on its own.
- The remote SDP is checked before use: size, a single data-channel section, at most
  `MAX_REMOTE_CANDIDATES` candidates; mDNS (`.local`) candidates are dropped (resolving them
  would multicast queries on the LAN; our peers never announce them).

Throughput (aiortc 1.16, pure Python SCTP): every DATA chunk carries at most 1160 bytes of user data
in its own packet (one DTLS record, one UDP datagram, no bundling) and the receiver sends a SACK
for every packet (no delayed ack), so the cost is per ~1 KB packet and CPU-bound: about 20 MB/s
with each side on its own core (~3 CPU-seconds per side for 64 MiB), about 12 MB/s with both in
one process. Several data channels share the same SCTP association, DTLS session and event loop,
so striping over channels does not raise it (measured: the same CPU per byte with 1, 2 and 4
channels): one channel is used.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import aioice.turn
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.exceptions import InvalidStateError
from aiortc.rtcdtlstransport import RTCDtlsFingerprint
from aiortc.sdp import SessionDescription

from ..identity import Identity
from .addresses import PeerAddress
from .errors import HandshakeError, PeerIdMismatchError, PeerUnreachableError, TransportClosed, TransportError
from .handshake import Handshaken, _read_hello, _send_hello
from .tls import client_hello, new_nonce, server_hello, verify_client_hello, verify_server_hello

Buffer = bytes | bytearray | memoryview

# aioice asks for 256 KiB UDP receive buffers; a receiver that falls behind for a moment then
# drops packets, and aiortc's SCTP recovers slowly (one packet per round trip). 4 MiB removed
# every receive-buffer drop in benchmarks/transport.py --kind webrtc (shaped 50 Mbit/s, 40 ms).
aioice.turn.UDP_SOCKET_BUFFER_SIZE = max(aioice.turn.UDP_SOCKET_BUFFER_SIZE, 4 << 20)

CHANNEL_LABEL = "dedloc/link"
CHANNEL_ID = 0  # negotiated out of band (both sides create it): no DCEP round trip, no race
MAX_SDP_BYTES = 64 * 1024
MAX_REMOTE_CANDIDATES = 32
# aiortc announces (and accepts) 256 KiB messages; RFC 8841 says to assume 64 KiB when the remote
# description names no max-message-size. Measured from 16 to 256 KiB, the size makes no difference
# to throughput (the per-packet cost dominates; bigger messages save per-message work when sending,
# but aiortc reassembles a message by rescanning its fragments as each arrives, quadratic in the
# fragments): 64 KiB, which every WebRTC peer accepts, and the smaller, the sooner the reader sees
# the first bytes.
MESSAGE_BYTES = 64 * 1024
HIGH_WATER = 1024 * 1024  # wait before sending while more than this waits in the channel's buffer
LOW_WATER = 512 * 1024  # ... until aiortc says it fell to this ("bufferedamountlow")
MAX_QUEUED_BYTES = 64 * 1024 * 1024  # received but not yet read: past it the peer is flooding
CLOSE_GRACE = 5.0  # a graceful close waits this long for the peer to take what was sent


class Signaller(Protocol):
    """The path that carries the offer and the answer (a relayed link in the daemon)."""

    async def send(self, message: dict[str, Any]) -> None: ...

    async def receive(self, timeout: float) -> dict[str, Any]:
        """The next message; TimeoutError when none came in `timeout` seconds."""
        ...


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


_BACKGROUND: set[asyncio.Task[None]] = set()  # closers still running (tasks are weakly held)


class DataChannelIO:
    """The link's byte pipe over one ordered, reliable data channel.

    Sending cuts the byte stream into messages of at most `message_bytes` (aiortc takes `bytes`
    only: one copy) and waits, before each, while the channel buffers more than `high_water`
    bytes, until aiortc's "bufferedamountlow" event (`bufferedAmountLowThreshold` = `low_water`):
    the memory a fast sender holds stays bounded (`bufferedAmount` <= high_water + one message).
    Receiving copies from the queue of received messages, keeping partial remainders; it returns
    0 once the channel is closed (after what was received) and raises TransportClosed when the
    connection failed or after our own close().

    close() is graceful like a TCP FIN: the channel's stream is reset after the data already
    queued (the peer reads it all, then EOF), then the peer connection is closed; `wait_closed()`
    awaits the end of that.
    """

    kind = "webrtc"

    def __init__(self, pc: RTCPeerConnection, channel: RTCDataChannel, *,
                 message_bytes: int = MESSAGE_BYTES, high_water: int = HIGH_WATER,
                 low_water: int = LOW_WATER, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        if not 0 < low_water < high_water:
            raise ValueError("need 0 < low_water < high_water")
        self.pc = pc
        self.channel = channel
        self.message_bytes = message_bytes
        self.high_water = high_water
        self.max_queued_bytes = max_queued_bytes
        self.closed = False  # close() was called
        self.eof = False  # the channel closed (gracefully)
        self.failed: str | None = None  # the connection failed (or the peer flooded us)
        self.max_buffered = 0  # the most bufferedAmount seen after a send (tests, stats)
        self.max_queued = 0
        self._loop = asyncio.get_running_loop()
        self._inbox: deque[bytes] = deque()
        self._offset = 0  # bytes of _inbox[0] already read
        self._queued = 0  # bytes in _inbox not yet read
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._opened: asyncio.Future[None] = self._loop.create_future()
        self._closer: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()  # the channel closed or the connection failed
        channel.bufferedAmountLowThreshold = low_water
        channel.on("open", self._on_open)
        channel.on("message", self._on_message)
        channel.on("bufferedamountlow", self._on_low)
        channel.on("close", self._on_close)
        pc.on("connectionstatechange", self._on_state)
        if channel.readyState == "open":
            self._on_open()

    # --- events from aiortc (plain callbacks, run in the loop) ---------------------------------
    def _on_open(self) -> None:
        _wake(self._opened)

    def _on_message(self, message: bytes | str) -> None:
        if isinstance(message, str) or self.closed or self.failed is not None:
            return  # our peers send binary only; after close() nobody reads
        self._inbox.append(message)
        self._queued += len(message)
        self.max_queued = max(self.max_queued, self._queued)
        if self._queued > self.max_queued_bytes:
            self._fail(f"the peer sent {self._queued} bytes that were not read yet")
            self.close()
        _wake(self._readable)

    def _on_low(self) -> None:
        _wake(self._writable)

    def _on_close(self) -> None:
        self.eof = True
        self._wake_all()

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed") and not self.eof:
            self._fail(f"the WebRTC connection is {self.pc.connectionState}")

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
        self._wake_all()

    def _wake_all(self) -> None:
        if self.eof or self.failed is not None:
            self._ended.set()
        _wake(self._readable)
        _wake(self._writable)
        if not self._opened.done():
            self._opened.set_exception(TransportClosed(self.failed or "the data channel closed"))
            self._opened.exception()  # retrieved: nobody may be waiting

    # --- the pipe -----------------------------------------------------------------------------
    async def wait_open(self) -> None:
        """Until the channel opens; TransportClosed if the connection fails or closes first."""
        await asyncio.shield(self._opened)

    async def recv_into(self, buffer: memoryview) -> int:
        while not self._inbox:
            if self.closed:
                raise TransportClosed("the WebRTC pipe is closed")
            if self.failed is not None:
                raise TransportClosed(self.failed)
            if self.eof:
                return 0
            self._readable = self._loop.create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        if self.closed:
            raise TransportClosed("the WebRTC pipe is closed")
        filled, want = 0, len(buffer)
        while self._inbox and filled < want:
            head = self._inbox[0]
            count = min(len(head) - self._offset, want - filled)
            buffer[filled:filled + count] = head[self._offset:self._offset + count]
            filled += count
            self._offset += count
            if self._offset == len(head):
                self._inbox.popleft()
                self._offset = 0
        self._queued -= filled
        return filled

    async def _send_message(self, data: bytes) -> None:
        channel = self.channel
        while True:
            if self.closed or self.eof or self.failed is not None:
                raise TransportClosed(self.failed or "the WebRTC pipe is closed")
            if channel.bufferedAmount <= self.high_water:
                break
            self._writable = self._loop.create_future()
            try:
                await self._writable
            finally:
                self._writable = None
        try:
            channel.send(data)
        except InvalidStateError:
            raise TransportClosed("the data channel is not open") from None
        self.max_buffered = max(self.max_buffered, channel.bufferedAmount)

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        size = self.message_bytes
        pending = bytearray()
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while view:
                if not pending and len(view) >= size:
                    await self._send_message(bytes(view[:size]))
                    view = view[size:]
                    continue
                take = min(size - len(pending), len(view))
                pending += view[:take]
                view = view[take:]
                if len(pending) == size:
                    await self._send_message(bytes(pending))
                    pending.clear()
        if pending:
            await self._send_message(bytes(pending))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._wake_all()
        self._closer = self._loop.create_task(self._shutdown(graceful=self.failed is None),
                                              name="webrtc-close")
        _BACKGROUND.add(self._closer)
        self._closer.add_done_callback(_BACKGROUND.discard)

    async def wait_closed(self) -> None:
        """After close(): until the peer connection is closed."""
        if self._closer is not None:
            await asyncio.shield(self._closer)

    async def _shutdown(self, *, graceful: bool) -> None:
        if graceful and self.channel.readyState == "open" and self.pc.connectionState == "connected":
            self.channel.close()  # a stream reset, sent after the messages already queued
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_GRACE):
                    await self._ended.wait()  # the peer reset its side too (or the link died)
        await self.pc.close()


# --- SDP checks ---------------------------------------------------------------------------------
def _sha256_fingerprint(fingerprints: list[RTCDtlsFingerprint], whose: str) -> bytes:
    for fingerprint in fingerprints:
        if fingerprint.algorithm.lower() == "sha-256":
            try:
                raw = bytes.fromhex(fingerprint.value.replace(":", ""))
            except ValueError:
                break
            if len(raw) == 32:
                return raw
            break
    raise HandshakeError(f"{whose} DTLS certificate has no valid sha-256 fingerprint")


def _checked_sdp(message: dict[str, Any], kind: str) -> tuple[str, SessionDescription]:
    """The remote SDP of a signalling message, checked; mDNS candidates dropped."""
    if not isinstance(message, dict):
        raise HandshakeError("the signalling message is not an object")
    if message.get("type") == "error":
        raise PeerUnreachableError(f"the peer gave up on WebRTC: {str(message.get('reason'))[:200]}")
    text = message.get("sdp")
    if message.get("type") != kind or not isinstance(text, str):
        raise HandshakeError(f"expected an SDP {kind}, got {str(message.get('type'))[:40]!r}")
    if len(text) > MAX_SDP_BYTES:
        raise HandshakeError(f"the SDP {kind} is over {MAX_SDP_BYTES} bytes")
    lines = [line for line in text.splitlines()
             if not (line.startswith("a=candidate:") and _is_mdns(line))]
    text = "\r\n".join(lines) + "\r\n"
    try:
        parsed = SessionDescription.parse(text)
    except Exception as exc:
        raise HandshakeError(f"bad SDP {kind}: {exc!r}") from exc
    if len(parsed.media) != 1 or parsed.media[0].kind != "application":
        raise HandshakeError(f"the SDP {kind} must have exactly one data-channel section")
    media = parsed.media[0]
    if len(media.ice_candidates) > MAX_REMOTE_CANDIDATES:
        raise HandshakeError(f"the SDP {kind} has {len(media.ice_candidates)} candidates, over "
                             f"{MAX_REMOTE_CANDIDATES}")
    if media.dtls is None:
        raise HandshakeError(f"the SDP {kind} has no DTLS fingerprint")
    _sha256_fingerprint(media.dtls.fingerprints, "the remote")
    return text, parsed


def _is_mdns(candidate_line: str) -> bool:
    parts = candidate_line.split()
    return len(parts) > 4 and parts[4].lower().endswith(".local")


def _max_message_bytes(parsed: SessionDescription) -> int:
    caps = parsed.media[0].sctpCapabilities
    remote = caps.maxMessageSize if caps is not None else 65536
    return MESSAGE_BYTES if remote == 0 else min(MESSAGE_BYTES, remote)


# --- connecting ---------------------------------------------------------------------------------
def ice_server(url: str) -> RTCIceServer:
    """`stun:host:port`, or `turn:user:password@host:port[?transport=udp]` (credentials in the
    URL, as config gives them) as aiortc's RTCIceServer."""
    scheme, _, rest = url.partition(":")
    if scheme in ("turn", "turns") and "@" in rest:
        credentials, _, location = rest.rpartition("@")
        username, _, password = credentials.partition(":")
        return RTCIceServer(f"{scheme}:{location}", username=username, credential=password)
    return RTCIceServer(url)


def _new_peer_connection(ice_servers: list[str]) -> tuple[RTCPeerConnection, RTCDataChannel]:
    # Always our list, even empty: without one aiortc would contact a public STUN server.
    config = RTCConfiguration(iceServers=[ice_server(url) for url in ice_servers])
    pc = RTCPeerConnection(config)
    channel = pc.createDataChannel(CHANNEL_LABEL, ordered=True, negotiated=True, id=CHANNEL_ID)
    return pc, channel


async def _apply_remote(pc: RTCPeerConnection, text: str, kind: str) -> None:
    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp=text, type=kind))
    except (asyncio.CancelledError, TimeoutError):
        raise
    except Exception as exc:  # untrusted input: whatever aiortc makes of it
        raise HandshakeError(f"the SDP {kind} was refused: {exc!r}") from exc


async def _wait_connected(io: DataChannelIO) -> None:
    try:
        await io.wait_open()
    except TransportClosed:
        if io.pc.iceConnectionState == "failed":
            raise PeerUnreachableError("ICE found no path to the peer") from None
        raise HandshakeError("the DTLS handshake failed (a fingerprint that does not match the "
                             "certificate: tampered signalling?)") from None


async def webrtc_connect(signaller: Signaller, identity: Identity, *, offerer: bool,
                         ice_servers: list[str], deadline: float, addresses: list[PeerAddress],
                         expected_peer_id: str | None) -> Handshaken:
    """Set up a WebRTC data channel with the peer at the other end of `signaller` and run the
    hellos over it; `deadline` (loop.time()) bounds all of it.

    The offerer plays the hello's client, the answerer its server (see the module docstring).
    `expected_peer_id` is checked on both sides (PeerIdMismatchError). Failures: PeerUnreachableError
    (no answer, no ICE path, the deadline before the channel opened, signalling lost),
    HandshakeError (bad SDP, DTLS failed, bad hellos or the deadline during them). On any failure
    the peer connection is closed before the error is raised.
    """
    loop = asyncio.get_running_loop()
    pc, channel = _new_peer_connection(ice_servers)
    io = DataChannelIO(pc, channel)
    stage = "signalling"
    try:
        async with asyncio.timeout_at(deadline):
            if offerer:
                await pc.setLocalDescription(await pc.createOffer())  # gathers all candidates
                await signaller.send({"type": "offer", "sdp": pc.localDescription.sdp})
                answer = await signaller.receive(timeout=max(0.0, deadline - loop.time()))
                text, parsed = _checked_sdp(answer, "answer")
                server_hash = _sha256_fingerprint(parsed.media[0].dtls.fingerprints, "the answerer's")
                io.message_bytes = _max_message_bytes(parsed)
                await _apply_remote(pc, text, "answer")
            else:
                offer = await signaller.receive(timeout=max(0.0, deadline - loop.time()))
                try:
                    text, parsed = _checked_sdp(offer, "offer")
                    io.message_bytes = _max_message_bytes(parsed)
                    await _apply_remote(pc, text, "offer")
                except HandshakeError as exc:
                    with contextlib.suppress(Exception):
                        await signaller.send({"type": "error", "reason": str(exc)[:200]})
                    raise
                await pc.setLocalDescription(await pc.createAnswer())
                await signaller.send({"type": "answer", "sdp": pc.localDescription.sdp})
            stage = "connecting"
            await _wait_connected(io)
            stage = "hello"
            if offerer:
                peer, nonce = verify_server_hello(await _read_hello(io), server_hash, expected_peer_id)
                await _send_hello(io, client_hello(identity, server_hash, nonce, addresses))
            else:
                own_hash = _sha256_fingerprint(pc.sctp.transport.getLocalParameters().fingerprints,
                                               "our")
                nonce = new_nonce()
                await _send_hello(io, server_hello(identity, own_hash, nonce, addresses))
                peer = verify_client_hello(await _read_hello(io), own_hash, nonce)
                if expected_peer_id is not None and peer.peer_id != expected_peer_id:
                    raise PeerIdMismatchError(f"expected peer {expected_peer_id} but peer "
                                              f"{peer.peer_id} answered over WebRTC")
    except BaseException as exc:
        await _discard(io)
        if isinstance(exc, TimeoutError):
            if stage == "hello":
                raise HandshakeError("the WebRTC hellos did not finish by the deadline") from None
            raise PeerUnreachableError(f"no WebRTC connection by the deadline ({stage})") from None
        if isinstance(exc, HandshakeError | PeerUnreachableError | PeerIdMismatchError):
            raise
        if isinstance(exc, TransportError):
            if stage == "signalling":
                raise PeerUnreachableError(f"WebRTC signalling failed: {exc}") from exc
            raise HandshakeError(f"the WebRTC connection was lost during the handshake: {exc}") from exc
        raise
    return Handshaken(io, peer)  # type: ignore[arg-type]  # Handshaken.io names the socket pipes


async def _discard(io: DataChannelIO) -> None:
    """Close the peer connection now, even if our caller is being cancelled."""
    io.failed = io.failed or "handshake failed"
    io.close()
    with contextlib.suppress(asyncio.CancelledError):
        await io.wait_closed()
