"""TCP hole punching by simultaneous open: a direct kernel TCP link between two NATed peers.

Where both NATs keep port mappings (endpoint-independent mapping: Linux MASQUERADE without
--random/fully-random, most home routers), each peer connects *from its listen port* to the other's
guessed public address at about the same moment (the two learn of each other over a relay or any
other link; who is TLS server is agreed there too, e.g. the smaller peer id, see `tls_role`). Each
outgoing SYN opens a mapping in its own NAT; a SYN that reaches the other NAT before that NAT's
own host has sent is dropped there, but the SYN sent later always finds the mapping (if A sent at
a and B at b, A's SYN reaching B's NAT at a + L passes iff a + L > b, B's iff b + L > a: at least
one does), reaches a socket still in SYN_SENT, which answers it (simultaneous open, RFC 793), and
both connects complete. So one SYN from each side suffices, however far apart they start, as
long as the first one's socket still waits. Then TLS and the hellos run as on any link
(handshake.py), and the caller hands the result to the transport (`Punched.adopt`: link kind
"holepunch").

The punching socket. `punch` binds ("0.0.0.0", local_port) with SO_REUSEADDR and SO_REUSEPORT
(the transport's listener sets SO_REUSEPORT too, see acceptor.py). Only one socket can
exist per 4-tuple (a second connect on the same local port to the same remote fails with
EADDRNOTAVAIL), so attempts are sequential: one socket stays in SYN_SENT (the kernel retransmits
its SYN; the peer's SYN is what completes it) and only an attempt that *fails* (RST or ICMP error,
as from NATs that reject unsolicited SYNs; EADDRNOTAVAIL; a failed handshake) is replaced,
`retry_interval` later. Attempts are not renewed on a timer: closing a socket in SYN_SENT and
opening another leaves a moment in which the peer's SYN meets our listener, and a SYN-ACK
answering the old socket's SYN would hit the new one and be answered with a RST that kills the
peer's half-open socket. A 4-tuple left in TIME_WAIT by an earlier link between the same two
ports does not block a new punch (Linux lets a connect from a bound port take over a TIME_WAIT
4-tuple when TCP timestamps are on, the default). SO_REUSEPORT lets any process of the same user
bind the listen port too (never listen on it: the listener was bound first, without it).

The peer's SYN can land on our *listening* socket instead (our NAT already lets it in while we
have no punching socket: we are not NATed, or behind a full-cone NAT, or between two attempts).
The transport accepts it and runs an ordinary server handshake: it gets an inbound link of kind
"tcp". On our side `punch` notices (it polls `transport.link_kind(expected_peer_id)`) and raises
`AlreadyLinked` (a success: `transport.call` now uses that link). On the peer's side, its
punching socket simply connected to a listener, which waits for a TLS ClientHello. So the
designated TLS server does not trust its role blindly: after the connect it waits up to
`role_wait` for the first bytes; silence means the other end is a listener (a server too), and it
runs the handshake as TLS client instead. The designated client always starts TLS at once, so a
real simultaneous open is not mistaken for a listener (the client's ClientHello follows its
connect within a round trip; should it come later than `role_wait`, both sides run TLS as
clients, the handshake fails, and the next attempt waits twice as long). The two ends of such a
link differ in kind: "tcp" at the listener's side, "holepunch" at the punching side.

Timing in the NAT lab (tests/net/test_holepunch.py): two port-restricted NATs punch in about
three round trips (TCP, TLS 1.3, the hellos) after the later side starts: 4 ms without delay,
0.13-0.17 s at 10 ms per router (a 40 ms round trip), 0.6-0.8 s at 50 ms (200 ms). Symmetric NATs
(a new random port per destination) cannot be punched this way: `punch` gives up at its deadline
with PeerUnreachableError.

Finding the address to punch to: `public_tcp_guess` (our public IP from STUN, see
`stun_public_ip`, and our listen port, which such NATs keep).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from aioice import stun

from .addresses import PeerAddress
from .errors import HandshakeError, PeerIdMismatchError, PeerUnreachableError, TransportError
from .handshake import Handshaken, client_handshake, server_handshake
from .link import Link
from .transport import TlsTransport

RETRY_INTERVAL_S = 0.15
"""A failed attempt (RST, ICMP error, 4-tuple busy, failed handshake) is retried this much later."""
ROLE_WAIT_S = 1.0
"""How long the designated TLS server waits for the ClientHello before it concludes that it
connected to the peer's listener (which is a TLS server) and runs the handshake as client."""
POLL_S = 0.05
"""How often a waiting punch checks whether the transport got a direct link to the peer."""
DIRECT_KINDS = frozenset({"tcp", "tcp-plain", "holepunch"})
"""Link kinds that make a punch pointless (the peer is already reached directly)."""
HOLEPUNCH_KIND = "holepunch"


