"""Helpers to start swarms of DHT nodes on a MemoryNetwork."""

from __future__ import annotations

from dataclasses import dataclass, field

from dedloc.daemon.dht import DHTConfig, DHTNode
from dedloc.daemon.identity import Identity
from dedloc.daemon.net.memory import MemoryNetwork, MemoryTransport

FAST = DHTConfig(rpc_timeout=0.5, lookup_timeout=3.0, join_timeout=5.0, bootstrap_backoff=0.02,
                 bootstrap_backoff_max=0.2, maintenance_period=3600.0)


@dataclass
class Swarm:
    network: MemoryNetwork = field(default_factory=MemoryNetwork)
    nodes: list[DHTNode] = field(default_factory=list)
    transports: list[MemoryTransport] = field(default_factory=list)

    async def add(self, config: DHTConfig = FAST, bootstrap: list[str] | None = None,
                  wait: bool = True) -> DHTNode:
        identity = Identity.generate()
        transport = self.network.transport(identity.peer_id)
        node = DHTNode(transport, identity, config)
        self.nodes.append(node)
        self.transports.append(transport)
        if bootstrap is None:
            bootstrap = [str(a) for a in self.transports[0].listen_addresses()] if len(self.nodes) > 1 else []
        await node.start(bootstrap, wait=wait)
        return node

    async def close(self) -> None:
        for node in self.nodes:
            await node.close()
        for transport in self.transports:
            await transport.close()
