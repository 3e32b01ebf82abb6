"""64 DHT nodes over the real TLS transport on loopback, in one process, losing 20% of them."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

from dht.swarm import FAST

from dedloc.daemon.dht import DHTNode
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import PeerAddress
from dedloc.daemon.net.transport import TlsTransport

# Generous call and lookup timeouts: 64 TLS handshakes in one process on a loaded 2-core machine
# take seconds, and a call that times out there is a test of the machine, not of the DHT. (The
# lost nodes' ports are closed: calls to them are refused at once, they do not wait out a timeout.)
CONFIG = replace(FAST, rpc_timeout=10.0, lookup_timeout=60.0, join_timeout=60.0)


async def test_64_tls_nodes_survive_losing_20_percent() -> None:
    rng = random.Random(7)
    identities = [Identity.generate() for _ in range(64)]
    listen = [PeerAddress.parse("/ip4/127.0.0.1/tcp/0")]
    transports = [await TlsTransport.start(identity, listen) for identity in identities]
    nodes = [DHTNode(t, i, CONFIG) for t, i in zip(transports, identities, strict=True)]
    bootstrap = [str(a) for a in transports[0].listen_addresses()]
    try:
        await nodes[0].start()
        for node in nodes[1:]:
            assert await node.start(bootstrap)
        expiration = time.time() + 600
        keys = [f"tls-key-{i}" for i in range(30)]
        for i, key in enumerate(keys):
            assert await rng.choice(nodes).store(key, f"value-{i}".encode(), expiration) == CONFIG.replicas

        victims = rng.sample(range(1, 64), 13)
        await asyncio.gather(*(nodes[v].close() for v in victims))
        await asyncio.gather(*(transports[v].close() for v in victims))
        survivors = [n for i, n in enumerate(nodes) if i not in victims]

        async def read(key: str) -> bytes | None:
            record = await rng.choice(survivors).get(key, timeout=CONFIG.lookup_timeout)
            return None if record is None else record.value

        values = await asyncio.gather(*(read(key) for key in keys))  # every lookup returned
        assert values == [f"value-{i}".encode() for i in range(30)]
    finally:
        for node in nodes:
            await node.close()
        await asyncio.gather(*(t.close() for t in transports))
