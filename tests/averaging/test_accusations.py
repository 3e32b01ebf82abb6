"""Signed contributions and accusations (signatures.py, accounts.check_signatures,
accusations.py), pure and in milliseconds: an account can only list what each sender signed; a
sender whose entry is misstated proves it with the chunk it signed, and nobody else can prove
anything with it; the service's handler bounds what a stranger's accusation costs."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any

import numpy as np
import pytest

from dedloc.daemon.averaging.accounts import (
    Entry,
    MisstatedContribution,
    WrongAverage,
    answer_digest,
    check_signatures,
    measure,
    segments,
    signs_of,
)
from dedloc.daemon.averaging.accusations import Accusations, Applied, judge
from dedloc.daemon.averaging.audits import commitment
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.compression import get_codec
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.signatures import contribution_digest, sign, signed_by
from dedloc.daemon.averaging.wire import PeerFault
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext

N = 5000
IDS = [Identity.from_seed(bytes([i]) * 32) for i in range(4)]
PEERS = [i.peer_id for i in IDS]
REDUCER = 3
GROUP = "group-a"


def chunk(seed: int, codec: str = "none") -> tuple[Any, dict[str, Any], np.ndarray]:
    """A sender's chunk as it goes out, and as the reducer decodes it."""
    values = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    payload, meta = get_codec(codec).encode(values)
    payload = bytes(memoryview(payload).cast("B"))
    return payload, meta, get_codec(codec).decode(payload, meta, N)


def account(codec: str = "none") -> tuple[list[Entry], Applied, list[Any]]:
    """An honest reducer's entries for one chunk (senders 0-2 signed, its own unsigned), what a
    member applied of it, and what each sender sent."""
    parts = segments(N, 4)
    signed, decoded, sent = [], [], []
    for i in range(4):
        payload, meta, values = chunk(i, codec)
        digest = contribution_digest(GROUP, REDUCER, 0, meta, payload)
        own = commitment(GROUP, REDUCER, 0, values, parts)[0]
        signed.append((own, "") if i == REDUCER
                      else (digest.hex(), sign(IDS[i], GROUP, REDUCER, 0, digest)))
        decoded.append(values)
        sent.append((payload, meta, digest))
    answer = answer_digest(GROUP, REDUCER, 0, {}, b"the answer", [d for d, _ in signed])
    r = signs_of(answer, N)
    entries = [Entry(i, 1.0, *measure(r, decoded[i], parts), *signed[i]) for i in range(4)]
    return entries, Applied(tuple(entries), answer, tuple(parts)), sent


def test_a_signature_names_its_signer_and_its_chunk() -> None:
    payload, meta, _ = chunk(0)
    digest = contribution_digest(GROUP, REDUCER, 0, meta, payload)
    signature = sign(IDS[0], GROUP, REDUCER, 0, digest)
    assert signed_by(PEERS[0], GROUP, REDUCER, 0, digest, signature)
    assert not signed_by(PEERS[1], GROUP, REDUCER, 0, digest, signature)
    # the slot is signed too: the same digest named for another chunk, reducer or round fails
    for group, reducer, index in ((GROUP, REDUCER, 1), (GROUP, 2, 0), ("another", REDUCER, 0)):
        assert not signed_by(PEERS[0], group, reducer, index, digest, signature)
    assert not signed_by(PEERS[0], GROUP, REDUCER, 0,
                         contribution_digest(GROUP, REDUCER, 0, meta, payload + b"x"), signature)
    for bad in (None, 5, "zz" * 64, signature[:-2], signature.upper()[:-2] + "00"):
        assert not signed_by(PEERS[0], GROUP, REDUCER, 0, digest, bad)
    assert not signed_by("not-a-peer-id", GROUP, REDUCER, 0, digest, signature)


def test_the_digest_is_of_the_meta_as_json_carries_it() -> None:
    """Both ends hash the same bytes: a NaN in a meta goes as null, a tuple as a list."""
    assert contribution_digest(GROUP, 0, 0, {"lo": float("nan"), "s": (1, 2)}, b"x") == \
        contribution_digest(GROUP, 0, 0, {"s": [1, 2], "lo": None}, b"x")


def test_an_account_lists_only_what_each_sender_signed() -> None:
    entries, _, sent = account()
    check_signatures(entries, peers=PEERS, group_id=GROUP, reducer=REDUCER, chunk=0, me=0,
                     my_digest=sent[0][2])
    forged = [
        # a sender that sent nothing, listed without its signature
        [*entries[:1], dataclasses.replace(entries[1], digest="", signature=""), *entries[2:]],
        # another sender's signature
        [*entries[:1], dataclasses.replace(entries[1], signature=entries[2].signature), *entries[2:]],
        # a signed digest, with another digest named
        [*entries[:1], dataclasses.replace(entries[1], digest=entries[2].digest), *entries[2:]],
        # the reducer's own, without its commitment (audits.py)
        [*entries[:3], dataclasses.replace(entries[3], digest="")],
    ]
    for case in forged:
        with pytest.raises(WrongAverage, match=r"signature|commitment"):
            check_signatures(case, peers=PEERS, group_id=GROUP, reducer=REDUCER, chunk=0, me=0,
                             my_digest=sent[0][2])


