"""TCP hole punching as a path upgrade: the coordination over a relayed link (`path.punch`).

The offerer (the smaller peer id, see upgrade.py) asks the STUN responder of a reachable peer for
its public IP, guesses its public TCP address (port-preserving NATs: the listen port), and sends
it in a `path.punch` call over the relayed link; the answerer does the same, replies with its own
guess and starts punching at once; the offerer starts when the reply arrives. Both punch until the
same deadline (holepunch.py). Behind a NAT that does not keep port mappings (symmetric) the punch
fails by the deadline and WebRTC is tried next.

A `path.punch` makes this daemon query STUN servers and send SYNs and TLS hellos to the address it
is given, so it is bounded: at most `MAX_PUNCHES` answers at once, one per peer at a time and one
per peer every `PUNCH_COOLDOWN` seconds, at most `PER_TARGET` toward one IP address in that
time whoever asks (identities are free: a bound per peer alone let a stranger aim this daemon at
one host as often as it made up ids), and never toward a loopback, unspecified, multicast or
broadcast address (private addresses stay allowed: peers on one LAN, and the NAT lab, punch there).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
from collections.abc import Callable

import structlog

from .addresses import ip_of
from .errors import PeerUnreachableError, TransportError
from .holepunch import AlreadyLinked, listen_port, public_tcp_guess, punch, stun_public_ip, tls_role
from .interface import Message, RequestContext
from .transport import TlsTransport

log = structlog.get_logger(__name__)

PUNCH = "path.punch"
PUNCH_SECONDS = 5.0
STUN_SECONDS = 2.0
MAX_PUNCHES = 4  # answers under way at once
PUNCH_COOLDOWN = 30.0  # seconds between two punches answered for one peer
MAX_REMEMBERED = 4096  # peers (and target addresses) whose last punches are remembered
# punches answered toward one IP address per PUNCH_COOLDOWN, by any peers (two peers behind one
# NAT may punch to us at once)
PER_TARGET = 2


class PunchRefused(TransportError):
    """The peer will not punch (no relayed link, or no public address to offer)."""


class TcpPuncher:
    def __init__(self, transport: TlsTransport, stun_servers: Callable[[], list[tuple[str, int]]],
                 seconds: float = PUNCH_SECONDS, clock: Callable[[], float] | None = None) -> None:
        self._transport = transport
        # (monotonic seconds: the loop's clock unless a test gives one)
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._stun_servers = stun_servers
        self._seconds = seconds
        self._tasks: set[asyncio.Task[None]] = set()
        self._answering: set[str] = set()
        self._last_answer: collections.OrderedDict[str, float] = collections.OrderedDict()
        # target IP -> when punches toward it were answered (the last PER_TARGET)
        self._target_answers: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self.refused = 0
        self.refused_target = 0  # of those: toward an address punched PER_TARGET times lately
        transport.add_unary_handler(PUNCH, self._on_punch)

    async def _public(self) -> tuple[str, int] | None:
        port = listen_port(self._transport)
        if port is None:
            return None
        for server in self._stun_servers()[:3]:
            seen = await stun_public_ip(server, STUN_SECONDS, local_port=port)
            if seen is not None:
                return public_tcp_guess(seen[0], port)
        return None

    async def __call__(self, peer_id: str) -> bool:
        """Offer and run a punch to `peer_id`; True if a better link to it now exists."""
        transport = self._transport
        mine = await self._public()
        port = listen_port(transport)
        if mine is None or port is None:
            return False
        loop = asyncio.get_running_loop()
        reply = await transport.call(peer_id, PUNCH, Message({"ip": mine[0], "port": mine[1]}),
                                     timeout=STUN_SECONDS * 3 + 2)
        theirs = _remote(reply.header)
        try:
            punched = await punch(transport, local_port=port, remote=theirs,
                                  tls_server=tls_role(transport.peer_id, peer_id),
                                  expected_peer_id=peer_id, deadline=loop.time() + self._seconds)
        except AlreadyLinked:
            return True
        except PeerUnreachableError as exc:
            log.info("tcp_punch_failed", peer=peer_id[:12], error=str(exc))
            return False
        punched.adopt(transport)
        log.info("link_upgraded", peer=peer_id[:12], kind="holepunch")
        return True

    async def _on_punch(self, ctx: RequestContext, message: Message) -> Message:
        if ctx.link_kind != "relay":
            raise PunchRefused("only a relayed link is upgraded by punching")
        theirs = _remote(message.header)
        now = self._clock()
        last = self._last_answer.get(ctx.peer_id)
        if ctx.peer_id in self._answering or len(self._answering) >= MAX_PUNCHES \
                or (last is not None and now - last < PUNCH_COOLDOWN):
            self.refused += 1
            raise PunchRefused("busy punching, or punched for this peer a moment ago; "
                               f"ask again in {PUNCH_COOLDOWN:g} s")
        target = _target_key(theirs[0])
        recent = [t for t in self._target_answers.pop(target, []) if now - t < PUNCH_COOLDOWN]
        if len(recent) >= PER_TARGET:
            self._target_answers[target] = recent
            self.refused += 1
            self.refused_target += 1
            raise PunchRefused(f"punched toward {target} {PER_TARGET} times in the last "
                               f"{PUNCH_COOLDOWN:g} s; ask again later")
        self._target_answers[target] = [*recent, now]
        self._last_answer.pop(ctx.peer_id, None)
        self._last_answer[ctx.peer_id] = now
        for remembered in (self._last_answer, self._target_answers):
            while len(remembered) > MAX_REMEMBERED:
                remembered.popitem(last=False)
        self._answering.add(ctx.peer_id)
        try:
            mine = await self._public()
        except BaseException:
            self._answering.discard(ctx.peer_id)
            raise
        port = listen_port(self._transport)
        if mine is None or port is None:
            self._answering.discard(ctx.peer_id)
            raise PunchRefused("no public address to offer (no STUN answer)")
        task = asyncio.create_task(self._answer(ctx.peer_id, port, theirs), name="tcp-punch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _, peer=ctx.peer_id: self._answering.discard(peer))
        return Message({"ip": mine[0], "port": mine[1]})

    async def _answer(self, peer_id: str, port: int, theirs: tuple[str, int]) -> None:
        transport = self._transport
        loop = asyncio.get_running_loop()
        try:
            punched = await punch(transport, local_port=port, remote=theirs,
                                  tls_server=tls_role(transport.peer_id, peer_id),
                                  expected_peer_id=peer_id, deadline=loop.time() + self._seconds)
            punched.adopt(transport)
        except (AlreadyLinked, PeerUnreachableError, TransportError) as exc:
            log.info("tcp_punch_answer_ended", peer=peer_id[:12], error=str(exc))
            return
        log.info("link_upgraded", peer=peer_id[:12], kind="holepunch")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _target_key(ip: str) -> str:
    """One key per address however it is written (`_remote` checked that it is one)."""
    return str(ip_of(ip))


def _remote(header: dict[str, object]) -> tuple[str, int]:
    ip, port = header.get("ip"), header.get("port")
    if not isinstance(ip, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise PunchRefused("path.punch needs 'ip' (str) and 'port' (1-65535)")
    address = ip_of(ip)  # (::ffff:127.0.0.1 is loopback too: the socket is dual-stack)
    if address is None:
        raise PunchRefused(f"path.punch: {ip[:64]!r} is not an IP address")
    if address.is_link_local or address.is_loopback or address.is_unspecified or address.is_multicast or \
            address == ipaddress.IPv4Address("255.255.255.255"):
        raise PunchRefused(f"path.punch will not send to {address}")
    return ip, port
