"""The butterfly all-reduce over real TlsTransports on 127.0.0.1 (one process, one transport per
member): exact weighted averages, aux and client members, codecs, senders and reducers that die,
hostile chunks, silent members and the deadline, and nothing left behind afterwards.

The links use 1 KiB frames and a 16 KiB stream window, so every chunk spans several frames and
flow control works throughout."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pytest
from net.netutil import wait_until

from dedloc.daemon.averaging import butterfly, signatures
from dedloc.daemon.averaging.aggregation import NORM_CLIP_FACTOR, Aggregation
from dedloc.daemon.averaging.allreduce import AllReduceError, AllReduceReport, AllReduceService
from dedloc.daemon.averaging.compression import get_codec, reply_codec
from dedloc.daemon.averaging.error_feedback import unconveyed
from dedloc.daemon.averaging.group import Group, Member, Role
from dedloc.daemon.averaging.screening import ScreeningPolicy
from dedloc.daemon.averaging.signatures import (
    LEADER_SIGNATURE_KEY,
    ROUND_KEY,
    SIGNATURE_KEY,
    contribution_digest,
    round_name,
    sign,
    sign_group,
)
from dedloc.daemon.averaging.wire import METHOD, StreamOpen
from dedloc.daemon.identity import Identity
from dedloc.daemon.net import (
    LinkLimits,
    Message,
    PeerAddress,
    RequestContext,
    Stream,
    StreamAborted,
    TlsTransport,
    TransportError,
    TransportLimits,
    frames,
)

LOOPBACK = PeerAddress.parse("/ip4/127.0.0.1/tcp/0")
LIMITS = TransportLimits(handshake_timeout=2.0,
                         link=LinkLimits(chunk_bytes=1024, stream_window=16 * 1024, ping_interval=2.0))
CHUNK = 1000
_ids = itertools.count()


@dataclass
class Cluster:
    transports: list[TlsTransport]
    services: list[AllReduceService] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        return [t.peer_id for t in self.transports]


async def start_cluster(count: int) -> Cluster:
    transports = [await TlsTransport.start(Identity.generate(), [LOOPBACK], limits=LIMITS)
                  for _ in range(count)]
    for a, b in itertools.combinations(transports, 2):
        a.learn_addresses(b.peer_id, b.listen_addresses())
        b.learn_addresses(a.peer_id, a.listen_addresses())
        await a.connect(b.listen_addresses()[0], timeout=5)
    # the accepting sides finish their handshakes too
    await wait_until(lambda: all(len(t.links()) == count - 1 for t in transports))
    return Cluster(transports)


@pytest.fixture
async def clusters() -> AsyncIterator[Callable[..., Any]]:
    made: list[Cluster] = []

    async def make(count: int, *, services: Sequence[int] | None = None, **options: Any) -> Cluster:
        cluster = await start_cluster(count)
        made.append(cluster)
        for index in range(count) if services is None else services:
            cluster.services.append(AllReduceService(cluster.transports[index], **options))
        return cluster

    yield make
    for cluster in made:
        for service in cluster.services:
            service.close()
        for transport in cluster.transports:
            await transport.close()


def make_group(ids: Sequence[str], *, roles: Sequence[Role] | None = None,
               weights: Sequence[float] | None = None, size: int = 10_007,
               bounds: Sequence[tuple[int, int]] | None = None, compression: str = "none",
               seconds: float = 20.0, chunk: int = CHUNK, aggregation: Aggregation = "mean") -> Group:
    roles = list(roles or ["trainer"] * len(ids))
    weights = list(weights or [1.0] * len(ids))
    members = tuple(Member(peer, role, 0.0 if role == "aux" else weight, 1e6, 1e6)
                    for peer, role, weight in zip(ids, roles, weights, strict=True))
    if bounds is None:
        reducers = [i for i, m in enumerate(members) if m.can_reduce]
        chunks = -(-size // chunk)
        cuts = np.linspace(0, chunks, len(reducers) + 1).round().astype(int) * chunk
        cuts[-1] = size
        spans = dict(zip(reducers, itertools.pairwise(cuts), strict=True))
        position, built = 0, []
        for i in range(len(members)):
            end = int(spans[i][1]) if i in spans else position
            built.append((position, end))
            position = end
        bounds = built
    return Group(f"group-{next(_ids)}", "key", members, size, tuple(bounds), chunk, compression,
                 time.time() + seconds, aggregation)


def vectors(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * (i + 1) + i).astype(np.float32) for i in range(count)]


def weighted(vectors_: Sequence[np.ndarray], weights: Sequence[float], members: Sequence[int]) -> np.ndarray:
    total = sum(weights[i] for i in members)
    return (sum(weights[i] * vectors_[i].astype(np.float64) for i in members) / total).astype(np.float32)


async def run_all(cluster: Cluster, group: Group, vecs: list[np.ndarray], weights: Sequence[float],
                  members: Sequence[int] | None = None) -> list[AllReduceReport]:
    members = range(len(group.members)) if members is None else members
    return list(await asyncio.gather(*(cluster.services[i].run(group, i, vecs[i], weights[i])
                                       for i in members)))


def chunk_ranges(group: Group) -> list[tuple[int, tuple[int, int]]]:
    """(reducer, element range) of every chunk of the group."""
    found = []
    for j, (a, b) in enumerate(group.part_bounds):
        for start in range(a, b, group.chunk_elements):
            found.append((j, (start, min(start + group.chunk_elements, b))))
    return found


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.allclose(a, b, rtol=1e-5, atol=1e-5))


# --- averages ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("count", "inline"), [(2, 1 << 15), (3, 0), (5, 1 << 15)])
async def test_weighted_average_is_exact(clusters: Any, count: int, inline: int) -> None:
    cluster = await clusters(count, inline_elements=inline)
    weights = [1.0, 2.5, 0.25, 7.0, 1.1][:count]
    size = 10_007 if count != 2 else 4_321
    # uneven parts: member 0 gets one chunk, the last one the rest
    chunks = -(-size // CHUNK)
    cuts = [0, CHUNK] + [min(size, CHUNK * (1 + (chunks - 1) * k // (count - 1))) for k in range(1, count)]
    group = make_group(cluster.ids, weights=weights, size=size,
                       bounds=list(itertools.pairwise(cuts)))
    vecs = vectors(count, size)
    expected = weighted(vecs, weights, range(count))
    reports = await run_all(cluster, group, vecs, weights)
    for vector, report in zip(vecs, reports, strict=True):
        assert report.ok and report.parts_reduced == ((0, size),) and not report.senders_excluded
        assert report.bytes_sent > 0 and report.bytes_received > 0
        assert np.allclose(vector, expected, rtol=1e-6, atol=1e-6)
        assert np.array_equal(vector, vecs[0])
    for index, report in enumerate(reports):
        assert set(report.transfers) == set(cluster.ids) - {cluster.ids[index]}


async def test_aux_member_reduces_without_sending(clusters: Any) -> None:
    cluster = await clusters(3)
    weights = [2.0, 1.0, 0.0]
    group = make_group(cluster.ids, roles=["trainer", "trainer", "aux"], weights=weights)
    vecs = vectors(3, group.size)
    aux_before = vecs[2].copy()
    expected = weighted(vecs, weights, [0, 1])
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok for r in reports)
    a, b = group.part_bounds[2]
    assert b > a
    for vector in vecs[:2]:
        assert close(vector, expected) and np.array_equal(vector, vecs[0])
    assert np.array_equal(vecs[2][a:b], vecs[0][a:b])  # aux holds its averaged part
    assert np.array_equal(vecs[2][:a], aux_before[:a])
    assert reports[2].parts_reduced == ((a, b),) and reports[2].bytes_received > 0
    # the aux only took chunks of its part and sent their averages back (same size, no codec)
    assert all(t.bytes_received == t.bytes_sent == 4 * (b - a) for t in reports[2].transfers.values())


async def test_client_member_sends_but_reduces_nothing(clusters: Any) -> None:
    cluster = await clusters(3)
    weights = [1.0, 1.0, 3.0]
    group = make_group(cluster.ids, roles=["trainer", "trainer", "client"], weights=weights)
    assert group.part_bounds[2][0] == group.part_bounds[2][1]
    vecs = vectors(3, group.size)
    expected = weighted(vecs, weights, [0, 1, 2])
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok for r in reports)
    for vector in vecs:
        assert close(vector, expected) and np.array_equal(vector, vecs[0])
    assert not reports[2].senders_excluded


@pytest.mark.parametrize("compression", ["fp16", "uint8", "quantile8"])
async def test_compressed_average_within_codec_bounds(clusters: Any, compression: str) -> None:
    cluster = await clusters(3, inline_elements=0)
    weights = [1.0, 3.0, 0.5]
    group = make_group(cluster.ids, weights=weights, compression=compression)
    vecs = vectors(3, group.size, seed=5)
    originals = [v.copy() for v in vecs]
    codec = get_codec(compression)
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok for r in reports)
    for j, (a, b) in chunk_ranges(group):
        # what reducer j averages: its own chunk exact, the others' as decoded from the wire
        seen = []
        for i, x in enumerate(originals):
            chunk = x[a:b]
            seen.append(chunk if i == j else codec.decode(*codec.encode(chunk), b - a))
        average = weighted(seen, weights, range(3))
        exact = weighted([x[a:b] for x in originals], weights, range(3))
        slack = 1e-5 * float(np.abs(average).max())
        assert np.abs(vecs[0][a:b] - average).max() <= codec.error_bound(average) * 1.001 + slack
        sender_error = sum(w * codec.error_bound(x[a:b]) for w, x in zip(weights, originals, strict=True))
        assert np.abs(vecs[0][a:b] - exact).max() <= (sender_error / sum(weights)
                                                      + codec.error_bound(average) * 1.001 + slack)
    for vector in vecs:
        assert np.array_equal(vector, vecs[0])


@pytest.mark.parametrize(("count", "size", "chunk"), [(3, 10_007, CHUNK), (4, 10_007, CHUNK),
                                                     (4, 300_001, 70_000)])
async def test_topk_round_gives_everyone_the_mean_of_the_decoded_contributions(
        clusters: Any, count: int, size: int, chunk: int) -> None:
    """Every contribution (the reducer's own too) is what topk conveys of it; the average goes
    back in sparse16 with all its nonzeros (re-encoding it in topk would drop most of them)."""
    cluster = await clusters(count, inline_elements=0)
    weights = [1.0, 3.0, 0.5, 2.0][:count]
    group = make_group(cluster.ids, weights=weights, compression="topk", size=size, chunk=chunk)
    vecs = vectors(count, group.size, seed=11)
    originals = [v.copy() for v in vecs]
    codec, reply = get_codec("topk"), reply_codec(get_codec("topk"))
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok for r in reports)
    for vector in vecs:
        assert np.array_equal(vector, vecs[0])
    for _, (a, b) in chunk_ranges(group):
        seen = [codec.decode(*codec.encode(x[a:b]), b - a) for x in originals]
        average = weighted(seen, weights, range(count))
        got = vecs[0][a:b]
        slack = 1e-6 * float(np.abs(average).max())
        assert np.abs(got - average).max() <= reply.error_bound(average) * 1.001 + slack
        assert np.array_equal(got != 0, average != 0)  # every nonzero of the average came back
        assert np.count_nonzero(got) > codec.budget(b - a)  # type: ignore[attr-defined]
    # what goes to reducer j: topk chunks of part j (~2.5 bytes per 64 values); what goes back
    # from reducer i: the sparse16 averages of part i (4 bytes per nonzero, or 2 per value dense)
    def payload_bytes(coder: Any, vector: np.ndarray, part: tuple[int, int]) -> int:
        return sum(len(coder.encode(vector[a:b])[0]) for a, b in chunk_ranges_of(part, chunk))

    for i, report in enumerate(reports):
        for j, peer in enumerate(cluster.ids):
            if j != i:
                expected = (payload_bytes(codec, originals[i], group.part_bounds[j])
                            + payload_bytes(reply, vecs[0], group.part_bounds[i]))
                assert report.transfers[peer].bytes_sent == expected
        upload = sum(payload_bytes(codec, originals[i], group.part_bounds[j]) for j in range(count) if j != i)
        assert upload <= 0.04 * size


def chunk_ranges_of(part: tuple[int, int], chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, part[1])) for a in range(part[0], part[1], chunk)]


# --- faults -----------------------------------------------------------------------------------------
class Tripwire:
    """Wraps a member's transport: after `after` messages sent on its opened (or served) streams,
    it closes the real transport, as if the process died there."""

    def __init__(self, inner: TlsTransport, after: int, side: str) -> None:
        self.inner, self.after, self.side = inner, after, side
        self.sent = 0
        self.killer: asyncio.Task[None] | None = None

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def add_stream_handler(self, method: str, handler: Any) -> None:
        async def wrapped(ctx: RequestContext, stream: Stream) -> None:
            await handler(ctx, _Counted(stream, self) if self.side == "served" else stream)
        self.inner.add_stream_handler(method, wrapped)

    async def open_stream(self, peer_id: str, method: str, header: dict[str, Any], *,
                          timeout: float) -> Stream:
        stream = await self.inner.open_stream(peer_id, method, header, timeout=timeout)
        return _Counted(stream, self) if self.side == "opened" else stream

    def count(self) -> None:
        self.sent += 1
        if self.sent == self.after:
            self.killer = asyncio.get_running_loop().create_task(self.inner.close())


class _Counted:
    def __init__(self, stream: Stream, trip: Tripwire) -> None:
        self._stream, self._trip = stream, trip
        self.header = stream.header

    async def send(self, message: Message, *, timeout: float) -> None:
        await self._stream.send(message, timeout=timeout)
        self._trip.count()

    async def receive(self, *, timeout: float) -> Message | None:
        return await self._stream.receive(timeout=timeout)

    async def receive_into(self, buffer: Any, *, timeout: float) -> Message | None:
        return await self._stream.receive_into(buffer, timeout=timeout)

    async def close(self) -> None:
        await self._stream.close()

    async def abort(self, reason: str) -> None:
        await self._stream.abort(reason)


async def test_sender_that_dies_is_left_out(clusters: Any) -> None:
    cluster = await clusters(4, services=[0, 1, 2])
    trip = Tripwire(cluster.transports[3], after=4, side="opened")
    cluster.services.append(AllReduceService(trip))  # type: ignore[arg-type]
    weights = [1.0, 2.0, 1.5, 4.0]
    group = make_group(cluster.ids, roles=["trainer", "trainer", "trainer", "client"], weights=weights,
                       size=30_000)
    vecs = vectors(4, group.size)
    with_all, without = weighted(vecs, weights, range(4)), weighted(vecs, weights, range(3))
    reports = await run_all(cluster, group, vecs, weights)
    assert trip.killer is not None
    await trip.killer
    dead = cluster.ids[3]
    assert not reports[3].ok  # the dead one kept what it had: no error raised
    for report in reports[:3]:
        assert report.ok, report.failures
        assert dead in report.senders_excluded
    left_out = 0
    for _, (a, b) in chunk_ranges(group):
        assert np.array_equal(vecs[0][a:b], vecs[1][a:b]) and np.array_equal(vecs[0][a:b], vecs[2][a:b])
        if close(vecs[0][a:b], without[a:b]):
            left_out += 1
        else:
            assert close(vecs[0][a:b], with_all[a:b])
    assert left_out >= 3  # at least the last chunk of every part came after its death
    for j, (a, b) in enumerate(group.part_bounds[:3]):
        last = max(a, b - CHUNK)
        assert close(vecs[j][last:b], without[last:b])


async def test_reducer_that_dies_leaves_its_part_local(clusters: Any) -> None:
    cluster = await clusters(4, services=[0, 1, 2])
    trip = Tripwire(cluster.transports[3], after=3, side="served")
    cluster.services.append(AllReduceService(trip))  # type: ignore[arg-type]
    weights = [1.0, 2.0, 1.5, 4.0]
    group = make_group(cluster.ids, weights=weights, size=40_000)
    vecs = vectors(4, group.size)
    originals = [v.copy() for v in vecs]
    with_all, without = weighted(vecs, weights, range(4)), weighted(vecs, weights, range(3))
    reports = await run_all(cluster, group, vecs, weights)
    assert trip.killer is not None
    await trip.killer
    dead = cluster.ids[3]
    a3, b3 = group.part_bounds[3]
    for i, report in enumerate(reports[:3]):
        assert report.failures and {f.reducer for f in report.failures} == {dead}
        # exactly the chunks that kept the local value are reported failed
        kept = [(a, b) for j, (a, b) in chunk_ranges(group) if j == 3
                and np.array_equal(vecs[i][a:b], originals[i][a:b])]
        failed = [(a, b) for f in report.failures for a, b in _chunks_of(f.start, f.end, group)]
        assert kept == failed and kept and kept[-1][1] == b3
        for j, (a, b) in chunk_ranges(group):
            if j == 3 and (a, b) not in kept:
                assert close(vecs[i][a:b], with_all[a:b])
    for j, (a, b) in chunk_ranges(group):
        if j != 3:  # the other parts: reduced, identical, with or without the dead one's values
            assert np.array_equal(vecs[0][a:b], vecs[1][a:b]) and np.array_equal(vecs[0][a:b], vecs[2][a:b])
            assert close(vecs[0][a:b], with_all[a:b]) or close(vecs[0][a:b], without[a:b])
    assert all(r.parts_reduced[0][0] == 0 for r in reports[:3])
    assert all((a3, b3) != r.parts_reduced[-1] for r in reports[:3])


def _chunks_of(start: int, end: int, group: Group) -> list[tuple[int, int]]:
    return [(a, b) for _, (a, b) in chunk_ranges(group) if start <= a and b <= end]


async def hostile_sender(transport: TlsTransport, group: Group, index: int, vector: np.ndarray,
                         mode: str, leader: Identity | None = None) -> None:
    """Speaks the wire protocol by hand: chunk 0 good, chunk 1 bad (as `mode` says), each
    signed as it goes (signatures.py)."""

    def signed(j: int, header: dict[str, Any], payload: bytes) -> Message:
        digest = contribution_digest(group.group_id, j, header["c"], {}, payload)
        signature = sign(transport.identity, round_name(group), j, header["c"], digest)
        return Message({**header, SIGNATURE_KEY: signature,
                        ROUND_KEY: round_name(group)}, payload)

    async def one(j: int) -> None:
        a = group.part_bounds[j][0]
        opened = StreamOpen(group.group_id, index, group.members[index].weight, group.deadline,
                            round_name(group), group.leader_signature)
        if mode == "framed_at_open":  # the same forged proof, when it opens its stream
            opened = dataclasses.replace(opened, round_name="1" * 64, leader_signature=sign_group(
                transport.identity, group.group_id, "1" * 64))
        stream = await transport.open_stream(group.members[j].peer_id, METHOD, opened.header(), timeout=5)
        try:
            await stream.send(signed(j, {"c": 0}, vector[a:a + CHUNK].tobytes()), timeout=5)
        except StreamAborted:  # (refused at its opening)
            return
        bad = vector[a + CHUNK:a + 2 * CHUNK].copy()
        header: dict[str, Any] = {"c": 1}
        if mode == "nan":
            bad[10] = np.nan
        elif mode == "short":
            bad = bad[:-3]
        elif mode == "unknown":
            header = {"c": 999}
        elif mode == "duplicate":
            header = {"c": 0}
        message = signed(j, header, bad.tobytes())
        if mode == "untagged":  # signed, with no round named: a sender of an older dedloc
            message = Message({k: v for k, v in message.header.items() if k != ROUND_KEY},
                              message.payload)
        elif mode == "other_group":  # the round of another group under this id
            message = Message({**message.header, ROUND_KEY: "0" * 64}, message.payload)
        elif mode in ("framed_leader", "replayed_leader"):
            # another round, with a "proof" that the leader signed it too: one the sender made
            # itself, or the leader's real signature of that name under another group id
            # (a round of the leader's that the sender was in): neither bans the leader
            forged = (sign_group(transport.identity, group.group_id, "1" * 64)
                      if mode == "framed_leader" else sign_group(leader, "another-id", "1" * 64))
            message = Message({**message.header, ROUND_KEY: "1" * 64,
                               LEADER_SIGNATURE_KEY: forged}, message.payload)
        if mode == "deep_meta":  # a meta JSON carries but cannot write back (300 levels deep)
            deep = {"x": json.loads("[" * 300 + "]" * 300)}
            message = Message({**message.header, "m": deep}, message.payload)
        await stream.send(message, timeout=5)
        try:
            while await stream.receive(timeout=10) is not None:
                pass
        except StreamAborted:
            pass

    await asyncio.gather(*(one(j) for j in range(3)))


class _PermissiveJson:
    """orjson, but writing what it cannot (a header nested past 255 levels) with json."""

    JSONDecodeError = orjson.JSONDecodeError
    loads = staticmethod(orjson.loads)

    @staticmethod
    def dumps(value: Any, *args: Any, **kwargs: Any) -> bytes:
        try:
            return orjson.dumps(value, *args, **kwargs)
        except TypeError:
            return json.dumps(value, separators=(",", ":")).encode()


@pytest.mark.parametrize(("mode", "reason"), [("nan", "NaN"), ("short", "payload of 3988 bytes"),
                                              ("unknown", "unknown chunk index 999"),
                                              ("duplicate", "duplicate chunk 0"),
                                              ("deep_meta", "cannot be hashed"),
                                              ("untagged", "another than ours"),
                                              ("other_group", "another than ours"),
                                              ("framed_leader", "another than ours"),
                                              ("replayed_leader", "another than ours"),
                                              ("framed_at_open", "another than ours")])
async def test_bad_chunk_excludes_its_sender(clusters: Any, mode: str, reason: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that breaks the protocol is an offence; one signed for another round than the
    reducer's group (its leader told its sender another group), or naming none (a sender of an
    older dedloc), leaves its sender out as if it had stalled: not an offence (it may not be the
    one that lied). A forged proof that the leader signed the other group bans nobody."""
    if mode == "deep_meta":  # the hostile peer writes its own frames: a header orjson cannot
        monkeypatch.setattr(frames, "orjson", _PermissiveJson)  # write (it reads 300 levels)
    cluster = await clusters(4, services=[0, 1, 2])
    weights = [1.0, 2.0, 1.5, 4.0]
    group = signed_by_leader(
        make_group(cluster.ids, roles=["trainer", "trainer", "trainer", "client"], weights=weights),
        cluster.transports[0].identity)
    vecs = vectors(4, group.size)
    with_all, without = weighted(vecs, weights, range(4)), weighted(vecs, weights, range(3))
    reports, _ = await asyncio.gather(run_all(cluster, group, vecs, weights, members=[0, 1, 2]),
                                      hostile_sender(cluster.transports[3], group, 3, vecs[3], mode,
                                                     cluster.transports[0].identity))
    hostile = cluster.ids[3]
    for report in reports:
        assert report.ok
        assert reason in report.senders_excluded[hostile]
    for j, (a, b) in chunk_ranges(group):
        # chunk 0 of each part came intact: it counts if it was averaged before chunk 1 came bad,
        # else the reducer (which keeps contributions until a chunk settles) leaves it out too
        first = a == group.part_bounds[j][0]
        assert np.array_equal(vecs[0][a:b], vecs[1][a:b]) and np.array_equal(vecs[0][a:b], vecs[2][a:b])
        assert close(vecs[0][a:b], without[a:b]) or (first and close(vecs[0][a:b], with_all[a:b]))
    assert sum(s.counters["senders_excluded"] for s in cluster.services) == 3
    mismatch = mode in ("untagged", "other_group", "framed_leader", "replayed_leader",
                        "framed_at_open")
    for service in cluster.services:
        assert service.bans.counters["offences"] == (0 if mismatch else 1)
        assert service.counters["group_mismatches"] == (1 if mismatch else 0)
        assert service.counters["leader_equivocations"] == 0


def signed_by_leader(group: Group, leader: Identity) -> Group:
    """`group` as the matchmaker hands it on: with its leader and the leader's signature."""
    return dataclasses.replace(group, leader=leader.peer_id, leader_signature=sign_group(
        leader, group.group_id, round_name(group)))


async def test_silent_member_deadline_and_nothing_left_behind(clusters: Any) -> None:
    cluster = await clusters(4, services=[0, 1, 2], stall_timeout=0.5)

    async def swallow(ctx: RequestContext, stream: Stream) -> None:
        """A member that takes chunks and never answers, nor sends its own."""
        try:
            while await stream.receive(timeout=30) is not None:
                pass
            # then hold the stream open until the sender aborts it
            await wait_until(lambda: stream.finished, timeout=30)  # type: ignore[attr-defined]
        except TransportError:
            pass

    cluster.transports[3].add_stream_handler(METHOD, swallow)
    await asyncio.sleep(0)
    baseline = len(asyncio.all_tasks())
    weights = [1.0, 2.0, 1.5, 1.0]
    group = make_group(cluster.ids, weights=weights, seconds=2.0)
    vecs = vectors(4, group.size)
    originals = [v.copy() for v in vecs]
    without = weighted(vecs, weights, range(3))
    reports = await run_all(cluster, group, vecs, weights, members=[0, 1, 2])
    assert time.time() < group.deadline + 1.0
    a3, b3 = group.part_bounds[3]
    silent = cluster.ids[3]
    for i, report in enumerate(reports):
        assert report.failed_parts == ((a3, b3),)
        assert report.failures[0].reducer == silent and "deadline" in report.failures[0].reason
        assert "no stream came" in report.senders_excluded[silent]
        assert np.array_equal(vecs[i][a3:b3], originals[i][a3:b3])
        assert close(vecs[i][:a3], without[:a3]) and np.array_equal(vecs[i][:a3], vecs[0][:a3])
    # nothing left: no tasks, no streams (the silent member's handlers end on the aborts)
    await wait_until(lambda: len(asyncio.all_tasks()) == baseline and not any(
        link.streams for t in cluster.transports for link in t.links()))
    for service in cluster.services:
        assert service.status()["active_rounds"] == []


async def test_round_that_starts_late_still_gets_its_streams(clusters: Any) -> None:
    cluster = await clusters(3)
    weights = [1.0, 1.0, 1.0]
    group = make_group(cluster.ids, weights=weights)
    vecs = vectors(3, group.size)
    expected = weighted(vecs, weights, range(3))

    async def late() -> AllReduceReport:
        await asyncio.sleep(0.3)
        return await cluster.services[2].run(group, 2, vecs[2], 1.0)

    reports = await asyncio.gather(cluster.services[0].run(group, 0, vecs[0], 1.0),
                                   cluster.services[1].run(group, 1, vecs[1], 1.0), late())
    assert all(r.ok for r in reports)
    assert all(close(v, expected) for v in vecs)


async def test_unknown_or_finished_groups_are_refused(clusters: Any) -> None:
    cluster = await clusters(2, arrival_grace=0.2)
    opened = StreamOpen("no-such-group", 0, 1.0, time.time() + 10)
    stream = await cluster.transports[0].open_stream(cluster.ids[1], METHOD, opened.header(), timeout=5)
    with pytest.raises(StreamAborted, match="no round of group no-such-group"):
        await stream.receive(timeout=5)
    group = make_group(cluster.ids, size=100)
    await run_all(cluster, group, vectors(2, 100), [1.0, 1.0])
    late = StreamOpen(group.group_id, 0, 1.0, group.deadline)
    stream = await cluster.transports[0].open_stream(cluster.ids[1], METHOD, late.header(), timeout=5)
    with pytest.raises(StreamAborted, match="is over here"):
        await stream.receive(timeout=5)
    stream = await cluster.transports[0].open_stream(cluster.ids[1], METHOD, {"g": 5}, timeout=5)
    with pytest.raises(StreamAborted, match="without a group id"):
        await stream.receive(timeout=5)
    assert cluster.services[1].counters["streams_refused"] == 3


async def test_misuse_raises(clusters: Any) -> None:
    cluster = await clusters(2)
    service = cluster.services[0]
    group = make_group(cluster.ids, size=100)
    good = np.zeros(100, np.float32)
    with pytest.raises(AllReduceError, match="has 99 elements"):
        await service.run(group, 0, np.zeros(99, np.float32), 1.0)
    with pytest.raises(AllReduceError, match="float32"):
        await service.run(group, 0, np.zeros(100, np.float64), 1.0)
    with pytest.raises(AllReduceError, match="not this peer"):
        await service.run(group, 1, good, 1.0)
    with pytest.raises(AllReduceError, match="weight"):
        await service.run(group, 0, good, 0.0)
    bad = good.copy()
    bad[50] = np.inf
    with pytest.raises(AllReduceError, match="NaN or Inf"):
        await service.run(group, 0, bad, 1.0)
    with pytest.raises(AllReduceError, match="unknown compression"):
        await service.run(make_group(cluster.ids, size=100, compression="zip"), 0, good, 1.0)


@pytest.mark.parametrize("compression", ["fp16", "uint8", "topk"])
async def test_what_a_round_did_not_convey_is_what_error_feedback_keeps(
        clusters: Any, compression: str) -> None:
    """`unconveyed` (error feedback: a local-update run's residual) cut as the round cut: every
    member's vector minus it is what the reducers averaged, so the average is the weighted mean
    of those, within the reply codec's bound."""
    cluster = await clusters(3, inline_elements=0)
    weights = [1.0, 3.0, 0.5]
    group = make_group(cluster.ids, weights=weights, compression=compression, size=30_011,
                       chunk=4096)
    vecs = vectors(3, group.size, seed=13)
    originals = [v.copy() for v in vecs]
    codec = get_codec(compression)
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok for r in reports)
    sent = [x - unconveyed(codec, x, group.part_bounds, group.chunk_elements, group.part_bounds[i])
            for i, x in enumerate(originals)]
    assert any(np.abs(x - s).max() > 0 for x, s in zip(originals, sent, strict=True))  # lossy
    average = weighted(sent, weights, range(3))
    reply = reply_codec(codec)
    for _, (a, b) in chunk_ranges(group):
        slack = 1e-5 * float(np.abs(average[a:b]).max())
        assert np.abs(vecs[0][a:b] - average[a:b]).max() <= reply.error_bound(average[a:b]) * 1.001 + slack
    # a vector sent to nobody was conveyed exactly
    assert not unconveyed(codec, originals[0], group.part_bounds, 0, (0, 0)).any()


