"""Closed runs: the owner's daemon creates the run and issues tokens; a member with a token trains
with it; a peer without a valid token (none, someone else's, expired, revoked) can read and write
none of the run's DHT keys, join none of its rounds and download none of its state.

The intruder is an in-process transport with its own identity: it speaks the peer protocol
directly, so these checks are the owner's, not a well-behaved client's."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson
import pytest
from support import p2p_address, wait_until

from dedloc.daemon.collab.errors import StateSyncError
from dedloc.daemon.collab.revocations import Revocations
from dedloc.daemon.collab.secrecy import MAGIC, RunSecret
from dedloc.daemon.collab.state_sync import download_state
from dedloc.daemon.collab.tokens import MembershipToken
from dedloc.daemon.dht import protocol as dht_protocol
from dedloc.daemon.dht.records import Entry
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, PeerAddress, RemoteError, TlsTransport
from dedloc.rpc import ErrorCode, RpcCallError

PARAMS = {"workload": "tiny", "name": "club", "closed": True, "target_batch_size": 128,
          "min_peers": 2, "checkpoint_every": 0, "collaborative": True}
WAITING = ("no peer publishes", "not joined the network")


async def _status(daemon: Any) -> dict[str, Any]:
    (status,) = await daemon.call("run.status", {"name": "club"})
    return status


async def _join(daemon: Any, params: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return await daemon.call("run.start", params)
    except RpcCallError as exc:
        if any(text in exc.message for text in WAITING):
            return None
        raise


class Intruder:
    """A peer that speaks the protocol directly, with or without a token."""

    def __init__(self, transport: TlsTransport, identity: Identity, owner: str, prefix: str) -> None:
        self.transport, self.identity, self.owner, self.prefix = transport, identity, owner, prefix

    async def read(self, key: str, token: str | None = None) -> Message:
        header: dict[str, Any] = {"client": True, "addresses": [], "key": key}
        if token is not None:
            header["token"] = token
        return await self.transport.call(self.owner, dht_protocol.FIND_VALUE, Message(header), timeout=10)

    async def write(self, key: str, proof: str | None = None) -> Message:
        entry = Entry.create(self.identity, key, b'{"x": 1}', time.time() + 60,
                             sub_key=self.identity.peer_id)
        if proof is not None:
            entry = dataclasses.replace(entry, proof=proof)
        message = dht_protocol.encode_store(entry, {"client": True, "addresses": []})
        return await self.transport.call(self.owner, dht_protocol.STORE, message, timeout=10)

    async def join_round(self, key: str, token: str | None = None) -> Message:
        header: dict[str, Any] = {"key": key, "member": {"peer_id": self.identity.peer_id}}
        if token is not None:
            header["token"] = token
        return await self.transport.call(self.owner, "avg.join", Message(header), timeout=10)

    async def refused_everywhere(self, fingerprint: str, token: str | None, reason: str) -> None:
        run_key = f"{self.prefix}/{fingerprint}"
        for attempt in (self.read(f"{self.prefix}/manifests", token),
                        self.read(f"{run_key}/progress", token),
                        self.write(f"{run_key}/progress", token),
                        self.join_round(f"{run_key}/epoch-1", token)):
            with pytest.raises(RemoteError) as refused:
                await attempt
            assert refused.value.kind == "NotAMember", refused.value
            assert reason in refused.value.message, refused.value.message
        with pytest.raises(StateSyncError, match=reason):
            await download_state(self.transport, self.owner, run_key, token)


async def test_only_members_take_part_in_a_closed_run(daemon_factory: Any) -> None:
    owner = await daemon_factory()
    address = await p2p_address(owner)
    member = await daemon_factory("--net.bootstrap", address)
    owner_id = (await owner.call("node.info"))["peer_id"]
    member_id = (await member.call("node.info"))["peer_id"]
    started = await owner.call("run.start", PARAMS)
    assert started["manifest"]["closed"] is True and started["manifest"]["owner"] == owner_id
    fingerprint = started["fingerprint"]
    prefix = f"closed/{owner_id}/club"

    # Without a token the run does not even exist for the member: its keys are not the open ones.
    async def in_the_dht() -> bool:
        return bool((await member.call("node.info"))["dht"]["joined"])

    await wait_until(in_the_dht, timeout=60)
    assert await _join(member, {"name": "club"}) is None  # "no peer publishes a run named 'club'"
    issued = await owner.call("token.issue", {"name": "club", "peer": member_id, "days": 1})
    assert issued["peer"] == member_id and issued["role"] == "trainer"
    joined = await wait_until(lambda: _join(member, {"token": issued["token"]}), timeout=60)
    assert joined["fingerprint"] == fingerprint and joined["manifest"] == started["manifest"]

    async def together() -> dict[str, Any] | None:
        status = await _status(member)
        assert status["state"] == "running", status
        last = status["last_round"]
        return status if last and last["senders"] == 2 else None

    await wait_until(together, timeout=120)

    intruder_identity = Identity.generate()
    transport = await TlsTransport.start(intruder_identity, [PeerAddress.parse("/ip4/127.0.0.1/tcp/0")])
    try:
        await transport.connect(PeerAddress.parse(address), timeout=10)
        intruder = Intruder(transport, intruder_identity, owner_id, prefix)
        await intruder.refused_everywhere(fingerprint, None, "no token")
        # The member's token names the member: useless to anyone else.
        await intruder.refused_everywhere(fingerprint, issued["token"], "not for the caller")
        # A token signed by another key than the owner's (a forgery).
        claims = MembershipToken(owner_id, "club", intruder_identity.peer_id, "trainer", time.time(),
                                 time.time() + 600, "ab" * 8)
        forged = dataclasses.replace(
            claims, signature=Identity.generate().sign(claims.signing_bytes()))
        await intruder.refused_everywhere(fingerprint, forged.encode(), "not signed")
        # An expired token.
        short = await owner.call("token.issue", {"name": "club", "peer": intruder_identity.peer_id,
                                                 "days": 1.0 / 86400})
        await asyncio.sleep(1.2)
        await intruder.refused_everywhere(fingerprint, short["token"], "expired")
        # A valid one works...
        good = await owner.call("token.issue", {"name": "club", "peer": intruder_identity.peer_id})
        reply = await intruder.read(f"{prefix}/manifests", good["token"])
        assert reply.header["entries"], reply.header
        # What a DHT node holds of the run is ciphertext (any node close to the key holds it,
        # member or not); the run key sealed in the token, from the owner's ledger, opens it.
        entries, _ = dht_protocol.decode_values(f"{prefix}/manifests", reply)
        secret = MembershipToken.decode(good["token"]).run_secret(intruder_identity)
        for entry in entries:
            assert entry.value.startswith(MAGIC) and b"tiny" not in entry.value, entry
            document = orjson.loads(secret.decrypt(entry.signer, entry.key, entry.sub_key,
                                                   entry.value))
            assert document["manifest"]["workload"] == "tiny"
        assert {entry.signer for entry in entries} == {owner_id, member_id}
        # ...until the owner revokes it.
        revoked = await owner.call("token.revoke", {"name": "club", "serial": good["serial"]})
        assert revoked["revoked_serials"] == [good["serial"]] and revoked["published"]
        await intruder.refused_everywhere(fingerprint, good["token"], "revoked")
        # The owner's revocation list is public, and only the owner may write it.
        reply = await intruder.read(f"{prefix}/revoked")
        assert reply.header["entries"] == 1
        with pytest.raises(RemoteError, match="only the run's owner"):
            await intruder.write(f"{prefix}/revoked")
        # A replayed older revocation list does not undo a newer one.
        listing = await owner.call("token.list", {"name": "club"})
        states = {t["serial"]: (t["revoked"], t["expired"]) for t in listing["tokens"]}
        assert states[good["serial"]] == (True, False) and states[short["serial"]][1] is True
        older = Revocations(owner_id, "club", revoked["version"] - 10.0)
        assert Revocations.from_bytes(older.to_bytes(), owner_id, "club").version < revoked["version"]
    finally:
        await transport.close()

    info = await owner.call("node.info")
    assert info["counters"]["membership.refusals"] >= 20
    assert info["counters"]["membership.refused_dht_read"] >= 10
    assert info["counters"]["membership.refused_state_download"] >= 5
    # The member trained on throughout.
    status = await _status(member)
    assert status["state"] == "running" and status["epoch"] >= 1

    # Revoking the member: it learns within a refresh (30 s) and its run stops, saying why.
    await owner.call("token.revoke", {"name": "club", "peer": member_id})

    async def stopped() -> dict[str, Any] | None:
        status = await _status(member)
        return status if status["state"] == "failed" else None

    status = await wait_until(stopped, timeout=90)
    assert "revoked" in status["error"]["message"]


async def test_token_errors_are_clear(daemon_factory: Any) -> None:
    daemon = await daemon_factory()
    peer_id = (await daemon.call("node.info"))["peer_id"]
    for params, text in (({"token": "dlt2.gar!bage.x"}, "garbled"),
                         ({"token": "hello"}, "not a dedloc run token"),
                         ({"token": "dlt1.e30.AAAA"}, "older dedloc")):
        with pytest.raises(RpcCallError) as caught:
            await daemon.call("run.start", params)
        assert caught.value.code == ErrorCode.MEMBERSHIP_ERROR and text in caught.value.message
    other = MembershipToken.issue(Identity.generate(), "club", Identity.generate().peer_id, "trainer",
                                  60, RunSecret.generate())
    with pytest.raises(RpcCallError, match="not for this node"):
        await daemon.call("run.start", {"token": other.encode()})
    aux_only = MembershipToken.issue(Identity.generate(), "club", peer_id, "aux", 60,
                                     RunSecret.generate())
    with pytest.raises(RpcCallError, match="aux peer only"):
        await daemon.call("run.start", {"token": aux_only.encode()})
    with pytest.raises(RpcCallError) as caught:
        await daemon.call("token.issue", {"name": "club", "peer": "not-a-peer"})
    assert caught.value.code == ErrorCode.INVALID_PARAMS
    with pytest.raises(RpcCallError, match="issued no token"):
        await daemon.call("token.revoke", {"name": "nothing", "serial": "00"})
    issued = await daemon.call("token.issue", {"name": "club", "peer": Identity.generate().peer_id})
    assert MembershipToken.decode(issued["token"]).owner == peer_id
    document = orjson.loads(orjson.dumps(await daemon.call("token.list", {"name": "club"})))
    assert [t["serial"] for t in document["tokens"]] == [issued["serial"]]
