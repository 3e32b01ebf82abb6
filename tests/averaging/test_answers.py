"""Signed answers compared between members (answers.py), pure and in milliseconds: a reducer
that signed two different accounts for one chunk (each member's own entry true in its copy) is
proven and banned by the member that compares; equal answers, or a summary whose signature does
not hold, blame nobody; the handler takes one summary per member and round, from members."""

from __future__ import annotations

import collections
import time
from typing import Any

import orjson
import pytest
from averaging.fake_transport import HandlerTransport

from dedloc.daemon.averaging.answers import AnswerSummaries
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.signatures import account_digest, round_name, sign_answer
from dedloc.daemon.averaging.wire import PeerFault
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext

IDS = [Identity.from_seed(bytes([i + 40]) * 32) for i in range(4)]
PEERS = [i.peer_id for i in IDS]
REDUCER = 3
GROUP = Group("group-c", "key", tuple(Member(p, "trainer", 1.0, 1e6, 1e6) for p in PEERS), 400,
              ((0, 100), (100, 200), (200, 300), (300, 400)), 50, "none", time.time() + 30, "mean")
NAME = round_name(GROUP)
ANSWER = bytes(range(32))


def told(account: dict[str, Any], chunk: int = 0, by: Identity = IDS[REDUCER]
         ) -> tuple[bytes, bytes, str]:
    return ANSWER, account_digest(account), sign_answer(by, NAME, REDUCER, chunk, ANSWER, account)


def summary(*items: tuple[int, tuple[bytes, bytes, str]]) -> Message:
    body = [[REDUCER, c, answer.hex(), account.hex(), signature]
            for c, (answer, account, signature) in items]
    return Message({"g": GROUP.group_id}, orjson.dumps(body))




def service() -> tuple[Any, collections.Counter[str], BanList, dict[Any, Any]]:
    counters: collections.Counter[str] = collections.Counter()
    bans = BanList(counters=counters)
    transport = HandlerTransport(PEERS[0])
    summaries = AnswerSummaries(transport, bans, counters)  # type: ignore[arg-type]
    mine: dict[Any, Any] = {}
    summaries.remember(GROUP, 0, mine)
    return transport.handlers["avg.answers"], counters, bans, mine


async def test_two_signed_accounts_for_one_chunk_prove_the_reducer_told_members_otherwise() -> None:
    handle, counters, bans, mine = service()
    ours = {"s": [[0, 1.0, [0.5], 1.0, "", ""]], "e": [0.0]}
    theirs = {"s": [[0, 1.0, [0.7], 1.0, "", ""]], "e": [0.0]}  # (another entry for member 0)
    mine[(REDUCER, 0)] = told(ours)
    mine[(REDUCER, 1)] = told(ours, 1)
    reply = await handle(RequestContext(PEERS[1]), summary((1, told(ours, 1))))  # the same: fine
    assert reply.header["equivocations"] == 0 and bans.banned(PEERS[REDUCER]) is None
    # a signature that does not hold proves nothing (the summary's writer may have forged it)
    reply = await handle(RequestContext(PEERS[2]), summary((0, told(theirs, by=IDS[2]))))
    assert reply.header["equivocations"] == 0 and counters["answer_summaries_unproven"] == 1
    assert bans.banned(PEERS[REDUCER]) is None and bans.banned(PEERS[2]) is None
    # the reducer signed another account for chunk 0 to member 3... (a member of the round)
    handle, counters, bans, mine = service()
    mine[(REDUCER, 0)] = told(ours)
    reply = await handle(RequestContext(PEERS[1]), summary((0, told(theirs))))
    assert reply.header["equivocations"] == 1 and counters["equivocations"] == 1
    assert bans.banned(PEERS[REDUCER]) is not None


async def test_the_handler_takes_one_summary_per_member_and_round_from_members() -> None:
    handle, counters, bans, mine = service()
    mine[(REDUCER, 0)] = told({"s": [], "e": [0.0]})
    await handle(RequestContext(PEERS[1]), summary())
    stranger = Identity.from_seed(bytes([99]) * 32).peer_id
    bans.offence(PEERS[3], "protocol", "a test's", conclusive=True)
    for peer, message in [(PEERS[1], summary()),  # heard already
                          (PEERS[3], summary()),  # banned here
                          (stranger, summary()),
                          (PEERS[2], Message({"g": "another"}, b"[]")),
                          (PEERS[2], Message({"g": GROUP.group_id}, b"not json")),
                          (PEERS[2], Message({"g": GROUP.group_id}, b"[]"))]:  # heard: malformed
        with pytest.raises(PeerFault):
            await handle(RequestContext(peer), message)
    assert counters["answer_summaries_refused"] == 5
    assert counters["answer_summaries_malformed"] == 1
    # no more items than the round has chunks (8), nor bytes beyond what they take
    handle, counters, _, mine = service()
    for peer, body in [(PEERS[1], orjson.dumps([[REDUCER, 0, "", "", ""]] * 9)),
                       (PEERS[2], b" " * (320 * 8 + 3))]:
        with pytest.raises(PeerFault):
            await handle(RequestContext(peer), Message({"g": GROUP.group_id}, body))
    # malformed items are skipped and counted, the rest compared
    handle, counters, _, mine = service()
    reply = await handle(RequestContext(PEERS[1]), Message(
        {"g": GROUP.group_id}, orjson.dumps([[1, 2], [REDUCER, 0, "zz", "zz", "zz"], "x"])))
    assert reply.header["equivocations"] == 0 and counters["answer_summaries_malformed"] == 3


async def test_the_answers_a_summary_says_were_applied_are_passed_on_but_those_of_its_own_part(
        ) -> None:
    """withheld.py asks members for the accounts their summaries say they applied. No member
    applies an answer of its own part: a reducer's summary that claims one (to serve an account
    of its choosing to the sender it skipped) is not passed on."""
    counters: collections.Counter[str] = collections.Counter()
    heard: list[tuple[str, str, list[Any]]] = []
    transport = HandlerTransport(PEERS[0])
    summaries = AnswerSummaries(transport, BanList(counters=counters), counters,  # type: ignore[arg-type]
                                on_applied=lambda g, p, items: heard.append((g, p, items)))
    summaries.remember(GROUP, 0, {})
    account = {"s": [], "e": [0.0]}
    body = [[j, 0, ANSWER.hex(), account_digest(account).hex(), told(account)[2]] for j in (1, 3)]
    await transport.handlers["avg.answers"](RequestContext(PEERS[REDUCER]),
                                            Message({"g": GROUP.group_id}, orjson.dumps(body)))
    assert heard == [(GROUP.group_id, PEERS[REDUCER], [(1, 0, account_digest(account))])]
