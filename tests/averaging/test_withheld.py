"""withheld.py against peers that lie: the account a member serves (avg.account) goes only to a
sender of the round, once per chunk; a sender asks each member once per chunk, blames nobody for
an account its reducer did not sign, does not stop at an account that states it truly while
another is claimed, and keeps at most MAX_KEPT_BYTES of chunks. (The
honest path, a reducer that forges an account and skips the sender it misstates, is played end
to end in tests/hostile/test_wrong_average.py.)"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import numpy as np
import orjson
import pytest
from averaging.fake_transport import HandlerTransport
from support import wait_until

from dedloc.daemon.averaging import withheld
from dedloc.daemon.averaging.accusations import Accusations
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.wire import PeerFault
from dedloc.daemon.averaging.withheld import METHOD, WithheldAnswers
from dedloc.daemon.net import Message, RequestContext

IDS = ["peer-a", "peer-b", "peer-c", "peer-d"]
CHUNK = 1000


def _group() -> Group:
    members = tuple(Member(p, "trainer", 1.0, 1e6, 1e6) for p in IDS)
    bounds = ((0, 2000), (2000, 4000), (4000, 6000), (6000, 8000))
    return Group("round-1", "key", members, 8000, bounds, CHUNK, "none", time.time() + 30)


class CallingTransport(HandlerTransport):
    """Records the calls made and answers each with the reply `replies` gives for its peer."""

    def __init__(self, peer_id: str, replies: dict[str, Any]) -> None:
        super().__init__(peer_id)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.replies = replies

    async def call(self, peer: str, method: str, message: Message, *, timeout: float) -> Message:
        if method != METHOD:  # (an accusation: judged at once)
            return Message({"verdict": "forged"})
        self.calls.append((peer, dict(message.header)))
        return Message(self.replies[peer])


def _service(peer_id: str, replies: dict[str, Any] | None = None
             ) -> tuple[WithheldAnswers, CallingTransport, BanList, collections.Counter[str]]:
    transport = CallingTransport(peer_id, replies or {})
    counters: collections.Counter[str] = collections.Counter()
    bans = BanList(counters=counters)
    accusations = Accusations(transport, bans, counters)  # type: ignore[arg-type]
    return WithheldAnswers(transport, bans, counters, accusations), transport, bans, counters  # type: ignore[arg-type]


async def _ask(service: WithheldAnswers, peer: str, header: dict[str, Any]) -> Message:
    return await service._handle(RequestContext(peer), Message(header))


async def test_an_account_is_served_to_a_sender_of_the_round_once_per_chunk() -> None:
    service, _, bans, counters = _service("peer-a")
    account = [["an account"]]
    service.remember(_group(), 0, {(1, 0): (b"\1" * 32, b"\2" * 32, "ab" * 64)},
                     {(1, 0): orjson.dumps(account)})
    reply = await _ask(service, "peer-c", {"g": "round-1", "r": 1, "c": 0})
    assert reply.header == {"v": account, "h": "01" * 32, "a": "ab" * 64}
    refusals = [
        ("peer-c", {"g": "round-1", "r": 1, "c": 0}, "once per chunk"),  # again
        ("peer-x", {"g": "round-1", "r": 1, "c": 0}, "no round"),  # not a member
        ("peer-d", {"g": "round-2", "r": 1, "c": 0}, "no round"),  # another round
        ("peer-d", {"g": "round-1", "r": 1, "c": 2}, "no chunk 2"),  # a part of 2 chunks
        ("peer-d", {"g": "round-1", "r": 9, "c": 0}, "once per chunk"),  # no such member
        ("peer-d", {"g": "round-1", "r": True, "c": 0}, "once per chunk"),
        ("peer-d", {"g": "round-1", "r": 2, "c": 0}, "no answer"),  # not applied here
    ]
    for peer, header, reason in refusals:
        with pytest.raises(PeerFault, match=reason):
            await _ask(service, peer, header)
    bans.offence("peer-b", "protocol", "test", conclusive=True)
    with pytest.raises(PeerFault, match="no round"):
        await _ask(service, "peer-b", {"g": "round-1", "r": 1, "c": 0})
    assert counters["withheld_refused"] == 7


async def test_an_account_its_reducer_did_not_sign_blames_nobody_and_the_next_member_is_asked(
        ) -> None:
    """Member 0 sent reducer 1 chunk 0 and got no answer. Three members say they applied it
    (one account digest); each serves an account that the reducer did not sign (a hostile
    member's forgery, or one of another group): nothing is proven, nobody is banned, and member
    0 asks the next one, each once."""
    unsigned = {"v": [], "h": "00" * 32, "a": "00" * 64}
    service, transport, bans, counters = _service(
        "peer-a", {p: unsigned for p in ("peer-b", "peer-c", "peer-d")})
    service.remember(_group(), 0, {}, {})
    payload = np.ones(CHUNK, np.float32)
    service.withheld("round-1", {(1, 0): (payload, {})})
    for peer in ("peer-c", "peer-d", "peer-b", "peer-c"):  # (peer-c twice: asked once)
        service.applied("round-1", peer, [(1, 0, b"\1" * 32)])

    async def all_asked() -> bool:  # (the asks run one after another in the background)
        return counters["withheld_unproven"] == 3

    await wait_until(all_asked, timeout=60, interval=0.01)
    await asyncio.sleep(0.05)  # (room for an ask too many)
    assert [peer for peer, _ in transport.calls] == ["peer-c", "peer-d", "peer-b"]
    assert transport.calls[0][1] == {"g": "round-1", "r": 1, "c": 0}
    assert counters["offences"] == 0 and not bans.status()["active"]


async def test_an_account_stating_the_sender_truly_does_not_end_the_search_for_a_forged_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reducer (member 3) signed two accounts of one chunk: in the one the honest member 1
    applied, sender 0's entry is forged; in the other, which an accomplice (member 2) serves,
    it is true. Member 0 asks the accomplice first (its summary came first) and finds itself
    stated truly, but the summaries name two account digests for the chunk: it asks for the
    other, finds its entry forged, bans the reducer and accuses it before the others."""
    import dataclasses

    from averaging.test_accusations import GROUP, PEERS, REDUCER, account, signed_account
    from averaging.test_accusations import _group as group_of

    from dedloc.daemon.averaging.signatures import account_digest

    monkeypatch.setattr(withheld, "ASKS_AT_ONCE", 1)  # (one after the other: in that order)
    entries, answer, sent = account()
    truthful, signed_truthful = signed_account(entries, answer)
    lying = [dataclasses.replace(e, projections=tuple(p + 1.0 for p in e.projections))
             if e.sender == 0 else e for e in entries]
    forged, signed_forged = signed_account(lying, answer)
    service, transport, bans, counters = _service(PEERS[0], {
        PEERS[2]: {"v": truthful, "h": answer.hex(), "a": signed_truthful},
        PEERS[1]: {"v": forged, "h": answer.hex(), "a": signed_forged}})
    service.remember(group_of(), 0, {}, {})
    service.applied(GROUP, PEERS[2], [(REDUCER, 0, account_digest(truthful))])
    service.applied(GROUP, PEERS[1], [(REDUCER, 0, account_digest(forged))])
    payload, meta, _ = sent[0]
    service.withheld(GROUP, {(REDUCER, 0): (payload, meta)})

    async def banned() -> bool:
        return bans.banned(PEERS[REDUCER]) is not None

    await wait_until(banned, timeout=60, interval=0.01)
    assert [peer for peer, _ in transport.calls][:2] == [PEERS[2], PEERS[1]]
    assert counters["withheld_checked"] == 1 and counters["withheld_forgeries"] == 1
    assert counters["offences_forged_account"] == 1
    assert bans.banned(PEERS[1]) is None and bans.banned(PEERS[2]) is None


async def test_a_sender_keeps_at_most_max_kept_bytes_of_unanswered_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(withheld, "MAX_KEPT_BYTES", 10_000)
    service, transport, _, counters = _service("peer-a")
    service.remember(_group(), 0, {}, {})
    chunk = np.ones(CHUNK, np.float32)  # 4000 bytes
    service.withheld("round-1", {(1, 0): (chunk, {}), (1, 1): (chunk, {}), (2, 0): (chunk, {})})
    assert counters["withheld_not_kept"] == 1
    kept = service._rounds["round-1"]
    assert sorted(kept.unanswered) == [(1, 0), (1, 1)]
    chunk[:] = 5.0  # (kept as a copy: the vector may change once the round is over)
    assert bytes(kept.unanswered[(1, 0)][0]) == np.ones(CHUNK, np.float32).tobytes()
    service.withheld("round-unknown", {(1, 0): (chunk, {})})  # a round not remembered: nothing
    assert not transport.calls


async def test_nothing_is_asked_once_the_service_is_closed() -> None:
    service, transport, _, _ = _service("peer-a", {"peer-b": {"v": [], "h": "00" * 32, "a": ""}})
    service.remember(_group(), 0, {}, {})
    service.withheld("round-1", {(1, 0): (np.ones(CHUNK, np.float32), {})})
    service.close()  # (a summary handled while the daemon closes)
    service.applied("round-1", "peer-b", [(1, 0, b"\1" * 32)])
    await asyncio.sleep(0.05)
    assert not transport.calls


async def test_unanswered_chunks_of_a_round_long_over_make_room_for_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    monkeypatch.setattr(withheld, "MAX_KEPT_BYTES", 10_000)
    service, _, _, counters = _service("peer-a")
    first = _group()
    service.remember(first, 0, {}, {})
    chunk = np.ones(CHUNK, np.float32)  # 4000 bytes
    service.withheld("round-1", {(1, 0): (chunk, {}), (1, 1): (chunk, {})})
    later = first.deadline + withheld.UNANSWERED_SECONDS + 1
    monkeypatch.setattr(withheld.timebase, "now", lambda: later)
    service.remember(dataclasses.replace(first, group_id="round-2", deadline=later + 30), 0, {}, {})
    service.withheld("round-2", {(1, 0): (chunk, {}), (2, 0): (chunk, {})})
    assert not service._rounds["round-1"].unanswered
    assert sorted(service._rounds["round-2"].unanswered) == [(1, 0), (2, 0)]
    assert counters["withheld_not_kept"] == 0


async def test_the_account_most_members_claim_is_asked_first(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Accomplices that send their summaries first and stall (each claiming an account digest of
    its own) must not hold up the members that applied the one account: it is asked first."""
    monkeypatch.setattr(withheld, "ASKS_AT_ONCE", 1)
    stall = {"v": [], "h": "00" * 32, "a": "00" * 64}
    service, transport, _, _ = _service("peer-a", {p: stall for p in IDS})
    service.remember(_group(), 0, {}, {})
    service.applied("round-1", "peer-b", [(1, 0, b"\2" * 32)])  # an accomplice, first
    service.applied("round-1", "peer-c", [(1, 0, b"\1" * 32)])
    service.applied("round-1", "peer-d", [(1, 0, b"\1" * 32)])
    service.withheld("round-1", {(1, 0): (np.ones(CHUNK, np.float32), {})})

    async def asked() -> bool:
        return bool(transport.calls)

    await wait_until(asked, timeout=60, interval=0.01)
    assert transport.calls[0][0] in ("peer-c", "peer-d")
