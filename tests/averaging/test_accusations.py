"""Signed contributions and answers, and accusations (signatures.py, accounts.check_signatures,
accusations.py), pure and in milliseconds: an account can only list what each sender signed for
that slot; a sender whose entry is misstated proves it with the reducer's signed account and the
chunk it signed, whatever the reducer told the others; anything else it could show is judged a
false accusation; the handler bounds what a stranger's accusation costs."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np
import orjson
import pytest
from averaging.fake_transport import HandlerTransport

from dedloc.daemon.averaging.accounts import (
    Entry,
    WrongAverage,
    account_header,
    answer_digest,
    check_signatures,
    measure,
    segments,
    signs_of,
)
from dedloc.daemon.averaging.accusations import Accusations, judge
from dedloc.daemon.averaging.audits import commitment
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.compression import get_codec
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.signatures import (
    answer_signed_by,
    contribution_digest,
    round_name,
    sign,
    sign_answer,
    signed_by,
)
from dedloc.daemon.averaging.wire import PeerFault
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext

N = 5000
IDS = [Identity.from_seed(bytes([i]) * 32) for i in range(4)]
PEERS = [i.peer_id for i in IDS]
REDUCER = 3
GROUP = "group-a"
DEADLINE = time.time() + 3600  # (the round's name covers it: one for every group here)


def _group(**changes: Any) -> Group:
    members = tuple(Member(peer, "trainer", 1.0, 1e6, 1e6) for peer in PEERS)
    bounds = tuple((2 * k * N, 2 * (k + 1) * N) for k in range(4))  # two chunks each
    group = Group(GROUP, "key", members, 8 * N, bounds, N, "none", DEADLINE, "mean")
    return dataclasses.replace(group, **changes)


NAME = round_name(_group())


def chunk(seed: int, codec: str = "none") -> tuple[Any, dict[str, Any], np.ndarray]:
    """A sender's chunk as it goes out, and as the reducer decodes it."""
    values = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    payload, meta = get_codec(codec).encode(values)
    payload = bytes(memoryview(payload).cast("B"))
    return payload, meta, get_codec(codec).decode(payload, meta, N)


def account(codec: str = "none") -> tuple[list[Entry], bytes, list[Any]]:
    """An honest reducer's entries for chunk 0 of its part (senders 0-2 signed, its own a
    commitment), the answer's digest, and what each sender sent."""
    parts = segments(N, 4)
    signed, decoded, sent = [], [], []
    for i in range(4):
        payload, meta, values = chunk(i, codec)
        digest = contribution_digest(GROUP, REDUCER, 0, meta, payload)
        own = commitment(GROUP, REDUCER, 0, values, parts)[0]
        signed.append((own, "") if i == REDUCER
                      else (digest.hex(), sign(IDS[i], NAME, REDUCER, 0, digest)))
        decoded.append(values)
        sent.append((payload, meta, digest))
    answer = answer_digest(GROUP, REDUCER, 0, {}, b"the answer", [d for d, _ in signed])
    r = signs_of(answer, N)
    entries = [Entry(i, 1.0, *measure(r, decoded[i], parts), *signed[i]) for i in range(4)]
    return entries, answer, sent


def signed_account(entries: list[Entry], answer: bytes, by: Identity = IDS[REDUCER],
                   name: str = NAME) -> tuple[dict[str, Any], str]:
    header = account_header(entries, [0.0] * len(segments(N, 4)))
    return header, sign_answer(by, name, REDUCER, 0, answer, header)


def test_a_signature_names_its_signer_and_its_slot() -> None:
    payload, meta, _ = chunk(0)
    digest = contribution_digest(GROUP, REDUCER, 0, meta, payload)
    signature = sign(IDS[0], NAME, REDUCER, 0, digest)
    assert signed_by(PEERS[0], NAME, REDUCER, 0, digest, signature)
    assert not signed_by(PEERS[1], NAME, REDUCER, 0, digest, signature)
    # the slot is signed too: the same digest named for another chunk, reducer or round fails
    for name, reducer, index in ((NAME, REDUCER, 1), (NAME, 2, 0), ("another", REDUCER, 0)):
        assert not signed_by(PEERS[0], name, reducer, index, digest, signature)
    assert not signed_by(PEERS[0], NAME, REDUCER, 0,
                         contribution_digest(GROUP, REDUCER, 0, meta, payload + b"x"), signature)
    # (the round's name covers its deadline, so the signature differs from run to run: the
    # altered one must differ from it whatever its last byte)
    altered = signature[:-2] + ("01" if signature.endswith("00") else "00")
    for bad in (None, 5, "zz" * 64, signature[:-2], altered, altered.upper()):
        assert not signed_by(PEERS[0], NAME, REDUCER, 0, digest, bad)
    assert not signed_by("not-a-peer-id", NAME, REDUCER, 0, digest, signature)


