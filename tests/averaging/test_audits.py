"""Audits of a reducer's own contribution (audits.py), pure and in milliseconds: an honest
reducer's segment passes; one whose account misstates its own projection or norm, or that shows
another segment than it committed to, fails; the commitment fixes the signs, so a reducer cannot
pick its contribution after them; the reducer's service answers members of the round only, once
per member and round."""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import time
from typing import Any

import numpy as np
import pytest
from averaging.fake_transport import HandlerTransport

from dedloc.daemon.averaging.accounts import Entry, answer_digest, measure, segments, signs_of
from dedloc.daemon.averaging.audits import Applied, Own, OwnAudits, audit_failure, commitment, root_of
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.group import Group, Member
from dedloc.daemon.averaging.wire import PeerFault
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import Message, RequestContext

N = 4000
GROUP = "group-b"
REDUCER = 2
PEERS = [Identity.from_seed(bytes([i + 10]) * 32).peer_id for i in range(3)]


def own_entry(values: np.ndarray) -> tuple[Entry, Applied, Own]:
    """The reducer's own entry for chunk 0 as an honest reducer states it, and what a member
    applied (the answer's digest over the account's digests)."""
    parts = segments(N, 3)
    root, own = commitment(GROUP, REDUCER, 0, values, parts)
    answer = answer_digest(GROUP, REDUCER, 0, {}, b"answer", ["aa" * 32, "bb" * 32, root])
    entry = Entry(REDUCER, 1.0, *measure(signs_of(answer, N), values, parts), root)
    return entry, Applied((entry,), answer, tuple(parts)), own


def failure(entry: Entry, applied: Applied, own: Own, segment: int, values: np.ndarray,
            digests: Any = None, norms: Any = None) -> Any:
    return audit_failure(entry, applied, group_id=GROUP, reducer=REDUCER, chunk=0,
                         segment=segment, digests=own.digests if digests is None else digests,
                         norms=own.norms if norms is None else norms, values=values)


def test_an_honest_reducer_passes_every_segment() -> None:
    values = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    entry, applied, own = own_entry(values)
    for k, (a, b) in enumerate(applied.parts):
        assert failure(entry, applied, own, k, values[a:b]) is None


def test_a_misstated_own_entry_or_another_segment_fails() -> None:
    values = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    entry, applied, own = own_entry(values)
    a, b = applied.parts[1]
    moved = dataclasses.replace(entry, projections=(entry.projections[0], entry.projections[1] + 1e-3,
                                                    *entry.projections[2:]))
    assert "projection" in failure(moved, applied, own, 1, values[a:b])
    # a norm stated under the contribution's (to escape the norm-clipped mean's scale), or
    # over it (to widen the answer's checks): whichever segment is audited, it is not the norm
    # the committed segments make (before, a chunk norm 10 % under its own passed the audit of
    # any segment whose norm was within it, and any norm over passed every audit)
    for scale in (0.9, 1.1, 1e30):
        stated = dataclasses.replace(entry, norm=entry.norm * scale)
        for k, (s, e) in enumerate(applied.parts):
            assert "segments make" in failure(stated, applied, own, k, values[s:e])
    # ... and committed segment norms that make the stated one but are not the segments': the
    # commitment is another (the signs follow it), and the norm of the audited segment is not it
    norms = list(own.norms)
    norms[0], norms[1] = norms[1], norms[0]
    assert "commitment" in failure(entry, applied, own, 1, values[a:b], norms=norms)
    # a false projection with an inflated norm: still false
    inflated = dataclasses.replace(moved, norm=1e30)
    assert "projection" in failure(inflated, applied, own, 1, values[a:b])
    other = values[a:b] + np.float32(1e-3)
    assert "not the one" in failure(entry, applied, own, 1, other)
    forged_digests = list(own.digests)
    forged_digests[1] = bytes(32)
    assert "commitment" in failure(entry, applied, own, 1, values[a:b], digests=forged_digests)
    assert "commitment" in failure(entry, applied, own, 1, values[a:b], digests=own.digests[:-1])
    assert "commitment" in failure(entry, applied, own, 1, values[a:b], norms=own.norms[:-1])


def test_a_committed_segment_norm_that_is_not_the_segments_fails_when_that_segment_is_audited(
        ) -> None:
    """A reducer that commits to a false norm for one segment (and states the chunk's norm they
    make) passes the audits of the other segments and fails that one's."""
    values = np.random.default_rng(4).standard_normal(N).astype(np.float32)
    parts = segments(N, 3)
    _, honest = commitment(GROUP, REDUCER, 0, values, parts)
    norms = (honest.norms[0] * 0.5, *honest.norms[1:])
    root = root_of(GROUP, REDUCER, 0, honest.digests, norms)
    answer = answer_digest(GROUP, REDUCER, 0, {}, b"answer", ["aa" * 32, "bb" * 32, root])
    projections, _ = measure(signs_of(answer, N), values, parts)
    entry = Entry(REDUCER, 1.0, projections, math.sqrt(sum(k * k for k in norms)), root)
    applied = Applied((entry,), answer, tuple(parts))
    lying = Own(values, honest.digests, norms)
    results = [failure(entry, applied, lying, k, values[a:b]) for k, (a, b) in enumerate(parts)]
    assert "not the" in results[0] and results[1:] == [None] * (len(parts) - 1)


