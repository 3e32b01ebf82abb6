"""Data hygiene without the network: the screening rules, a reducer that keeps contributions,
centered clipping, the ban list, the test-only corruption switch and the config keys."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dedloc.daemon.averaging.bans import BanList
from dedloc.daemon.averaging.clipping import MEDIAN_BLOCK, centered_clip, coordinate_median, sorting_network
from dedloc.daemon.averaging.codec import CompressionError, NonFiniteError
from dedloc.daemon.averaging.compression import get_codec
from dedloc.daemon.averaging.corruption import SenderCorruption, from_environment
from dedloc.daemon.averaging.reducer import PartReducer
from dedloc.daemon.averaging.screening import (
    ContributionRejected,
    ScreeningPolicy,
    norm_outliers,
    offence_kind,
    screen,
)
from dedloc.daemon.averaging.wire import ChunkPlan, PeerFault, ProtocolViolation, parse_chunk
from dedloc.daemon.config import build_config
from dedloc.daemon.errors import ConfigError


# --- rules ------------------------------------------------------------------------------------------
def test_screen_gives_the_norm_and_enforces_the_cap() -> None:
    values = np.array([3.0, 4.0], np.float32)
    assert screen(values, ScreeningPolicy()) == pytest.approx(5.0)
    assert screen(np.zeros(0, np.float32), ScreeningPolicy()) == 0.0
    with pytest.raises(ContributionRejected, match="exceeds the cap") as caught:
        screen(np.array([1.0, -2e12], np.float32), ScreeningPolicy())
    assert caught.value.kind == "too_large"
    # a norm over the cap made of small values is fine (only a value over the cap is refused)
    assert screen(np.full(10_000, 0.9, np.float32), ScreeningPolicy(max_value=1.0)) > 1.0
    # float32 overflow of the norm itself: still judged by the values
    with pytest.raises(ContributionRejected):
        screen(np.full(4, 3e38, np.float32), ScreeningPolicy(max_value=1e38))


def test_norm_outliers_need_three_senders_and_a_positive_median() -> None:
    assert norm_outliers({0: 1.0, 1: 1e9}, 1000) == {}  # two senders: nobody can be outvoted
    rejected = norm_outliers({0: 1.0, 1: 2.0, 2: 1.5, 3: 1e4}, 1000)
    assert list(rejected) == [3] and "median 1.5" in rejected[3]
    assert norm_outliers({0: 1.0, 1: 2.0, 2: 1.5, 3: 1e4}, 0) == {}  # rule off
    # heterogeneous honest peers (100x apart) are all kept
    assert norm_outliers({0: 0.01, 1: 1.0, 2: 0.1, 3: 0.5}, 1000) == {}
    # the others left the chunk at zero: a sender that did not is no attacker
    assert norm_outliers({0: 0.0, 1: 0.0, 2: 0.0, 3: 5.0}, 1000) == {}
    # the reducer's own contribution is never rejected
    assert norm_outliers({0: 1e6, 1: 1.0, 2: 1.0}, 1000, protected=0) == {}
    # two bad of five: each is judged against the others' median, which the honest majority holds
    assert set(norm_outliers({0: 1.0, 1: 1.2, 2: 0.9, 3: 1e6, 4: 1e7}, 1000)) == {3, 4}


def test_offence_kinds() -> None:
    assert offence_kind(ContributionRejected("norm_outlier", "x")) == "norm_outlier"
    assert offence_kind(NonFiniteError("nan")) == "nonfinite"
    assert offence_kind(CompressionError("payload of 3 bytes")) == "malformed"
    with pytest.raises(ProtocolViolation) as caught:
        parse_chunk({"c": 0}, 1, 4)
    assert offence_kind(caught.value) == "protocol"
    assert offence_kind(PeerFault("the sender closed its stream early")) is None  # a fault, no offence
    assert offence_kind(TimeoutError()) is None


# --- the reducer ------------------------------------------------------------------------------------
PLAN = ChunkPlan(0, 10, 4)  # chunks [0, 4), [4, 8), [8, 10)


def fill(reducer: PartReducer, contributions: dict[int, np.ndarray], weights: dict[int, float]) -> None:
    for sender, vector in contributions.items():
        for c in range(PLAN.count):
            a, b = PLAN.relative(c)
            reducer.take(sender, c)
            reducer.add(c, sender, vector[a:b], weights[sender])
            reducer.added(c, weights[sender])


def test_reducer_keeps_contributions_and_rejects_norm_outliers() -> None:
    rng = np.random.default_rng(0)
    honest = {i: rng.standard_normal(10).astype(np.float32) for i in range(3)}
    weights = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    reducer = PartReducer(PLAN, range(4), own=0)
    assert reducer.keep
    fill(reducer, {**honest, 3: honest[2] * 1e5}, weights)
    expected = sum(weights[i] * honest[i].astype(np.float64) for i in range(3)) / 6.0
    for c in range(PLAN.count):
        a, b = PLAN.relative(c)
        average, rejected, _ = reducer.average(c)
        assert average is not None and list(rejected) == [3]
        np.testing.assert_allclose(average, expected[a:b], rtol=1e-6, atol=1e-6)


def test_reducer_discard_leaves_a_sender_out_of_unsettled_chunks() -> None:
    vectors = {i: np.full(10, float(i + 1), np.float32) for i in range(3)}
    reducer = PartReducer(PLAN, range(3), own=0)
    fill(reducer, vectors, {0: 1.0, 1: 1.0, 2: 1.0})
    average, _, _ = reducer.average(0)  # settled and averaged before the offence: sender 2 counts
    assert average is not None and np.allclose(average, 2.0)
    reducer.discard(2)
    for c in (1, 2):
        average, rejected, _ = reducer.average(c)
        assert average is not None and np.allclose(average, 1.5) and not rejected


def test_running_sums_below_three_senders_or_with_the_rule_off() -> None:
    """Only without the answers' accounts (which need every contribution of a chunk)."""
    unchecked = ScreeningPolicy(check_answers=False)
    assert PartReducer(PLAN, range(2)).keep  # the account of the answer needs the contributions
    assert not PartReducer(PLAN, range(2), policy=unchecked).keep
    assert not PartReducer(PLAN, range(5), policy=ScreeningPolicy(max_norm_ratio=0,
                                                                 check_answers=False)).keep
    assert PartReducer(PLAN, range(2), policy=ScreeningPolicy(robust="centered_clip",
                                                              check_answers=False)).keep
    reducer = PartReducer(PLAN, range(2), policy=unchecked)
    fill(reducer, {0: np.ones(10, np.float32), 1: np.full(10, 4.0, np.float32)}, {0: 2.0, 1: 1.0})
    average, rejected, _ = reducer.average(1)
    assert average is not None and np.allclose(average, 2.0) and not rejected
    with pytest.raises(ContributionRejected):  # the hard cap holds in both modes
        reducer.add(2, 0, np.full(2, 1e13, np.float32), 1.0)