def test_a_round_is_named_by_its_whole_group_as_every_member_parses_it() -> None:
    """A leader that sends members groups differing anywhere (another member's weight, the
    deadline) makes them name different rounds, which they see and set aside without blaming
    each other (butterfly: GroupMismatch); the group as a follower parses it from the leader's
    JSON (weights as integers there) names the same round as the leader's own."""
    group = _group()
    wire = orjson.loads(orjson.dumps(group.to_json()))
    for member in wire["members"]:
        member["weight"] = 1  # (an integer on the wire)
    assert round_name(Group.from_json(wire)) == NAME
    heavier = (dataclasses.replace(group.members[0], weight=2.0), *group.members[1:])
    aux = (*group.members[:3], dataclasses.replace(group.members[3], role="aux", weight=0.0))
    changes: list[dict[str, Any]] = [
        {"group_id": "group-b"}, {"members": tuple(reversed(group.members))}, {"members": aux},
        {"members": heavier}, {"deadline": DEADLINE + 1}, {"key": "other"},
        {"part_bounds": ((0, N), (N, 4 * N), (4 * N, 6 * N), (6 * N, 8 * N))},
        {"compression": "fp16"}, {"aggregation": "norm_clip"}]
    names = {round_name(_group(**change)) for change in changes}
    assert NAME not in names and len(names) == len(changes)


def test_the_digests_are_of_the_meta_as_json_carries_it() -> None:
    """Both ends hash the same bytes: a NaN in a meta goes as null, a tuple as a list."""
    sent, received = {"lo": float("nan"), "s": (1, 2)}, {"s": [1, 2], "lo": None}
    assert contribution_digest(GROUP, 0, 0, sent, b"x") == contribution_digest(GROUP, 0, 0, received, b"x")
    assert answer_digest(GROUP, 0, 0, sent, b"x") == answer_digest(GROUP, 0, 0, received, b"x")


def test_an_account_lists_only_what_each_sender_signed_for_that_slot() -> None:
    entries, _, sent = account()

    def check(case: list[Entry], me: int = 0) -> None:
        check_signatures(case, peers=PEERS, round_=NAME, reducer=REDUCER, chunk=0, me=me,
                         my_digest=sent[me][2])

    check(entries)
    other = contribution_digest(GROUP, REDUCER, 1, {}, b"member 0's chunk 1")
    forged = [
        # a sender that sent nothing, listed without its signature
        [*entries[:1], dataclasses.replace(entries[1], digest="", signature=""), *entries[2:]],
        # another sender's signature
        [*entries[:1], dataclasses.replace(entries[1], signature=entries[2].signature), *entries[2:]],
        # a signed digest, with another digest named
        [*entries[:1], dataclasses.replace(entries[1], digest=entries[2].digest), *entries[2:]],
        # the member's signed chunk of another slot (its chunk 1): no signature here
        [dataclasses.replace(entries[0], digest=other.hex(),
                             signature=sign(IDS[0], NAME, REDUCER, 1, other)), *entries[1:]],
        # the reducer's own, without its commitment (audits.py)
        [*entries[:3], dataclasses.replace(entries[3], digest="")],
    ]
    for case in forged:
        for me in (0, 1):
            with pytest.raises(WrongAverage, match=r"signature|commitment"):
                check(case, me)
    # a chunk the member signed for this slot but did not send now (a round id used again):
    # refused, but nothing it could prove (no accusation: accusations.py)
    again = contribution_digest(GROUP, REDUCER, 0, {}, b"an earlier round's chunk 0")
    replayed = dataclasses.replace(entries[0], digest=again.hex(),
                                   signature=sign(IDS[0], NAME, REDUCER, 0, again))
    with pytest.raises(WrongAverage, match="another contribution") as caught:
        check([replayed, *entries[1:]])
    assert type(caught.value) is WrongAverage