@pytest.mark.parametrize("committed", [1e200, 1.3e154, float("inf"), -1.0])
def test_a_committed_segment_norm_no_contribution_has_fails_whichever_segment_is_audited(
        committed: float) -> None:
    """One segment committed to a norm of 1e200 made the chunk's norm inf, next to which any
    stated norm passed the audits of the other segments (two of 1.3e154 overflowed the sum and
    ended the audit with no verdict)."""
    values = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    parts = segments(N, 3)
    _, honest = commitment(GROUP, REDUCER, 0, values, parts)
    norms = (committed, committed, *honest.norms[2:])
    root = root_of(GROUP, REDUCER, 0, honest.digests, norms)
    answer = answer_digest(GROUP, REDUCER, 0, {}, b"answer", ["aa" * 32, "bb" * 32, root])
    projections, norm = measure(signs_of(answer, N), values, parts)
    entry = Entry(REDUCER, 1.0, projections, norm * 1e-6, root)
    applied = Applied((entry,), answer, tuple(parts))
    lying = Own(values, honest.digests, norms)
    for k, (a, b) in enumerate(parts):
        assert "no float32 contribution has" in failure(entry, applied, lying, k, values[a:b])


def test_the_signs_follow_the_commitment() -> None:
    """A reducer that changes its own contribution after seeing the signs changes its
    commitment, and with it the signs: its entry cannot be aimed at them."""
    values = np.random.default_rng(2).standard_normal(N).astype(np.float32)
    parts = segments(N, 3)
    first = commitment(GROUP, REDUCER, 0, values, parts)[0]
    changed = values.copy()
    changed[7] += 1.0
    second = commitment(GROUP, REDUCER, 0, changed, parts)[0]
    assert first != second
    assert not np.array_equal(signs_of(answer_digest(GROUP, REDUCER, 0, {}, b"y", [first]), N),
                              signs_of(answer_digest(GROUP, REDUCER, 0, {}, b"y", [second]), N))




async def test_the_reducer_answers_members_once_per_round() -> None:
    counters: collections.Counter[str] = collections.Counter()
    transport = HandlerTransport(PEERS[REDUCER])
    audits = OwnAudits(transport, BanList(counters=counters), counters,  # type: ignore[arg-type]
                       random.Random(0))
    members = tuple(Member(p, "trainer", 1.0, 1e6, 1e6) for p in PEERS)
    members = (*members, Member(Identity.from_seed(bytes(32)).peer_id, "aux", 0.0, 1e6, 1e6))
    group = Group(GROUP, "key", members, 3 * N, ((0, N), (N, 2 * N), (2 * N, 3 * N), (3 * N, 3 * N)),
                  N, "none", time.time() + 30, "mean")
    values = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    parts = segments(N, 3)
    own = commitment(GROUP, REDUCER, 0, values, parts)[1]
    audits.keep(group, {0: own})
    serve = transport.handlers["avg.audit"]
    reply = await serve(RequestContext(PEERS[0]), Message({"g": GROUP, "c": 0, "k": 1}))
    assert reply.header["d"] == [d.hex() for d in own.digests]
    assert reply.header["n"] == list(own.norms)
    a, b = parts[1]
    assert bytes(reply.payload) == values[a:b].tobytes()
    for peer, header in [(PEERS[0], {"g": GROUP, "c": 0, "k": 2}),  # once per round
                         (PEERS[1], {"g": GROUP, "c": 1, "k": 0}),  # no such chunk
                         (PEERS[1], {"g": GROUP, "c": 0, "k": len(parts)}),  # no such segment
                         (PEERS[1], {"g": GROUP, "c": 0, "k": True}),
                         (PEERS[1], {"g": "another", "c": 0, "k": 0}),
                         (members[3].peer_id, {"g": GROUP, "c": 0, "k": 0}),  # sent nothing
                         (Identity.from_seed(bytes([99]) * 32).peer_id, {"g": GROUP, "c": 0, "k": 0})]:
        with pytest.raises(PeerFault):
            await serve(RequestContext(peer), Message(header))
    assert counters["audits_served"] == 1 and counters["audits_refused"] == 7
    assert (await serve(RequestContext(PEERS[1]), Message({"g": GROUP, "c": 0, "k": 0}))).payload