def test_every_contribution_rejected_or_discarded_leaves_no_average() -> None:
    reducer = PartReducer(PLAN, range(3), own=0)
    reducer.take(1, 0)
    reducer.add(0, 1, np.ones(4, np.float32), 1.0)
    reducer.added(0, 1.0)
    reducer.discard(1)
    reducer.drop(0)
    reducer.drop(2)
    assert reducer.average(0) == (None, {}, [])


# --- centered clipping --------------------------------------------------------------------------------
def honest_rows(count: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n)
    return np.stack([base + 0.1 * rng.standard_normal(n) for _ in range(count)]).astype(np.float32)


@pytest.mark.parametrize("k", range(1, 13))
def test_sorting_network_sorts(k: int) -> None:
    """The 0-1 principle: a network that sorts every 0/1 input sorts every input."""
    pairs = sorting_network(k)
    inputs = ((np.arange(1 << k)[:, None] >> np.arange(k)) & 1).T.copy()  # (k, 2^k): every 0/1 vector
    for a, b in pairs:
        low = np.minimum(inputs[a], inputs[b])
        inputs[b] = np.maximum(inputs[a], inputs[b])
        inputs[a] = low
    assert (np.diff(inputs, axis=0) >= 0).all()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 13, 17])
def test_coordinate_median_is_numpys(k: int) -> None:
    rows = np.random.default_rng(k).standard_normal((k, 3 * MEDIAN_BLOCK + 17)).astype(np.float32)
    out = np.empty(rows.shape[1], np.float32)
    expected = np.median(rows, axis=0)
    np.testing.assert_allclose(coordinate_median(rows, out), expected, rtol=1e-6, atol=1e-7)


def test_clipping_honest_contributions_is_their_weighted_mean() -> None:
    rows = honest_rows(5, 5000)
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    out = np.empty(5000, np.float32)
    assert centered_clip(rows, weights, 2.0, 3, out) == 0
    np.testing.assert_allclose(out, np.average(rows.astype(np.float64), axis=0, weights=weights),
                               rtol=1e-5, atol=1e-5)
    one = np.empty(5000, np.float32)
    centered_clip(rows[:1], [1.0], 2.0, 3, one)
    np.testing.assert_array_equal(one, rows[0])


@pytest.mark.parametrize("attacker_weight", [1.0, 1e6])
def test_clipping_bounds_an_attackers_influence(attacker_weight: float) -> None:
    honest = honest_rows(4, 5000, seed=1)
    weights = [1.0, 1.0, 1.0, 1.0, attacker_weight]
    attack = (honest[0] * 50).astype(np.float32)  # within the norm rule, far off the others
    rows = np.concatenate([honest, attack[None]])
    out = np.empty(5000, np.float32)
    clipped = centered_clip(rows, weights, 2.0, 3, out)
    assert clipped >= 1
    truth = honest.astype(np.float64).mean(axis=0)
    naive = np.average(rows.astype(np.float64), axis=0, weights=weights)
    median = np.median(rows.astype(np.float64), axis=0)
    tau = 2.0 * float(np.median([np.linalg.norm(r - median) for r in rows]))
    # from the median, at most tau per iteration, whatever the attacker's weight
    assert np.linalg.norm(out - median) <= 3 * tau * (1 + 1e-5)
    assert np.linalg.norm(out - truth) < 0.05 * np.linalg.norm(naive - truth)