@pytest.mark.parametrize("codec", ["none", "uint8", "topk"])
def test_a_misstated_entry_is_proven_by_its_sender_and_only_so(codec: str) -> None:
    entries, answer, sent = account(codec)
    payload, meta, _ = sent[1]

    def verdict(case: list[Entry], payload: Any = payload, meta: Any = meta,
                by: Identity = IDS[REDUCER], answer: bytes = answer) -> str:
        header, signature = signed_account(case, answer, by, round_name(_group(compression=codec)))
        return judge(_group(compression=codec), accuser=1, reducer=REDUCER, chunk=0, meta=meta,
                     payload=payload, account=header, answer=answer, signature=signature,
                     codec=get_codec(codec))[0]

    lying = [dataclasses.replace(e, projections=tuple(p + 1.0 for p in e.projections))
             if e.sender == 1 else e for e in entries]
    assert verdict(lying) == "forged"
    # an entry at the edge of the accuser's rounding margin (which its check would flag, by a
    # hair) is still forged to the judge, which allows half that margin
    n, norm = N, entries[1].norm
    edge = (n * 2.0**-53 * n**0.5 * norm * 4 + 1e-30) * 0.75
    at_edge = [dataclasses.replace(e, projections=(e.projections[0] + edge, *e.projections[1:]))
               if e.sender == 1 else e for e in entries]
    assert verdict(at_edge) == "forged"
    norm = [dataclasses.replace(e, norm=e.norm * 0.5) if e.sender == 1 else e for e in entries]
    assert verdict(norm) == "forged"
    # what no honest member shows: the account stating its chunk truly, an account its reducer
    # did not sign, another chunk than the one the account names, an account not listing it
    assert verdict(entries) == "false"
    # (an account whose signature does not hold here proves nothing, blames nobody: the accuser
    # may have forged it, or a hostile leader sent this member another group than the accuser)
    assert verdict(lying, by=IDS[1]) == "unproven"
    other, other_meta, _ = chunk(9, codec)
    assert verdict(lying, other, other_meta) == "false"
    assert verdict([e for e in lying if e.sender != 1]) == "false"
    # the signature covers the answer's digest: another one does not open it
    header, signature = signed_account(lying, answer)
    assert not answer_signed_by(PEERS[REDUCER], NAME, REDUCER, 0, bytes(32), header, signature)


async def test_the_handler_judges_once_per_reducer_and_bounds_what_a_stranger_costs() -> None:
    """Member 0 was in the round; member 1 accuses reducer 3 with its signed, forged account:
    the reducer is banned. The same accusation again, malformed ones, one from outside the
    round, one for a round this member was not in, one against this member itself, for a chunk
    the part does not have or with a payload larger than the chunk can be are refused, and
    so is anything from a peer banned here."""
    counters: collections.Counter[str] = collections.Counter()
    bans = BanList(counters=counters)
    transport = HandlerTransport(PEERS[0])
    accusations = Accusations(transport, bans, counters)  # type: ignore[arg-type]
    entries, answer, sent = account()
    lying = [dataclasses.replace(e, projections=tuple(-p for p in e.projections))
             if e.sender == 1 else e for e in entries]
    header, signature = signed_account(lying, answer)
    accusations.remember(_group(), 0)
    handle = transport.handlers["avg.accuse"]
    payload, meta, _ = sent[1]

    def accusation(**changes: Any) -> Message:
        return Message({"g": GROUP, "r": REDUCER, "c": 0, "m": meta, "v": header,
                        "h": answer.hex(), "a": signature, **changes}, payload)

    reply = await handle(RequestContext(PEERS[1]), accusation())
    assert reply.header["verdict"] == "forged"
    assert bans.banned(PEERS[REDUCER]) is not None and counters["forged_accounts"] == 1
    stranger = Identity.from_seed(bytes([77]) * 32).peer_id
    for peer, message in [(PEERS[1], accusation()),  # heard already
                          (PEERS[2], accusation(r="3")), (PEERS[2], accusation(c=-1)),
                          (PEERS[2], accusation(h="zz")), (PEERS[2], accusation(h="z" * 64)),
                          (PEERS[2], accusation(g="another-round")),
                          (stranger, accusation()),  # not a member
                          (PEERS[2], accusation(r=0)),  # against this member itself
                          (PEERS[2], accusation(c=2)),  # no such chunk
                          (PEERS[2], Message(accusation().header, bytes(4 * N + 1)))]:
        with pytest.raises(PeerFault):
            await handle(RequestContext(peer), message)
    assert counters["forged_accounts"] == 1
    assert counters["accusations_refused"] + counters["accusations_malformed"] == 10
    # a false accusation bans its accuser, which is then heard no more
    honest_header, honest_signature = signed_account(entries, answer)
    reply = await handle(RequestContext(PEERS[2]), Message(
        {**accusation().header, "v": honest_header, "a": honest_signature}, sent[2][0]))
    assert reply.header["verdict"] == "false" and bans.banned(PEERS[2]) is not None
    with pytest.raises(PeerFault, match="banned"):
        await handle(RequestContext(PEERS[2]), accusation(r=1))