def test_a_signature_of_another_chunk_is_no_signature_here() -> None:
    """The reducer lists the member's signed chunk of another slot (another chunk index of its
    part): every member finds the signature does not hold here, so the reducer cannot make the
    member accuse it of a chunk the member did not send there (and be judged a false accuser)."""
    entries, _, sent = account()
    other = contribution_digest(GROUP, REDUCER, 1, {}, b"my chunk 1")
    moved = dataclasses.replace(entries[0], digest=other.hex(),
                                signature=sign(IDS[0], GROUP, REDUCER, 1, other))
    for me in (0, 1):
        with pytest.raises(WrongAverage, match="signature") as caught:
            check_signatures([moved, *entries[1:]], peers=PEERS, group_id=GROUP, reducer=REDUCER,
                             chunk=0, me=me, my_digest=sent[me][2])
        assert not isinstance(caught.value, MisstatedContribution)
    # a second chunk the member did sign for this very slot (no honest member does): its own
    # check sees another digest than it sent
    twice = contribution_digest(GROUP, REDUCER, 0, {}, b"a second chunk 0")
    swapped = dataclasses.replace(entries[0], digest=twice.hex(),
                                  signature=sign(IDS[0], GROUP, REDUCER, 0, twice))
    with pytest.raises(MisstatedContribution):
        check_signatures([swapped, *entries[1:]], peers=PEERS, group_id=GROUP, reducer=REDUCER,
                         chunk=0, me=0, my_digest=sent[0][2])


@pytest.mark.parametrize("codec", ["none", "uint8", "topk"])
def test_a_misstated_entry_is_proven_by_its_sender_and_only_so(codec: str) -> None:
    entries, applied, sent = account(codec)
    payload, meta, _ = sent[1]

    def verdict(applied: Applied, payload: Any = payload, meta: Any = meta) -> str:
        return judge(applied, accuser=1, group_id=GROUP, reducer=REDUCER, chunk=0, meta=meta,
                     payload=payload, codec=get_codec(codec))[0]

    assert verdict(applied) == "unfounded"  # the account states it truly
    lying = [dataclasses.replace(e, projections=tuple(p + 1.0 for p in e.projections))
             if e.sender == 1 else e for e in entries]
    assert verdict(dataclasses.replace(applied, entries=tuple(lying))) == "forged"
    norm = [dataclasses.replace(e, norm=e.norm * 0.5) if e.sender == 1 else e for e in entries]
    assert verdict(dataclasses.replace(applied, entries=tuple(norm))) == "forged"
    # the accuser shows another chunk than the one it signed: its accusation is false
    other, other_meta, _ = chunk(9, codec)
    assert verdict(applied, other, other_meta) == "false"
    assert verdict(dataclasses.replace(applied, entries=tuple(lying)), other, other_meta) == "false"
    # an account that does not list the accuser proves nothing
    assert verdict(dataclasses.replace(applied, entries=tuple(e for e in entries if e.sender != 1))) \
        == "unfounded"


class _Transport:
    peer_id = PEERS[0]

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_unary_handler(self, method: str, handler: Any) -> None:
        self.handlers[method] = handler


def _group() -> Group:
    members = tuple(Member(peer, "trainer", 1.0, 1e6, 1e6) for peer in PEERS)
    bounds = tuple((2 * k * N, 2 * (k + 1) * N) for k in range(4))  # two chunks each
    return Group(GROUP, "key", members, 8 * N, bounds, N, "none", time.time() + 30, "mean")


async def test_the_handler_judges_once_per_chunk_and_bounds_what_a_stranger_costs() -> None:
    """Member 0 applied reducer 3's chunk 0; member 1 accuses. A forged entry bans the reducer;
    the same accusation again, a malformed one, one from outside the round, one for a round
    this member was not in, or a payload larger than the chunk can be are refused."""
    counters: collections.Counter[str] = collections.Counter()
    bans = BanList(counters=counters)
    transport = _Transport()
    accusations = Accusations(transport, bans, counters)  # type: ignore[arg-type]
    entries, applied, sent = account()
    lying = tuple(dataclasses.replace(e, projections=tuple(-p for p in e.projections))
                  if e.sender == 1 else e for e in entries)
    over = asyncio.Event()
    over.set()
    accusations.remember(_group(), 0, {(REDUCER, 0): dataclasses.replace(applied, entries=lying)},
                         over)
    handle = transport.handlers["avg.accuse"]
    payload, meta, _ = sent[1]

    def accusation(**header: Any) -> Message:
        return Message({"g": GROUP, "r": REDUCER, "c": 0, "m": meta, **header}, payload)

    answer = await handle(RequestContext(PEERS[1]), accusation())
    assert answer.header["verdict"] == "forged"
    assert bans.banned(PEERS[REDUCER]) is not None and counters["forged_accounts"] == 1
    for peer, message in [(PEERS[1], accusation()),  # heard already
                          (PEERS[1], accusation(r="3")), (PEERS[1], accusation(c=-1)),
                          (PEERS[2], accusation(g="another-round")),
                          (IDS[0].generate().peer_id, accusation()),  # not a member
                          (PEERS[2], accusation(r=0)),  # against this member itself
                          (PEERS[2], accusation(c=2)),  # no such chunk
                          (PEERS[2], Message(accusation().header, bytes(4 * N + 1)))]:
        with pytest.raises(PeerFault):
            await handle(RequestContext(peer), message)
    assert counters["forged_accounts"] == 1
    assert counters["accusations_refused"] + counters["accusations_malformed"] == 8
    # an accusation for an answer this member did not apply proves nothing here
    unheard = await handle(RequestContext(PEERS[2]), accusation(c=1))
    assert unheard.header["verdict"] == "unfounded"