@dataclass
class Punched(Handshaken):
    """A punched connection, handshaken. `outbound` is True where we ended up TLS client (the
    link's stream ids depend on it: the two ends must disagree, so pass it to `adopt` as is);
    `address` is the remote as a multiaddr string."""

    outbound: bool = False
    address: str | None = None

    def adopt(self, transport: TlsTransport) -> Link:
        """Hand the connection to the transport as a link (kind "holepunch")."""
        return transport.adopt(self, outbound=self.outbound, address=self.address)


class AlreadyLinked(TransportError):
    """The transport has a direct link to the peer (before or during the punch): typically the
    peer's SYN reached our listener and the transport accepted it as an ordinary inbound link."""

    def __init__(self, peer_id: str, kind: str) -> None:
        super().__init__(f"already linked to {peer_id} directly ({kind})")
        self.peer_id = peer_id
        self.kind = kind


def tls_role(own_peer_id: str, peer_id: str) -> bool:
    """The agreed TLS role for a punch: True (TLS server) for the smaller peer id."""
    return own_peer_id < peer_id


def listen_port(transport: TlsTransport) -> int | None:
    """The port of the transport's first bound IPv4 TCP address (the one to punch from)."""
    for address in transport.bound_addresses():
        if address.host_kind == "ip4" and address.transport == "tcp" and address.circuit is None:
            return address.port
    return None


def public_tcp_guess(public_ip: str, listen_port: int) -> tuple[str, int]:
    """Where a peer behind a port-preserving NAT can be punched to: (public ip, listen port).

    The heuristic: NATs that keep port mappings (Linux MASQUERADE without --random or
    fully-random, most home routers, cloud NAT gateways in their default mode) map a private port
    to the same public port as long as that public port is free, so the TCP connections a peer
    makes from its listen port leave from public_ip:listen_port. The public IP is what STUN
    reports (`stun_public_ip` against the STUN responder of any reachable peer, stun.py). A wrong
    guess (a symmetric NAT, or the port already taken on the NAT by another host behind it) only
    makes the punch time out.
    """
    if not 0 < listen_port < 65536:
        raise ValueError(f"not a port: {listen_port}")
    return public_ip, listen_port


async def punch(transport: TlsTransport, *, local_port: int, remote: tuple[str, int], tls_server: bool,
                expected_peer_id: str, deadline: float, retry_interval: float = RETRY_INTERVAL_S,
                role_wait: float = ROLE_WAIT_S) -> Punched:
    """Punch a TCP connection from our `local_port` to `remote` and run TLS + hellos on it.

    `deadline` is on the event loop's clock (`loop.time()`). `tls_server` is the agreed role (see
    `tls_role` and the module's docstring for when the designated server acts as client). Returns
    a Punched (a Handshaken) with `io.kind == "holepunch"`, its peer checked to be
    `expected_peer_id`; hand it to the transport with `punched.adopt(transport)` (which passes
    `outbound` = whether we ended up TLS client). Raises AlreadyLinked when the
    transport has (or gets meanwhile) a direct link to the peer, PeerIdMismatchError when another
    peer answers, PeerUnreachableError at the deadline or when the port cannot be bound. Every
    socket it made is closed when it raises (also when cancelled). Needs a TLS transport (in
    plain TCP mode the server speaks first, and the role check below does not apply).
    """
    if not transport.tls:
        raise TransportError("hole punching needs a TLS transport")
    loop = asyncio.get_running_loop()
    started = loop.time()
    errors: Counter[str] = Counter()
    attempts = 0

    def check_linked() -> None:
        kind = transport.link_kind(expected_peer_id)
        if kind in DIRECT_KINDS:
            raise AlreadyLinked(expected_peer_id, kind)

    def failure(reason: str) -> PeerUnreachableError:
        seen = ", ".join(f"{name} x{count}" for name, count in errors.most_common())
        return PeerUnreachableError(
            f"TCP hole punch from port {local_port} to {remote[0]}:{remote[1]} failed: {reason} "
            f"({attempts} attempt(s) in {loop.time() - started:.1f}s; "
            f"{seen or 'our SYNs got no answer'})")

    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    check_linked()
    try:
        async with asyncio.timeout_at(deadline):
            while True:
                if attempts:
                    await _sleep_polling(loop, retry_interval, check_linked)
                check_linked()
                attempts += 1
                try:
                    sock = _punch_socket(family, local_port)
                except OSError as exc:  # the listener lacks SO_REUSEPORT, or another user's port
                    raise failure(f"cannot bind local port {local_port}: {exc}") from exc
                handed_over = False
                try:
                    error = await _connect(loop, sock, remote, check_linked)
                    if error:
                        errors[errno.errorcode.get(error, str(error))] += 1
                        continue
                    try:
                        done = await _secure(loop, transport, sock, tls_server=tls_server,
                                             expected_peer_id=expected_peer_id, role_wait=role_wait)
                    except PeerIdMismatchError:
                        raise
                    except HandshakeError as exc:
                        errors[f"handshake failed ({exc})"] += 1
                        role_wait *= 2  # if we took the peer's ClientHello for silence, wait longer
                        continue
                    handed_over = True
                    return done
                finally:
                    if not handed_over:
                        sock.close()
    except TimeoutError:
        raise failure("the deadline passed") from None


