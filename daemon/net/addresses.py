"""Peer addresses in multiaddr style: `/ip4/127.0.0.1/tcp/4100/p2p/<peer-id>`.

An address says how to reach a peer (protocol, host, port) and, usually, which peer must answer
there. Parsing is strict: anything else is a ValueError that says what is wrong.
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
        peer_id = None
        if rest:
            if len(rest) != 2 or rest[0] != "p2p" or not rest[1]:
                raise ValueError(f"{text!r}: only /p2p/<peer-id> may follow the port")
            peer_id = rest[1]
        return cls(host_kind, host, port, transport, peer_id)

    def with_peer(self, peer_id: str) -> PeerAddress:
        return PeerAddress(self.host_kind, self.host, self.port, self.transport, peer_id)

    def without_peer(self) -> PeerAddress:
        return PeerAddress(self.host_kind, self.host, self.port, self.transport, None)

    @classmethod
    def from_socket(cls, host: str, port: int, peer_id: str | None = None) -> PeerAddress:
        kind = "ip6" if ":" in host else "ip4"
        return cls(kind, host, port, "tcp", peer_id)

    def __str__(self) -> str:
        text = f"/{self.host_kind}/{self.host}/{self.transport}/{self.port}"
        return text + (f"/p2p/{self.peer_id}" if self.peer_id else "")


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> PeerAddress:
    return PeerAddress._parse_uncached(text)
