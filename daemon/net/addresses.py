"""Peer addresses in multiaddr style: `/ip4/127.0.0.1/tcp/4100/p2p/<peer-id>`.

An address says how to reach a peer (protocol, host, port) and, usually, which peer must answer
there. A circuit address, `/ip4/.../tcp/4100/p2p/<relay-id>/p2p-circuit/p2p/<peer-id>`, reaches
`<peer-id>` through the relay at that address (a peer nobody can dial announces such addresses).
Parsing is strict: anything else is a ValueError that says what is wrong.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

_HOST_KINDS = ("ip4", "ip6", "dns", "dns4", "dns6")


@dataclass(frozen=True, order=True)
class PeerAddress:
    host_kind: str
    host: str
    port: int
    transport: str = "tcp"
    peer_id: str | None = None
    circuit: str | None = None  # the peer reached through the relay `peer_id`

    @property
    def target(self) -> str | None:
        """The peer this address reaches: the circuit's end, else `peer_id`."""
        return self.circuit or self.peer_id

    @property
    def relay(self) -> PeerAddress:
        """The relay's own address (for a circuit address)."""
        return PeerAddress(self.host_kind, self.host, self.port, self.transport, self.peer_id)

    def via(self, target: str) -> PeerAddress:
        """The circuit address that reaches `target` through this (relay) address."""
        if self.peer_id is None:
            raise ValueError(f"{self} names no relay peer id")
        return PeerAddress(self.host_kind, self.host, self.port, self.transport, self.peer_id, target)

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Read an address; ValueError says what is wrong. Cached: peers repeat addresses a lot."""
        return _parse(text)

    @classmethod
    def _parse_uncached(cls, text: str) -> PeerAddress:
        parts = text.split("/")
        if len(parts) < 5 or parts[0] != "":
            raise ValueError(f"{text!r} is not an address like /ip4/1.2.3.4/tcp/4100/p2p/<peer-id>")
        _, host_kind, host, transport, port_text, *rest = parts
        if host_kind not in _HOST_KINDS:
            raise ValueError(f"{text!r}: host kind must be one of {', '.join(_HOST_KINDS)}")
        if host_kind == "ip4":
            ipaddress.IPv4Address(host)
        elif host_kind == "ip6":
            ipaddress.IPv6Address(host)
        elif not host:
            raise ValueError(f"{text!r}: empty host name")
        if transport not in ("tcp", "udp"):
            raise ValueError(f"{text!r}: transport must be tcp or udp")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
        if not 0 <= port <= 65535:
            raise ValueError(f"{text!r}: port {port} is out of range")
        peer_id = circuit = None
        if rest:
            if len(rest) not in (2, 5) or rest[0] != "p2p" or not rest[1]:
                raise ValueError(f"{text!r}: only /p2p/<peer-id> may follow the port")
            peer_id = rest[1]
            if len(rest) == 5:
                if rest[2] != "p2p-circuit" or rest[3] != "p2p" or not rest[4] or transport != "tcp":
                    raise ValueError(f"{text!r}: a relay's address may only be followed by "
                                     "/p2p-circuit/p2p/<peer-id>")
                circuit = rest[4]
        return cls(host_kind, host, port, transport, peer_id, circuit)

    def with_peer(self, peer_id: str) -> PeerAddress:
        if self.circuit is not None:  # the relay stays; the end of the circuit is `peer_id`
            return PeerAddress(self.host_kind, self.host, self.port, self.transport, self.peer_id,
                               peer_id)
        return PeerAddress(self.host_kind, self.host, self.port, self.transport, peer_id)

    def without_peer(self) -> PeerAddress:
        return PeerAddress(self.host_kind, self.host, self.port, self.transport, None)

    @classmethod
    def from_socket(cls, host: str, port: int, peer_id: str | None = None) -> PeerAddress:
        kind = "ip6" if ":" in host else "ip4"
        return cls(kind, host, port, "tcp", peer_id)

    def __str__(self) -> str:
        text = f"/{self.host_kind}/{self.host}/{self.transport}/{self.port}"
        text += f"/p2p/{self.peer_id}" if self.peer_id else ""
        return text + (f"/p2p-circuit/p2p/{self.circuit}" if self.circuit else "")


def ip_of(host: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address, an IPv4-mapped IPv6 one (a dual-stack socket's view of an IPv4
    peer) as IPv4; None if it is not an IP address."""
    if host is None:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> PeerAddress:
    return PeerAddress._parse_uncached(text)