# --- the norm-clipped mean (aggregation.py) --------------------------------------------------------
def gradients(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
    """Honest vectors alike in norm (gradients of one model over different batches)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(size)
    return [(base + 0.5 * rng.standard_normal(size)).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize(("scale", "norm_rule"), [(1e6, 0.0), (100.0, 1000.0)])
async def test_a_norm_clip_round_clips_an_outlier_to_four_times_the_median_norm(
        clusters: Any, scale: float, norm_rule: float) -> None:
    """Four honest senders and one whose vector is `scale` times an honest one, with a weight
    5 times theirs: every member ends with the same vector, which differs from the honest mean
    by at most the outlier's share of (tau + the honest mean's norm) in every chunk. 1e6 only
    passes the screening without its norm rule (1000 x the median); 100 passes it and is
    clipped, not rejected."""
    cluster = await clusters(5, policy=ScreeningPolicy(max_norm_ratio=norm_rule))
    weights = [1.0, 1.0, 1.0, 1.0, 5.0]
    group = make_group(cluster.ids, weights=weights, aggregation="norm_clip")
    vecs = gradients(5, group.size)
    vecs[4] = (vecs[4] * np.float32(scale)).astype(np.float32)
    original = [v.astype(np.float64) for v in vecs]
    honest_mean = np.mean(original[:4], axis=0)
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok and not r.senders_excluded for r in reports)
    for vector in vecs[1:]:
        assert np.array_equal(vector, vecs[0])
    share = weights[4] / sum(weights)
    chunks = chunk_ranges(group)
    for _, (a, b) in chunks:
        tau = NORM_CLIP_FACTOR * float(np.median([np.linalg.norm(v[a:b]) for v in original]))
        moved = float(np.linalg.norm(vecs[0][a:b] - honest_mean[a:b]))
        assert moved <= share * (tau + float(np.linalg.norm(honest_mean[a:b]))) * (1 + 1e-5)
        plain = (sum(w * v[a:b] for w, v in zip(weights, original, strict=True)) / sum(weights))
        assert float(np.linalg.norm(plain - honest_mean[a:b])) > 10 * moved
    # every reducer clipped the outlier once in each chunk it reduced, and nothing else
    assert sum(r.contributions_clipped for r in reports) == len(chunks)


async def test_an_honest_norm_clip_round_is_the_weighted_mean(clusters: Any) -> None:
    cluster = await clusters(4)
    weights = [1.0, 2.5, 0.25, 7.0]
    group = make_group(cluster.ids, weights=weights, aggregation="norm_clip")
    vecs = gradients(4, group.size)
    expected = weighted(vecs, weights, range(4))
    reports = await run_all(cluster, group, vecs, weights)
    assert all(r.ok and r.contributions_clipped == 0 for r in reports)
    for vector in vecs:
        assert np.allclose(vector, expected, rtol=1e-6, atol=1e-6)


async def test_a_reducer_that_skips_the_clipping_is_caught_and_banned(
        clusters: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reducer 1 averages by the plain mean (as a hostile or out-of-date reducer would) while
    the group says norm_clip: every other member refuses its answers (its part stays local
    there, `failed_parts`) and bans it at once; the other reducers' parts are averaged."""
    cluster = await clusters(5)
    weights = [1.0] * 5
    group = make_group(cluster.ids, weights=weights, aggregation="norm_clip")
    skipping = dataclasses.replace(group, aggregation="mean")
    # (it names the round as the group does: a reducer that says it holds another group is
    # set aside without blame, test_group_mismatch below)
    monkeypatch.setattr(butterfly, "round_name", lambda g: signatures.round_name(
        dataclasses.replace(g, aggregation="norm_clip")))
    vecs = gradients(5, group.size)
    vecs[4] = (vecs[4] * np.float32(100.0)).astype(np.float32)
    before = [v.copy() for v in vecs]
    reports = list(await asyncio.gather(*(
        cluster.services[i].run(skipping if i == 1 else group, i, vecs[i], weights[i])
        for i in range(5))))
    a, b = group.part_bounds[1]
    for i, report in enumerate(reports):
        if i == 1:
            continue
        assert report.failed_parts == ((a, b),), report.failures
        assert "WrongAverage" in report.failures[0].reason
        assert np.array_equal(vecs[i][a:b], before[i][a:b])  # nothing of the answer applied
        assert cluster.services[i].bans.banned(cluster.ids[1]) is not None
        assert cluster.services[i].counters["wrong_averages"] == 1
    for j, (start, end) in enumerate(group.part_bounds):
        if j != 1:
            assert np.array_equal(vecs[0][start:end], vecs[2][start:end])