def _punch_socket(family: int, local_port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", local_port))
    except BaseException:
        sock.close()
        raise
    return sock


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool,
                 check: Callable[[], None], timeout: float | None = None) -> bool:
    """Wait until the socket is writable (or readable), calling `check()` every POLL_S; False if
    `timeout` passed first."""
    future: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    (loop.add_writer if write else loop.add_reader)(fd, _wake, future)
    end = None if timeout is None else loop.time() + timeout
    try:
        while True:
            wait = POLL_S if end is None else min(POLL_S, end - loop.time())
            if wait <= 0:
                return False
            done, _ = await asyncio.wait({future}, timeout=wait)
            if done:
                return True
            check()
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)
        future.cancel()


async def _connect(loop: asyncio.AbstractEventLoop, sock: socket.socket, remote: tuple[str, int],
                   check: Callable[[], None]) -> int:
    """Start the connect and wait for it; 0 when connected, else the errno."""
    error = sock.connect_ex(remote)
    if error not in (0, errno.EINPROGRESS):
        return error
    if error == errno.EINPROGRESS:
        await _ready(loop, sock, write=True, check=check)
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)


async def _secure(loop: asyncio.AbstractEventLoop, transport: TlsTransport, sock: socket.socket, *,
                  tls_server: bool, expected_peer_id: str, role_wait: float) -> Punched:
    server_ctx, client_ctx, der = transport.tls_contexts
    addresses = transport.listen_addresses()
    remote = sock.getpeername()
    address = str(PeerAddress.from_socket(str(remote[0]), int(remote[1]), expected_peer_id))
    if tls_server:
        # The client speaks first. Silence: we reached the peer's listener, a TLS server too.
        tls_server = await _ready(loop, sock, write=False, check=lambda: None, timeout=role_wait)
    if tls_server:
        done = await server_handshake(sock, transport.identity, server_ctx, der, addresses)
        if done.peer.peer_id != expected_peer_id:
            done.io.close()
            raise PeerIdMismatchError(f"punched to {done.peer.peer_id}, expected {expected_peer_id}")
    else:
        done = await client_handshake(sock, transport.identity, client_ctx, expected_peer_id, addresses)
    done.io.kind = HOLEPUNCH_KIND  # an instance attribute over the class's "tcp"
    return Punched(done.io, done.peer, outbound=not tls_server, address=address)


async def _sleep_polling(loop: asyncio.AbstractEventLoop, seconds: float,
                         check: Callable[[], None]) -> None:
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        await asyncio.sleep(min(POLL_S, left))
        check()


# --- STUN: our public IP ------------------------------------------------------------------------


async def stun_public_ip(server: tuple[str, int], timeout: float, *,
                         local_port: int | None = None) -> tuple[str, int] | None:
    """Ask a STUN server (e.g. a reachable peer's responder, stun.py) for our public address.

    One Binding request over UDP, retransmitted (0.25 s, doubling) until `timeout`; returns the
    (ip, port) the server saw, or None if no valid answer came. The socket binds UDP `local_port`
    (pass the TCP listen port: behind a port-preserving NAT the reply then also tells whether that
    port number is kept) and falls back to any port when that one is taken (e.g. by our own STUN
    responder); the IP is what matters for `public_tcp_guess`.
    """
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
        try:
            sock.bind((wildcard, local_port or 0))
        except OSError:
            sock.bind((wildcard, 0))
        request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
        request.add_fingerprint()
        data = bytes(request)
        end = loop.time() + timeout
        wait = 0.25
        while (left := end - loop.time()) > 0:
            with contextlib.suppress(OSError):  # e.g. an ICMP error reported on the send
                await loop.sock_sendto(sock, data, server)
            try:
                async with asyncio.timeout(min(wait, left)):
                    while True:
                        answer = _binding_answer(await _recvfrom(loop, sock), request, server)
                        if answer is not None:
                            return answer
            except TimeoutError:
                wait *= 2
        return None
    finally:
        sock.close()


async def _recvfrom(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, tuple[str, int]]:
    try:
        return await loop.sock_recvfrom(sock, 2048)
    except OSError:  # an ICMP error for our request: wait for the next try's answer
        await asyncio.sleep(0.05)
        return b"", ("", 0)


def _binding_answer(got: tuple[bytes, tuple[str, int]], request: stun.Message,
                    server: tuple[str, int]) -> tuple[str, int] | None:
    data, source = got
    if not data or (str(source[0]), int(source[1])) != (server[0], server[1]):
        return None
    try:
        reply = stun.parse_message(data)
    except Exception:  # ValueError mostly; struct.error on a truncated attribute
        return None
    if (reply.message_method != stun.Method.BINDING or reply.message_class != stun.Class.RESPONSE
            or reply.transaction_id != request.transaction_id):
        return None
    mapped = reply.attributes.get("XOR-MAPPED-ADDRESS") or reply.attributes.get("MAPPED-ADDRESS")
    if not mapped:
        return None
    return str(mapped[0]), int(mapped[1])
