"""This node's place in the swarm: its transport, reachability, DHT and averager, started
without blocking on the network.

`start()` builds the services once, each with its dependencies passed in: listening happens at
once (a port that cannot be bound is a start-up error, with its reason), and the DHT and the
averager exist from then on, not joined yet (`await network.wait_joined(...)`; nobody polls for a
service to appear). Bootstrapping, the reachability check (which decides whether the DHT serves
or is a client, and whether the averager may reduce) and joining run in the background and are
retried there; until the DHT has joined, DHT calls say so (NotJoinedError). If that background
task fails, `on_failure` (the node's one shutdown path) is told why.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

from . import timebase
from .averaging.averager import Averager
from .collab.membership import MembershipRegistry
from .config import Config
from .dht import DHTNode
from .errors import DaemonError
from .identity import Identity
from .net import PeerAddress, TransportError
from .net.punch_path import TcpPuncher
from .net.ratelimit import Bandwidth
from .net.reachability import DialBackService, check_reachability
from .net.relay import RelayClient, RelayService
from .net.reservations import RelayReservations
from .net.stun import StunResponder, stun_address
from .net.transport import TlsTransport
from .net.upgrade import PathUpgrader

log = structlog.get_logger(__name__)

ADDRESS_RECORD_SECONDS = 600.0


class NotJoinedError(DaemonError):
    """The node has not joined the DHT yet (no peer answered so far)."""


@dataclass
class NetworkStatus:
    reachable: bool | None = None
    client_mode: bool | None = None


class PeerNetwork:
    def __init__(self, config: Config, identity: Identity,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.identity = identity
        self._on_failure = on_failure
        # Closed runs' tokens, revocation lists and refusals (daemon/collab/membership.py).
        self.membership = MembershipRegistry(identity)
        self.status = NetworkStatus()
        self.transport: TlsTransport | None = None
        self.dht: DHTNode | None = None
        self.averager: Averager | None = None
        self._task: asyncio.Task[None] | None = None
        self._stun: list[StunResponder] = []
        self.relay_service: RelayService | None = None
        self.dial_back: DialBackService | None = None
        self.relay_client: RelayClient | None = None
        self._reservations: RelayReservations | None = None
        self.upgrader: PathUpgrader | None = None
        self.puncher: TcpPuncher | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._pending_addresses: list[str] | None = None
        self._bootstrap = [PeerAddress.parse(a) for a in config.net.bootstrap]
        # the volunteer's caps on all peer traffic (net.*_bytes_per_second; node.set_bandwidth)
        self.bandwidth = Bandwidth(config.net.upload_bytes_per_second,
                                   config.net.download_bytes_per_second)

    async def start(self) -> None:
        net = self.config.net
        self.transport = await TlsTransport.start(
            self.identity, [PeerAddress.parse(a) for a in net.listen], limits=net.transport_limits(),
            bandwidth=self.bandwidth)
        if net.announce:
            self.transport.set_announced([PeerAddress.parse(a) for a in net.announce])
        if net.stun:
            await self._start_stun()
        self.dial_back = DialBackService(self.transport, self.transport.probe)
        relay = self.config.relay
        self.relay_service = RelayService(
            self.transport, relay.relay_limits(), reachable=lambda: self.status.reachable,
            admit=self.membership.admit_relay if relay.members_only else None)
        self.relay_client = RelayClient(self.transport, handshake_timeout=net.handshake_timeout,
                                        credentials=self.membership.tokens)
        self.upgrader = PathUpgrader(self.transport, self.ice_servers, webrtc=net.webrtc)
        if net.holepunch:
            self.puncher = TcpPuncher(self.transport, self._stun_servers)
            self.upgrader.puncher = self.puncher
        self.relay_client.on_addresses = self._publish_addresses
        self.transport.set_address_resolver(self._resolve)
        self.dht = DHTNode(self.transport, self.identity, self.config.dht.node_config(),
                           access=self.membership)
        self.averager = Averager(self.transport, self.dht, self.config.averaging,
                                 caps=self.bandwidth.caps)
        self._task = asyncio.create_task(self._join(), name="join-network")
        self._task.add_done_callback(self._join_done)
        log.info("network_listening", addresses=[str(a) for a in self.transport.listen_addresses()])

    async def _start_stun(self) -> None:
        """One STUN responder per IPv4 listen host (one on 0.0.0.0 covers them all), on
        net.stun_port, or else on the TCP listen port's number if that is free for UDP."""
        assert self.transport is not None
        listen = [a for a in map(PeerAddress.parse, self.config.net.listen) if a.host_kind == "ip4"]
        if any(a.host == "0.0.0.0" for a in listen):
            listen = [a for a in listen if a.host == "0.0.0.0"][:1]
        bound = [a for a in self.transport.bound_addresses() if a.host_kind == "ip4"]
        for address in dict.fromkeys(a.host for a in listen):
            tcp_port = next((a.port for a in bound if address in ("0.0.0.0", a.host)), 0)
            responder = await StunResponder.start(address, self.config.net.stun_port,
                                                  prefer_port=tcp_port)
            self._stun.append(responder)
        if self._stun:
            log.info("stun_listening", addresses=[str(a) for a in self.stun_addresses()])

    def stun_addresses(self) -> list[PeerAddress]:
        """Where this node answers STUN: /ip4/<host>/udp/<port>/p2p/<peer-id>."""
        if self.transport is None:
            return []
        local = list(dict.fromkeys(a.host for a in self.transport.bound_addresses()
                                   if a.host_kind == "ip4"))
        addresses = []
        for responder in self._stun:
            if responder.closed:
                continue
            hosts = local if responder.bound_host == "0.0.0.0" else [responder.bound_host]
            addresses += [stun_address(h, responder.bound_port, self.identity.peer_id) for h in hosts]
        return addresses

    async def _join(self) -> None:
        assert self.transport is not None
        dht = self.config.dht
        if dht.client_mode == "auto":
            helpers = await self._connect_bootstrap()
            self.status.reachable = await check_reachability(
                self.transport, helpers, self.transport.listen_addresses(),
                timeout=self.config.net.call_timeout)
            client_mode = self.status.reachable is False
        else:
            client_mode = dht.client_mode == "yes"
        self.status.client_mode = client_mode
        log.info("network_reachability", reachable=self.status.reachable, client_mode=client_mode)
        if self.status.reachable is False and self.config.relay.reserve > 0:
            assert self.relay_client is not None
            self._reservations = RelayReservations(self.transport, self.relay_client,
                                                   self.config.relay.reserve, lambda: self._bootstrap)
            self._reservations.start()
        assert self.dht is not None and self.averager is not None
        self.dht.set_client_mode(client_mode)
        self.averager.reachable = self.status.reachable is not False
        await self.dht.start(self._bootstrap, wait=True)
        if self._pending_addresses is not None:  # reserved relay slots before the DHT was up
            self._publish_addresses(self._pending_addresses)

    def _join_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("network_join_failed", error=repr(error), exc_info=error)
        if self._on_failure is not None:
            self._on_failure(f"joining the network failed: {error!r}")

    async def wait_joined(self, timeout: float) -> bool:
        """Wait (up to `timeout` seconds) until the DHT has joined; whether it has."""
        if self.dht is None:  # not started: nothing will join before start()
            await asyncio.sleep(timeout)
            return False
        return await self.dht.wait_joined(timeout)

    @property
    def joined(self) -> bool:
        return self.dht is not None and self.dht.started and self.dht.joined

    async def _connect_bootstrap(self) -> list[str]:
        assert self.transport is not None
        connected: list[str] = []
        for address in self._bootstrap:
            try:
                connected.append(await self.transport.connect(address, timeout=self.config.net.call_timeout))
            except (TransportError, TimeoutError) as exc:
                log.warning("bootstrap_peer_unreachable", address=str(address), error=str(exc))
        return connected

    def require_dht(self) -> DHTNode:
        if self.dht is None or not self.dht.started:
            raise NotJoinedError("the node is still joining the network; try again in a moment")
        return self.dht

    def require_averager(self) -> Averager:
        if self.averager is None or self.dht is None or not self.dht.started:
            raise NotJoinedError("the node is still joining the network; try again in a moment")
        return self.averager

    def dht_status(self) -> dict[str, Any]:
        if self.dht is None or not self.dht.started:
            return {"mode": "starting", "joined": False, "routing_table_size": 0}
        return {"mode": "client" if self.status.client_mode else "server",
                "joined": self.dht.joined, "routing_table_size": len(self.dht.routing_table)}

    def addresses(self) -> list[str]:
        return [] if self.transport is None else [str(a) for a in self.transport.listen_addresses()]

    def peers(self) -> list[dict[str, Any]]:
        if self.transport is None:
            return []
        in_table = set()
        if self.dht is not None:
            in_table = {info.peer_id for info in self.dht.routing_table}
        peers = []
        for link in self.transport.links():
            peers.append({
                "peer_id": link.peer_id, "address": link.address, "kind": link.kind,
                "outbound": link.outbound, "rtt_ms": link.rtt_ms, "bytes_in": link.bytes_in,
                "bytes_out": link.bytes_out, "streams": link.streams, "opened_at": link.opened_at,
                "in_routing_table": link.peer_id in in_table})
        return peers

    def counters(self) -> dict[str, int]:
        counters: dict[str, int] = {}
        if self.transport is not None:
            counters.update({f"net.{k}": v for k, v in self.transport.counters().items()})
        counters.update({f"net.{k}": v for k, v in self.bandwidth.counters().items()})
        if self.dht is not None:
            counters.update({f"dht.{k}": v for k, v in self.dht.stats.items()})
        if self.averager is not None:
            counters.update({f"averaging.{k}": v for k, v in self.averager.counters.items()})
            counters.update({f"averaging.allreduce.{k}": v
                             for k, v in self.averager.allreduce.counters.items()})
        for responder in self._stun:
            for k, v in responder.counters().items():
                counters[f"stun.{k}"] = counters.get(f"stun.{k}", 0) + v
        if self.relay_service is not None:
            counters.update({f"relay.{k}": v for k, v in self.relay_service.counters.items()})
        if self.relay_client is not None:
            counters.update({f"relay.{k}": v for k, v in self.relay_client.counters.items()})
        if self.upgrader is not None:
            counters.update({f"net.{k}": v for k, v in self.upgrader.counters.items()})
        if self.dial_back is not None:
            counters.update({f"net.dial_back_{k}": v for k, v in self.dial_back.counters.items()})
        if self.puncher is not None:
            counters["net.punches_refused"] = self.puncher.refused
            counters["net.punches_refused_target"] = self.puncher.refused_target
        counters["membership.refusals"] = sum(self.membership.refusals_by_reason.values())
        for reason, count in self.membership.refusals_by_reason.items():
            counters[f"membership.refused_{reason}"] = count
        return counters

    def _publish_addresses(self, addresses: list[str]) -> None:
        """A node nobody can dial publishes its circuit addresses in the DHT (`peer/<id>`, its own
        sub-key), so that peers that know only its id can reach it through its relays."""
        if not self.joined or (self._publisher is not None and not self._publisher.done()):
            self._pending_addresses = addresses
            return
        self._pending_addresses = addresses
        self._publisher = asyncio.create_task(self._publish_loop(), name="publish-addresses")

    async def _publish_loop(self) -> None:
        while self._pending_addresses is not None and self.dht is not None:
            addresses, self._pending_addresses = self._pending_addresses, None
            try:
                await self.dht.store(f"peer/{self.identity.peer_id}", orjson.dumps(addresses),
                                     timebase.now() + ADDRESS_RECORD_SECONDS,
                                     sub_key=self.identity.peer_id, timeout=10)
            except (TransportError, TimeoutError) as exc:
                log.info("address_record_not_stored", error=str(exc))

    async def _resolve(self, peer_id: str) -> list[PeerAddress]:
        """Addresses of a peer known only by its id: the DHT's contact for it, else the circuit
        addresses a peer nobody can dial publishes (`peer/<id>`)."""
        if self.dht is None or not self.dht.started:
            return []
        found = await self.dht.addresses_of(peer_id, timeout=5)
        if found:
            return found
        record = await self.dht.get(f"peer/{peer_id}", timeout=5)
        entry = None if record is None else record.sub_keys.get(peer_id)
        if entry is None:
            return []
        addresses = []
        with contextlib.suppress(orjson.JSONDecodeError, TypeError):
            for text in orjson.loads(entry.value)[:32]:
                with contextlib.suppress(ValueError, TypeError):
                    addresses.append(PeerAddress.parse(text))
        return addresses

    def _stun_servers(self) -> list[tuple[str, int]]:
        peers: list[PeerAddress] = list(self._bootstrap)
        if self.relay_client is not None:
            peers += list(self.relay_client.relays.values())
        found = [(a.host, a.port) for a in peers if a.host_kind == "ip4" and a.circuit is None]
        return list(dict.fromkeys(found))

    def ice_servers(self) -> list[str]:
        """STUN on our relays and bootstrap peers (every reachable daemon answers STUN on the
        same port number as its TCP port unless told otherwise), then the configured servers."""
        peers: list[PeerAddress] = list(self._bootstrap)
        if self.relay_client is not None:
            peers += list(self.relay_client.relays.values())
        found = [f"stun:{a.host}:{a.port}" for a in peers if a.host_kind == "ip4" and a.circuit is None]
        return list(dict.fromkeys([*found[:4], *self.config.net.ice_servers]))

    def relays(self) -> list[str]:
        """The relays this node holds a slot on (when nobody can dial it)."""
        return [] if self.relay_client is None else sorted(self.relay_client.relays)

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
        if self.upgrader is not None:
            await self.upgrader.close()
        if self.puncher is not None:
            await self.puncher.close()
        if self._reservations is not None:
            await self._reservations.close()
        if self.relay_client is not None:
            await self.relay_client.close()
        for responder in self._stun:
            responder.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
        if self.dht is not None:
            await self.dht.close()
        if self.transport is not None:
            await self.transport.close()