async def test_group_mismatch_sets_the_member_aside_and_bans_nobody(clusters: Any) -> None:
    """A hostile leader gives member 0 a group in which member 2 weighs twice what the others
    were told (the signatures of each hold). Member 0 names another round: its chunks and
    its answers are set aside by the others, theirs by it (GroupMismatch), nothing of them is
    applied, and nobody is banned or counted an offence (before, member 0 found every honest
    reducer's account against the weights it was told and banned them all)."""
    cluster = await clusters(5)
    group = make_group(cluster.ids)
    members = list(group.members)
    members[2] = dataclasses.replace(members[2], weight=2.0)
    told_otherwise = dataclasses.replace(group, members=tuple(members))
    vecs = gradients(5, group.size)
    before = [v.copy() for v in vecs]
    reports = list(await asyncio.gather(*(
        cluster.services[i].run(told_otherwise if i == 0 else group, i, vecs[i], 1.0)
        for i in range(5))))
    bounds = group.part_bounds
    assert reports[0].failed_parts == ((bounds[1][0], group.size),)  # every other reducer's
    assert np.array_equal(vecs[0][bounds[0][1]:], before[0][bounds[0][1]:])
    for i in range(1, 5):
        assert reports[i].failed_parts == (bounds[0],), reports[i].failures
        # (set aside on its answers, or sooner, when its stream named the other round)
        assert "group under this id is another than ours" in reports[i].failures[0].reason
    for i, service in enumerate(cluster.services):
        assert service.counters["group_mismatches"] >= 1, (i, service.counters)
        assert service.counters["wrong_averages"] == 0
        assert all(service.bans.banned(peer) is None for peer in cluster.ids), i
        # nor an offence: member 0's stream opened with the weight member 2 was told (before,
        # member 0 counted that against member 2: three such rounds banned an honest member)
        assert not service.bans.status()["offenders"], (i, service.bans.status())
    # the four that agree averaged their parts without member 0 (it was set aside there)
    honest = np.mean([before[i] for i in range(1, 5)], axis=0)
    for start, end in bounds[1:]:
        for i in range(1, 5):
            np.testing.assert_allclose(vecs[i][start:end], honest[start:end], rtol=1e-5, atol=1e-6)