def test_clipping_with_most_contributions_equal_gives_the_median() -> None:
    rows = np.zeros((4, 100), np.float32)
    rows[3] = 7.0
    out = np.empty(100, np.float32)
    centered_clip(rows, [1.0] * 4, 2.0, 3, out)
    assert not out.any()


def test_reducer_with_centered_clipping() -> None:
    honest = honest_rows(3, 10, seed=2)
    policy = ScreeningPolicy(robust="centered_clip")
    reducer = PartReducer(PLAN, range(3), policy=policy, own=0)
    fill(reducer, dict(enumerate(honest)), {0: 1.0, 1: 1.0, 2: 1.0})
    for c in range(PLAN.count):
        a, b = PLAN.relative(c)
        average, _, _ = reducer.average(c)
        expected = np.empty(b - a, np.float32)
        centered_clip(honest[:, a:b].copy(), [1.0] * 3, 2.0, 3, expected)
        assert average is not None and np.array_equal(average, expected)


# --- bans ---------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_offences_ban_then_the_ban_expires() -> None:
    clock = Clock()
    bans = BanList(ban_after=3, window=60, seconds=30, clock=clock)
    assert not bans.offence("p", "nonfinite", "NaN")
    clock.now += 70  # that one is out of the window
    assert not bans.offence("p", "malformed", "short")
    assert not bans.offence("p", "norm_outlier", "big")
    assert bans.banned("p") is None
    assert bans.offence("p", "norm_outlier", "big")
    reason = bans.banned("p")
    assert reason is not None and "30s" in reason and "norm_outlier" in reason
    status = bans.status()
    assert [b["peer_id"] for b in status["active"]] == ["p"] and "p" not in status["offenders"]
    assert bans.offence("p", "nonfinite", "while banned")  # counted, still banned
    clock.now += 31
    assert bans.banned("p") is None
    assert bans.status()["active"] == []
    assert bans.counters["bans"] == 1 and bans.counters["bans_expired"] == 1
    assert bans.counters["offences"] == 5 and bans.counters["offences_norm_outlier"] == 2
    assert not bans.offence("p", "nonfinite", "again")  # a fresh count after the ban


def test_ban_after_zero_never_bans() -> None:
    bans = BanList(ban_after=0)
    for _ in range(10):
        assert not bans.offence("p", "nonfinite", "NaN")
    assert bans.banned("p") is None and bans.counters["offences"] == 10


# --- the test-only switch -----------------------------------------------------------------------------
def test_corruption_switch_needs_the_testing_flag() -> None:
    assert from_environment({}) is None
    assert from_environment({"DEDLOC_TEST_CORRUPT_PARTS": "nan"}) is None  # refused outside tests
    switch = from_environment({"DEDLOC_TEST_CORRUPT_PARTS": "nan, scale=1e6", "DEDLOC_TESTING": "1"})
    assert switch is not None and [switch.next_round() for _ in range(3)] == ["nan", "scale=1e6", "nan"]
    for bad in ("zip", "scale", "nan=3", "scale=inf"):
        with pytest.raises(ValueError):
            SenderCorruption([bad])


@pytest.mark.parametrize("codec_name", ["none", "fp16", "uint8", "quantile8"])
@pytest.mark.parametrize(("mode", "kind"), [("nan", {"nonfinite", "malformed"}),
                                            ("inf", {"nonfinite", "malformed"}),
                                            ("short", {"malformed"}), ("scale=1e6", None)])
def test_corrupted_chunks_are_caught_after_decoding(codec_name: str, mode: str, kind: Any) -> None:
    codec = get_codec(codec_name)
    values = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    payload, meta = SenderCorruption.encode(mode, codec, values)
    if kind is None:
        decoded = codec.decode(payload, meta, values.size)
        assert np.linalg.norm(decoded) > 1e5 * np.linalg.norm(values)
        return
    with pytest.raises(CompressionError) as caught:
        codec.decode(payload, meta, values.size, out=np.empty(values.size, np.float32))
    assert offence_kind(caught.value) in kind


# --- config -------------------------------------------------------------------------------------------
def test_config_keys_and_their_ranges() -> None:
    config = build_config()
    assert config.averaging.max_norm_ratio == 1000.0 and config.averaging.robust_aggregation == "none"
    robust = build_config(overrides={"averaging.robust_aggregation": "centered_clip"}).averaging
    assert robust.robust_aggregation == "centered_clip" and robust.clip_iterations == 3
    for key, value in [("averaging.max_norm_ratio", 0.5), ("averaging.max_value", 0.0),
                       ("averaging.ban_seconds", -1.0), ("averaging.clip_iterations", 0),
                       ("averaging.ban_after", -1), ("averaging.max_value", 1e31)]:
        with pytest.raises(ConfigError, match=key):
            build_config(overrides={key: value})
    assert build_config(overrides={"averaging.max_norm_ratio": 0.0}).averaging.max_norm_ratio == 0.0
