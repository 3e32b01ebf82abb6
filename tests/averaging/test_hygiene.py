"""Bad contributions over real TlsTransports (one process): a sender whose chunks are NaN/Inf, short
or absurdly large is left out of the round and the others get the weighted average of the honest
members only; repeated offences ban it (streams refused) until the ban expires; centered clipping
bounds what a sender that is merely far off can do."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from averaging import test_allreduce
from averaging.test_allreduce import Cluster, chunk_ranges, make_group, vectors, weighted

from dedloc.daemon.averaging.allreduce import AllReduceReport, AllReduceService
from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.compression import get_codec
from dedloc.daemon.averaging.corruption import SenderCorruption
from dedloc.daemon.averaging.screening import ScreeningPolicy

clusters = test_allreduce.clusters  # the fixture: real transports on 127.0.0.1

WEIGHTS = [1.0, 2.0, 1.5, 4.0]
ROLES = ["trainer", "trainer", "trainer", "client"]  # the bad one (3) sends, reduces nothing


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def bad_cluster(clusters: Any, modes: Sequence[str], *, policy: ScreeningPolicy | None = None,
                      bans: Sequence[BanList] | None = None) -> Cluster:
    """Three honest services and one whose chunks go out bad (`modes`, one per round)."""
    cluster: Cluster = await clusters(4, services=[])
    for index in range(3):
        cluster.services.append(AllReduceService(cluster.transports[index], inline_elements=0,
                                                 policy=policy, bans=bans[index] if bans else None))
    cluster.services.append(AllReduceService(cluster.transports[3],
                                             corruption=SenderCorruption(list(modes))))
    return cluster


async def one_round(cluster: Cluster, vecs: list[np.ndarray], compression: str = "none",
                    size: int = 10_007) -> list[AllReduceReport]:
    group = make_group(cluster.ids, roles=ROLES, weights=WEIGHTS, compression=compression, size=size)
    return list(await asyncio.gather(*(s.run(group, i, vecs[i], WEIGHTS[i])
                                       for i, s in enumerate(cluster.services))))


@pytest.mark.parametrize(("mode", "compression", "kind"), [
    ("nan", "none", "nonfinite"), ("inf", "fp16", "nonfinite"), ("nan", "quantile8", "nonfinite"),
    ("nan", "uint8", "malformed"), ("short", "none", "malformed"), ("short", "uint8", "malformed"),
    ("scale=1e6", "none", "norm_outlier"), ("scale=1e6", "quantile8", "norm_outlier"),
    ("scale=1e14", "none", "too_large")])
async def test_bad_sender_is_left_out_of_the_round(clusters: Any, mode: str, compression: str,
                                                   kind: str) -> None:
    cluster = await bad_cluster(clusters, [mode])
    vecs = vectors(4, 10_007, seed=4)
    honest = weighted(vecs, WEIGHTS, range(3))
    codec = get_codec(compression)
    slack = 2 * max(codec.error_bound(v) for v in vecs[:3]) + 1e-5
    reports = await one_round(cluster, vecs, compression)
    bad = cluster.ids[3]
    for i, report in enumerate(reports[:3]):
        assert report.ok, report.failures
        assert report.senders_rejected == {bad: kind}, report.senders_excluded
        assert np.abs(vecs[i] - honest).max() <= slack  # every chunk: the honest members only
        assert np.array_equal(vecs[i], vecs[0])
        assert cluster.services[i].bans.counters[f"offences_{kind}"] == 1


@pytest.mark.parametrize(("mode", "kind"), [("nan", "nonfinite"), ("scale=1e14", "too_large")])
async def test_bad_sender_with_running_sums(clusters: Any, mode: str, kind: str) -> None:
    """The norm rule off: reducers keep running sums, the other rules still hold."""
    cluster = await bad_cluster(clusters, [mode], policy=ScreeningPolicy(max_norm_ratio=0))
    vecs = vectors(4, 10_007, seed=8)
    honest = weighted(vecs, WEIGHTS, range(3))
    reports = await one_round(cluster, vecs)
    for i, report in enumerate(reports[:3]):
        assert report.ok and report.senders_rejected == {cluster.ids[3]: kind}
        np.testing.assert_allclose(vecs[i], honest, rtol=1e-5, atol=1e-5)


async def test_heterogeneous_honest_senders_are_never_rejected(clusters: Any) -> None:
    """Scales 1000x apart (under the 1000 ratio against the median), zeros in some chunks."""
    cluster = await clusters(4)
    rng = np.random.default_rng(7)
    vecs = [(rng.standard_normal(10_007) * scale).astype(np.float32) for scale in (1e-3, 1.0, 0.05, 0.9)]
    vecs[0][:3000] = 0  # a chunk the others touched and this one did not, and the reverse
    for v in vecs[1:]:
        v[5000:6000] = 0
    group = make_group(cluster.ids, weights=WEIGHTS)
    expected = weighted(vecs, WEIGHTS, range(4))
    reports = await asyncio.gather(*(s.run(group, i, vecs[i], WEIGHTS[i])
                                     for i, s in enumerate(cluster.services)))
    for vector, report in zip(vecs, reports, strict=True):
        assert report.ok and not report.senders_excluded and not report.senders_rejected
        np.testing.assert_allclose(vector, expected, rtol=1e-5, atol=1e-6)


async def test_repeated_offences_ban_until_the_ban_expires(clusters: Any) -> None:
    clocks = [Clock() for _ in range(3)]
    bans = [BanList(ban_after=2, window=100, seconds=50, clock=clock) for clock in clocks]
    cluster = await bad_cluster(clusters, ["nan", "short"], bans=bans)
    bad = cluster.ids[3]
    for round_index, kind in enumerate(["nonfinite", "malformed"]):
        vecs = vectors(4, 10_007, seed=round_index)
        reports = await one_round(cluster, vecs)
        assert all(r.senders_rejected == {bad: kind} for r in reports[:3])
    for ban_list in bans:
        assert ban_list.banned(bad) is not None
        assert [b["peer_id"] for b in ban_list.status()["active"]] == [bad]
    # banned: its streams are refused, it is left out from the start, no new offence is counted
    vecs = vectors(4, 10_007, seed=5)
    honest = weighted(vecs, WEIGHTS, range(3))
    reports = await one_round(cluster, vecs)
    for i, report in enumerate(reports[:3]):
        assert report.ok and not report.senders_rejected
        assert "banned here" in report.senders_excluded[bad]
        np.testing.assert_allclose(vecs[i], honest, rtol=1e-5, atol=1e-5)
        assert bans[i].counters["refused_banned"] >= 1 and bans[i].counters["offences"] == 2
    assert any("banned here" in f.reason for f in reports[3].failures)
    # the ban expires: the peer is served again (and caught again)
    for clock in clocks:
        clock.now += 51
    reports = await one_round(cluster, vectors(4, 10_007, seed=6))
    for ban_list, report in zip(bans, reports[:3], strict=True):
        assert report.senders_rejected == {bad: "malformed"}  # its 4th round: "short" again
        assert ban_list.counters["bans_expired"] == 1 and ban_list.status()["active"] == []


async def test_stream_weight_must_match_the_group(clusters: Any) -> None:
    cluster = await clusters(3)
    group = make_group(cluster.ids, weights=[1.0, 1.0, 1.0])
    vecs = vectors(3, group.size)
    honest = weighted(vecs, [1.0, 1.0, 1.0], range(2))
    reports = await asyncio.gather(cluster.services[0].run(group, 0, vecs[0], 1.0),
                                   cluster.services[1].run(group, 1, vecs[1], 1.0),
                                   cluster.services[2].run(group, 2, vecs[2], 1e9))
    for i in range(2):
        assert "sends with weight 1e+09" in reports[i].senders_excluded[cluster.ids[2]]
        assert reports[i].senders_rejected == {cluster.ids[2]: "protocol"}
        (a, b), = [group.part_bounds[i]]
        np.testing.assert_allclose(vecs[i][a:b], honest[a:b], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("robust", ["none", "centered_clip"])
async def test_centered_clipping_bounds_a_far_off_sender(clusters: Any, robust: str) -> None:
    """A sender 50x off the others passes the norm rule; clipping keeps it from steering."""
    cluster = await bad_cluster(clusters, ["scale=50"], policy=ScreeningPolicy(robust=robust))  # type: ignore[arg-type]
    rng = np.random.default_rng(9)
    base = rng.standard_normal(10_007)
    vecs = [(base + 0.1 * rng.standard_normal(10_007)).astype(np.float32) for _ in range(4)]
    honest = weighted(vecs, WEIGHTS, range(3))
    attack = [v.copy() for v in vecs]
    attack[3] *= 50
    naive = weighted(attack, WEIGHTS, range(4))
    group = make_group(cluster.ids, roles=ROLES, weights=WEIGHTS)
    reports = await asyncio.gather(*(s.run(group, i, vecs[i], WEIGHTS[i])
                                     for i, s in enumerate(cluster.services)))
    assert all(r.ok and not r.senders_rejected for r in reports[:3])
    assert np.array_equal(vecs[0], vecs[1]) and np.array_equal(vecs[0], vecs[2])
    for _, (a, b) in chunk_ranges(group):
        off = np.linalg.norm(vecs[0][a:b] - honest[a:b]) / np.linalg.norm(naive[a:b] - honest[a:b])
        if robust == "none":
            assert abs(off - 1) < 1e-3  # the plain weighted mean takes it in full
        else:
            assert off < 0.1
