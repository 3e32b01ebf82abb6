"""Control-API methods about the swarm: peers, connecting, and the DHT (for tools and debugging)."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Annotated, Any

import orjson

from dedloc.rpc import ErrorCode, InvalidParams, rpc_method

from . import timebase
from .dht import InvalidRecord, Record
from .net import PeerAddress, PeerIdMismatchError, PeerUnreachableError, TransportError
from .network import NotJoinedError

if TYPE_CHECKING:
    from .network import PeerNetwork

ERROR_MAP = {
    NotJoinedError: ErrorCode.NOT_JOINED,
    PeerIdMismatchError: ErrorCode.PEER_ID_MISMATCH,
    PeerUnreachableError: ErrorCode.PEER_UNREACHABLE,
    InvalidRecord: ErrorCode.DHT_REFUSED,
}

PeerList = Annotated[list[dict[str, Any]], "One entry per open link: peer_id, address, kind (tcp, "
                     "...), outbound, rtt_ms, bytes_in, bytes_out, streams, opened_at, in_routing_table."]


class NetworkApi:
    def __init__(self, network: PeerNetwork) -> None:
        self._network = network

    @rpc_method("node.peers")
    async def node_peers(self) -> PeerList:
        """The peers this node has a link to, with the kind of each link and its traffic."""
        return self._network.peers()

    @rpc_method("node.connect", errors=(ErrorCode.PEER_UNREACHABLE, ErrorCode.PEER_ID_MISMATCH))
    async def node_connect(
        self,
        address: Annotated[str, "A peer address, like /ip4/1.2.3.4/tcp/4100/p2p/<peer-id> (or a "
                           "circuit address through a relay), or a bare peer id to reach a known "
                           "peer by any path."],
        timeout: Annotated[float, "Seconds to wait.", {"exclusiveMinimum": 0}] = 10.0,
    ) -> dict[str, str]:
        """Open a link to a peer (and add it to the DHT's routing table if it serves the DHT)."""
        transport = self._network.transport
        if transport is None:
            raise NotJoinedError("the transport is not started yet")
        if "/" not in address:  # a bare peer id: any path we know (direct, punched, relayed)
            try:
                await transport.connect_peer(address, timeout=timeout)
            except TimeoutError as exc:
                raise PeerUnreachableError(f"{address} did not answer within {timeout} s") from exc
            except TransportError as exc:
                raise PeerUnreachableError(f"{address}: {exc}") from exc
            return {"peer_id": address, "address": address}
        try:
            parsed = PeerAddress.parse(address)
        except ValueError as exc:
            raise InvalidParams("address", str(exc)) from None
        try:
            peer_id = await transport.connect(parsed, timeout=timeout)
        except TimeoutError as exc:
            raise PeerUnreachableError(f"{address} did not answer within {timeout} s") from exc
        except (PeerIdMismatchError, PeerUnreachableError):
            raise
        except TransportError as exc:
            raise PeerUnreachableError(f"{address}: {exc}") from exc
        if self._network.dht is not None and self._network.dht.started:
            await self._network.dht.introduce(peer_id, [parsed.with_peer(peer_id)])
        return {"peer_id": peer_id, "address": str(parsed.with_peer(peer_id))}

    @rpc_method("dht.store", errors=(ErrorCode.NOT_JOINED, ErrorCode.DHT_REFUSED))
    async def dht_store(
        self,
        key: Annotated[str, "The key."],
        value: Annotated[Any, "Any JSON value (stored as its JSON text)."],
        ttl: Annotated[float, "Seconds until the value expires.", {"exclusiveMinimum": 0}] = 3600.0,
        sub_key: Annotated[str | None, "A sub-key; a sub-key equal to a peer id can only be "
                           "written by that peer (this node signs with its own id)."] = None,
    ) -> dict[str, Any]:
        """Store a signed value under a key (or a key's sub-key) on the closest peers."""
        dht = self._network.require_dht()
        expiration = timebase.now() + ttl
        stored = await dht.store(key, orjson.dumps(value), expiration, sub_key)
        return {"stored_on": stored, "expiration": expiration}

    @rpc_method("dht.get", errors=(ErrorCode.NOT_JOINED,))
    async def dht_get(
        self,
        key: Annotated[str, "The key."],
        latest: Annotated[bool, "Ask all closest peers and merge (true) or stop at the first "
                          "value found (false)."] = True,
    ) -> Annotated[dict[str, Any] | None, "value (plain key) or sub_keys {sub_key: {value, "
                   "expiration, signer}}, and expiration; null if the key holds nothing."]:
        """Read a key from the DHT; every entry's signature is checked, expired ones are dropped."""
        record = await self._network.require_dht().get(key, latest=latest)
        return None if record is None else record_to_json(record)


def _decode(value: bytes) -> Any:
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return {"base64": base64.b64encode(value).decode()}


def record_to_json(record: Record) -> dict[str, Any]:
    if record.has_sub_keys:
        return {"key": record.key, "expiration": record.expiration, "sub_keys": {
            sub: {"value": _decode(e.value), "expiration": e.expiration, "signer": e.signer}
            for sub, e in sorted(record.sub_keys.items())}}
    entry = record.entries[0]
    return {"key": record.key, "expiration": entry.expiration, "value": _decode(entry.value),
            "signer": entry.signer}
