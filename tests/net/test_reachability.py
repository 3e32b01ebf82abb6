"""Dial-back (reachability.py), played by a stranger: the answerer dials only addresses at the IP
the request came from, so no peer (identities being free) can make it send SYNs and TLS hellos
to a third party or to its own LAN; a request over a link without an IP to dial back is
refused; the honest check still finds a reachable peer reachable."""

from __future__ import annotations

from typing import Any

import pytest

from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, PeerAddress, RemoteError, RequestContext, TlsTransport
from dedloc.daemon.net.addresses import ip_of
from dedloc.daemon.net.reachability import (
    DIAL_BACK,
    DialBackRefused,
    DialBackService,
    check_reachability,
)

LOOPBACK = [PeerAddress.parse("/ip4/127.0.0.1/tcp/0")]


@pytest.fixture
async def pair() -> Any:
    asker = await TlsTransport.start(Identity.generate(), LOOPBACK)
    answerer = await TlsTransport.start(Identity.generate(), LOOPBACK)
    dialed: list[str] = []

    async def probe(address: PeerAddress, timeout: float) -> str:
        dialed.append(str(address))
        return await answerer.probe(address, timeout)

    # (a generous probe timeout: a loaded machine's handshake must not read as unreachable)
    service = DialBackService(answerer, probe, timeout=30.0, min_interval=0.0)
    asker.learn_addresses(answerer.peer_id, answerer.listen_addresses())
    yield asker, answerer, service, dialed
    await asker.close()
    await answerer.close()


async def test_only_the_requesters_own_ip_is_dialed(pair: Any) -> None:
    asker, answerer, service, dialed = pair
    own = asker.listen_addresses()[0].without_peer()
    header = {"addresses": [str(own), "/ip4/10.1.2.3/tcp/22", "/ip4/192.168.1.1/tcp/80",
                            "/dns/victim.invalid/tcp/443"]}
    reply = await asker.call(answerer.peer_id, DIAL_BACK, Message(header), timeout=30)
    assert reply.header["reachable"] == [str(own.with_peer(asker.peer_id))]
    assert dialed == [str(own.with_peer(asker.peer_id))]  # nothing else was sent anywhere
    assert service.counters["addresses_skipped"] == 3 and service.counters["answered"] == 1


async def test_a_peer_at_another_ip_is_found_unreachable_without_being_dialed(pair: Any) -> None:
    asker, answerer, service, dialed = pair
    header = {"addresses": ["/ip4/203.0.113.7/tcp/4100"]}  # (TEST-NET-3: not the asker's)
    reply = await asker.call(answerer.peer_id, DIAL_BACK, Message(header), timeout=30)
    assert reply.header["reachable"] == [] and dialed == []
    assert service.counters["addresses_skipped"] == 1
    # the honest check: its own addresses are the ones it is reached at here
    assert await check_reachability(asker, [answerer.peer_id], asker.listen_addresses(),
                                     timeout=30) is True


async def test_a_request_over_a_link_without_an_ip_is_refused(pair: Any) -> None:
    _, _, service, dialed = pair
    for context in (RequestContext("relayed-peer", "relay", remote_host=None),
                    RequestContext("named-peer", "tcp", remote_host="peer.invalid")):
        with pytest.raises(DialBackRefused, match="direct link"):
            await service._on_dial_back(context, Message({"addresses": ["/ip4/127.0.0.1/tcp/1"]}))
    assert service.counters["refused_indirect"] == 2 and dialed == []


async def test_requests_stay_limited_per_peer(pair: Any) -> None:
    asker, answerer, _, _ = pair
    DialBackService(answerer, answerer.probe, min_interval=3600.0)  # (replaces the handler)
    header = {"addresses": [str(asker.listen_addresses()[0].without_peer())]}
    await asker.call(answerer.peer_id, DIAL_BACK, Message(header), timeout=30)
    with pytest.raises(RemoteError, match="at most one dial-back"):
        await asker.call(answerer.peer_id, DIAL_BACK, Message(header), timeout=30)


def test_ips_compare_as_addresses() -> None:
    assert ip_of("::ffff:127.0.0.1") == ip_of("127.0.0.1")
    assert ip_of("2001:db8::1") == ip_of("2001:0db8:0000::1")
    assert ip_of("example.invalid") is None and ip_of(None) is None