async def test_a_leader_that_signs_two_groups_under_one_id_is_banned_at_once(clusters: Any) -> None:
    """The same hostile leader (member 1) as above, but its groups are signed, as the matchmaker
    has its leaders do: member 0 was told another group than the others under one id, and both
    carry the leader's signature. Every member that meets a chunk or an answer of the other
    group holds the two signed names, proof that the leader lied: it bans the leader at once
    (and only the leader: no member is counted an offence)."""
    cluster = await clusters(5)
    leader = cluster.transports[1].identity
    group = make_group(cluster.ids)
    members = list(group.members)
    members[2] = dataclasses.replace(members[2], weight=2.0)
    told_otherwise = signed_by_leader(dataclasses.replace(group, members=tuple(members)), leader)
    group = signed_by_leader(group, leader)
    assert told_otherwise.group_id == group.group_id
    vecs = gradients(5, group.size)
    reports = list(await asyncio.gather(*(
        cluster.services[i].run(told_otherwise if i == 0 else group, i, vecs[i], 1.0)
        for i in range(5))))
    assert reports[0].failed_parts  # nothing of the others' group was applied by member 0
    for i, service in enumerate(cluster.services):
        assert service.counters["wrong_averages"] == 0
        for peer in cluster.ids:
            banned = service.bans.banned(peer)
            if peer == leader.peer_id and i != 1:  # (the leader does not ban itself)
                assert banned is not None and "signed two groups" in banned, (i, banned)
                assert service.counters["leader_equivocations"] == 1
            else:
                assert banned is None, (i, peer, banned)
        offenders = service.bans.status()["offenders"]
        assert not offenders, (i, offenders)
