"""The reducer's account of an answer and the member's check of it (accounts.py), pure: honest
answers pass in every codec (their error is within the tolerance the codec's bound gives), wrong
ones (zeros, scaled, another vector, a sender dropped or counted twice) fail, and so does an
account that misstates the member's own contribution or breaks the group."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from dedloc.daemon.averaging.accounts import (
    ACCOUNT_KEY,
    Entry,
    OlderAccount,
    WrongAverage,
    account_header,
    check_answer,
    codec_errors,
    measure,
    parse_account,
    segments,
    signs,
)
from dedloc.daemon.averaging.aggregation import clip_scales, l2_norm, weighted_mean
from dedloc.daemon.averaging.compression import get_codec, reply_codec, sparsifies

N = 20_000
WEIGHTS = [1.0, 2.0, 3.0, 5.0]
REDUCER = 3


def contributions(codec_name: str, seed: int = 0) -> list[np.ndarray]:
    """What the reducer averages: each sender's chunk as it decodes it."""
    rng = np.random.default_rng(seed)
    codec = get_codec(codec_name)
    out = []
    for i in range(len(WEIGHTS)):
        values = (rng.standard_normal(N) * (i + 1)).astype(np.float32)
        if codec_name != "none" and (i != REDUCER or sparsifies(codec)):
            values = codec.decode(*codec.encode(values), N)
        out.append(np.array(values))
    return out


def reduce(rows: list[np.ndarray], weights: list[float], codec_name: str,
           answer: np.ndarray | None = None, chunk: int = 0) -> tuple[Any, Any, dict[str, Any]]:
    """What an honest reducer sends (as answering.py computes it), or `answer` with the honest
    account."""
    reply = reply_codec(get_codec(codec_name))
    if answer is None:
        total = sum(weights)
        answer = np.multiply(rows[0], np.float32(weights[0] / total))
        for row, weight in zip(rows[1:], weights[1:], strict=True):
            answer += np.multiply(row, np.float32(weight / total))
    payload, meta = reply.encode(answer)
    r = signs("g", REDUCER, chunk, meta, payload, N)
    parts = segments(N, len(weights))
    entries = [Entry(i, w, *measure(r, row, parts))
               for i, (row, w) in enumerate(zip(rows, weights, strict=True))]
    errors = codec_errors(reply.decode(payload, meta, N), answer, parts)
    return payload, meta, account_header(entries, errors)


def check(payload: Any, meta: Any, account: Any, codec_name: str, *, me: int = 0,
          mine: np.ndarray | None = None, weights: list[float] = WEIGHTS, chunk: int = 0,
          aggregation: Any = "mean") -> None:
    reply = reply_codec(get_codec(codec_name))
    answer = reply.decode(payload, meta, N)
    r = signs("g", REDUCER, chunk, meta, payload, N)
    parts = segments(N, len(weights))
    entries, errors = parse_account(account, len(weights), len(parts))
    projections, norm = measure(r, answer, parts)
    check_answer(entries, errors, weights=weights, sends=[True] * len(weights), me=me,
                 mine=None if mine is None else measure(r, mine, parts), answer_projections=projections,
                 answer_norm=norm, answer_bound=reply.error_bound(answer), parts=parts,
                 aggregation=aggregation)


@pytest.mark.parametrize("codec", ["none", "fp16", "uint8", "quantile8", "topk"])
@pytest.mark.parametrize("seed", range(3))
def test_honest_answers_pass_in_every_codec(codec: str, seed: int) -> None:
    rows = contributions(codec, seed)
    payload, meta, account = reduce(rows, WEIGHTS, codec)
    for me in range(len(WEIGHTS)):
        check(payload, meta, account, codec, me=me, mine=rows[me])


# a shift of 0.05 per value is within the 8-bit and sparse codecs' own error: no case for them
WRONG_CASES = [(codec, wrong) for codec in ("none", "fp16", "uint8", "quantile8", "topk")
               for wrong in ("zeros", "scaled", "chosen", "dropped", "twice", "shifted")
               if not (wrong == "shifted" and codec in ("uint8", "quantile8", "topk"))]


@pytest.mark.parametrize(("codec", "wrong"), WRONG_CASES)
def test_wrong_answers_with_an_honest_account_fail(codec: str, wrong: str) -> None:
    """Every wrong chunk is caught, each segment of it checked against its own signs (before
    segments, uint8 let 6 of 40 chunks of a 1.5x answer pass, 20 of 40 of one dropping a
    sender). quantile8's error is large: a chunk wrong by a few times it can pass, but not every
    chunk of a part (8 here); a shift within the 8-bit codecs' error is no test."""
    lossy = codec in ("uint8", "quantile8", "topk")
    rows = contributions(codec)
    total = sum(WEIGHTS)
    honest = sum(np.float64(w / total) * row for row, w in zip(rows, WEIGHTS, strict=True))
    answer = {
        "zeros": np.zeros(N),
        "scaled": honest * 1.5,
        "chosen": np.random.default_rng(9).standard_normal(N),
        "dropped": sum(np.float64(w / sum(WEIGHTS[1:])) * row for row, w in zip(rows[1:], WEIGHTS[1:],
                                                                              strict=True)),
        "twice": honest + WEIGHTS[2] / total * rows[2],
        "shifted": honest + 0.05 * np.sign(honest),  # small per value, the same direction
    }[wrong].astype(np.float32)
    caught = 0
    for chunk in range(8 if lossy else 1):
        payload, meta, account = reduce(rows, WEIGHTS, codec, answer, chunk)
        try:
            check(payload, meta, account, codec, me=0, mine=rows[0], chunk=chunk)
        except WrongAverage as exc:
            assert "weighted mean" in str(exc)
            caught += 1
    assert caught == (8 if lossy else 1) or (codec == "quantile8" and caught >= 1)


@pytest.mark.parametrize("codec", ["uint8", "quantile8", "topk"])
def test_a_scaled_up_answer_fails_in_every_chunk(codec: str) -> None:
    """The hostile test's reducer (corruption.py, scale=10): its answer is 10 times its honest
    average, and it states the scaled answer's codec error (10 times the honest one). <r, d> then
    falls within the tolerance in some chunks (uint8: about 6% of them; before the norm check 1 of
    these 40 passed in uint8, 5 in quantile8, so a whole part was not always refused and a wrong
    chunk was written); its norm gives it away in every one."""
    rows = contributions(codec)
    total = sum(WEIGHTS)
    honest = sum(np.float64(w / total) * row for row, w in zip(rows, WEIGHTS, strict=True))
    answer = (honest * 10).astype(np.float32)
    for chunk in range(40):
        payload, meta, account = reduce(rows, WEIGHTS, codec, answer, chunk)
        with pytest.raises(WrongAverage):
            check(payload, meta, account, codec, me=0, mine=rows[0], chunk=chunk)


def test_an_account_that_misstates_my_contribution_fails() -> None:
    rows = contributions("none")
    payload, meta, account = reduce(rows, WEIGHTS, "none")
    check(payload, meta, account, "none", me=1, mine=rows[1])
    with pytest.raises(WrongAverage, match="own contribution"):
        check(payload, meta, account, "none", me=1, mine=rows[1] * 2)
    forged = {"e": account["e"], "s": [list(e) for e in account["s"]]}
    forged["s"][1][3] *= 1.01  # its norm
    with pytest.raises(WrongAverage, match="own contribution"):
        check(payload, meta, forged, "none", me=1, mine=rows[1])


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: [*a, a[0]], "at most"),  # more entries than senders
    (lambda a: [a[0], a[0], a[2]], "twice"),
    (lambda a: [a[1], a[0], *a[2:]], "out of order"),  # (the order feeds the signs)
    (lambda a: [[9, *a[0][1:]], *a[1:]], "no sender"),
    (lambda a: [[0, 100.0, *a[0][2:]], *a[1:]], "weight"),
    (lambda a: [[0, a[0][1], a[0][2], 1e-9, *a[0][4:]], *a[1:]], "norm allows"),
    # within Cauchy-Schwarz (sqrt(2500) = 50 times the norm) but past Hoeffding's Z = 8
    (lambda a: [[0, a[0][1], [9 * a[0][3], *a[0][2][1:]], *a[0][3:]], *a[1:]], "norm allows"),
    (lambda a: [[0, a[0][1], [float("nan"), *a[0][2][1:]], *a[0][3:]], *a[1:]], "non-finite"),
    (lambda a: [[0, a[0][1], a[0][2][1:], *a[0][3:]], *a[1:]], "projections"),
    (lambda a: [[*a[0][:4], "ab", "cd"], *a[1:]], "hex text"),
    (lambda a: [[True, *a[0][1:]], *a[1:]], "member index"),
    (lambda a: [[0, 1.0]], "sender, weight"),
    (lambda a: {"0": 1}, "not a list"),
    (lambda a: [], "empty account"),
])
def test_malformed_or_impossible_accounts_fail(change: Any, match: str) -> None:
    rows = contributions("none")
    payload, meta, account = reduce(rows, WEIGHTS, "none")
    with pytest.raises(WrongAverage, match=match):
        check(payload, meta, {"e": account["e"], "s": change(account["s"])}, "none", me=0,
              mine=rows[0])


def test_an_older_dedlocs_account_is_a_fault_not_an_offence() -> None:
    """A reducer of an older version (entries without digest and signature) is not banned: its
    part stays local, as for a reducer that failed."""
    rows = contributions("none")
    payload, meta, account = reduce(rows, WEIGHTS, "none")
    older = {"e": account["e"], "s": [entry[:4] for entry in account["s"]]}
    with pytest.raises(OlderAccount) as caught:
        check(payload, meta, older, "none", me=0, mine=rows[0])
    assert not isinstance(caught.value, WrongAverage)


@pytest.mark.parametrize("account", [[], {"s": []}, {"s": [], "e": [0.0, -1.0]},
                                     {"s": [], "e": [0.0, None]}, {"s": [], "e": [0.0, float("inf")]},
                                     {"s": [], "e": [0.0]}, {"s": [], "e": 0.0},
                                     {"s": [], "e": [0.0, 0.0], "x": 1}])
def test_an_account_of_the_wrong_shape_fails(account: Any) -> None:
    with pytest.raises(WrongAverage):
        parse_account(account, 4, 2)


def test_a_codec_error_over_the_codec_bound_fails() -> None:
    """A reducer cannot widen the tolerance past what the codec allows."""
    rows = contributions("uint8")
    payload, meta, account = reduce(rows, WEIGHTS, "uint8")
    with pytest.raises(WrongAverage, match="codec allows"):
        check(payload, meta, {**account, "e": [e * 100 for e in account["e"]]}, "uint8", me=0,
              mine=rows[0])


def test_the_sign_vector_depends_on_every_byte_of_the_answer() -> None:
    payload = np.arange(64, dtype=np.float32).tobytes()
    r = signs("g", 1, 2, {}, payload, 1000)
    assert r.shape == (1000,) and set(np.unique(r)) == {-1.0, 1.0}
    assert 400 < (r > 0).sum() < 600
    assert np.array_equal(r, signs("g", 1, 2, {}, payload, 1000))
    changed = bytearray(payload)
    changed[-1] ^= 1
    for other in (signs("g", 1, 2, {}, bytes(changed), 1000), signs("h", 1, 2, {}, payload, 1000),
                  signs("g", 0, 2, {}, payload, 1000), signs("g", 1, 3, {}, payload, 1000),
                  signs("g", 1, 2, {"e": 1}, payload, 1000)):
        assert not np.array_equal(r, other)


def test_the_false_alarm_bound_is_what_the_docs_say() -> None:
    from dedloc.daemon.averaging.accounts import SEGMENTS, Z
    assert SEGMENTS * 2 * math.exp(-Z**2 / 2) < 3e-13


def test_segments_cover_the_chunk_and_the_largest_account_fits_a_frame() -> None:
    """An answer's header, its account at its longest (every number at its longest JSON, the
    digests and signatures in hex) for as many senders as a group may hold, fits the 64 KiB a
    frame's header may have: a group past it would have failed every answer."""
    from dedloc.daemon.averaging.accounts import MAX_ACCOUNT_SENDERS, SEGMENTS
    from dedloc.daemon.averaging.matchmaking import MAX_GROUP_MEMBERS
    from dedloc.daemon.averaging.settings import MAX_GROUP_SIZE
    from dedloc.daemon.averaging.signatures import ANSWER_SIGNATURE_KEY
    from dedloc.daemon.averaging.wire import chunk_header
    from dedloc.daemon.net.frames import encode_header
    assert MAX_GROUP_MEMBERS <= MAX_ACCOUNT_SENDERS == MAX_GROUP_SIZE
    longest = -1.2345678901234567e-300
    for n, senders in ((20_000, 4), (5, 4), (1, 1), (1 << 20, 64), (1 << 20, 150),
                       (1 << 20, MAX_ACCOUNT_SENDERS)):
        parts = segments(n, senders)
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a < b == c for (a, b), (c, _) in itertools.pairwise(parts))
        assert 1 <= len(parts) <= SEGMENTS
        entries = [Entry(senders - 1, longest, (longest,) * len(parts), longest, "f" * 64, "f" * 128)
                   for _ in range(senders)]
        header = {**chunk_header(99_999, {"lo": longest, "hi": longest, "scale": longest}),
                  ACCOUNT_KEY: account_header(entries, [longest] * len(parts)),
                  ANSWER_SIGNATURE_KEY: "f" * 128}
        encode_header(header)  # ValueError past the frame's limit
    assert len(segments(20_000, 4)) == len(segments(1 << 20, 64)) == SEGMENTS


# --- the norm-clipped mean (aggregation.py) ----------------------------------------------------------
OUTLIER = 1  # its contribution is 1000 times its honest one: clipped to 4 x the median norm


def clipped_rows(codec_name: str, seed: int = 0) -> list[np.ndarray]:
    rows = contributions(codec_name, seed)
    codec = get_codec(codec_name)
    big = (rows[OUTLIER] * np.float32(1000)).astype(np.float32)
    rows[OUTLIER] = big if codec_name == "none" else np.array(codec.decode(*codec.encode(big), N))
    return rows


def clipped_answer(rows: list[np.ndarray], weights: list[float],
                   scales: tuple[float, ...] | None = None) -> np.ndarray:
    """What an honest reducer of a norm_clip round answers (reducer.py): the scales from the
    norms its account states."""
    if scales is None:
        scales = clip_scales(weights, [l2_norm(r) for r in rows])
    return weighted_mean(rows, weights, np.empty(N, np.float32), scales)


@pytest.mark.parametrize("codec", ["none", "fp16", "uint8", "quantile8", "topk"])
def test_honest_norm_clipped_answers_pass_in_every_codec(codec: str) -> None:
    rows = clipped_rows(codec)
    scales = clip_scales(WEIGHTS, [l2_norm(r) for r in rows])
    assert scales[OUTLIER] < 0.01 and all(s == 1.0 for i, s in enumerate(scales) if i != OUTLIER)
    payload, meta, account = reduce(rows, WEIGHTS, codec, clipped_answer(rows, WEIGHTS))
    for me in range(len(WEIGHTS)):  # the clipped sender's own entry checks out too
        check(payload, meta, account, codec, me=me, mine=rows[me], aggregation="norm_clip")


def test_without_an_outlier_the_norm_clipped_answer_is_the_mean() -> None:
    rows = contributions("none")
    payload, meta, account = reduce(rows, WEIGHTS, "none")  # the plain weighted mean
    for aggregation in ("mean", "norm_clip"):
        check(payload, meta, account, "none", me=0, mine=rows[0], aggregation=aggregation)


@pytest.mark.parametrize("codec", ["none", "fp16", "uint8", "quantile8", "topk"])
def test_a_reducer_that_skips_the_clipping_is_caught(codec: str) -> None:
    """It answers the plain weighted mean, the outlier in full, with an honest account: its
    answer's norm is far over what the clipped contributions allow."""
    rows = clipped_rows(codec)
    payload, meta, account = reduce(rows, WEIGHTS, codec, clipped_answer(rows, WEIGHTS, (1.0,) * 4))
    with pytest.raises(WrongAverage):
        check(payload, meta, account, codec, me=0, mine=rows[0], aggregation="norm_clip")
    # ... which a member of a "mean" round would take: members and reducers must share the rule
    check(payload, meta, account, codec, me=0, mine=rows[0], aggregation="mean")


# Halving the lightest sender (weight 1 of 11: 1/22 of its vector) is within a few times the 8-bit
# codecs' error: uint8 and quantile8 let every chunk of it pass (as any wrong answer that small,
# docs/averaging.md); heavier senders' are caught there too.
CLIPPED_HONEST_CASES = [(codec, victim) for codec in ("none", "fp16", "uint8", "quantile8", "topk")
                        for victim in (0, 2, 3)
                        if not (victim == 0 and codec in ("uint8", "quantile8"))]


@pytest.mark.parametrize(("codec", "victim"), CLIPPED_HONEST_CASES)
def test_a_reducer_that_clips_an_honest_contribution_is_caught(codec: str, victim: int) -> None:
    """It also scales an honest sender down to half (as a lower tau would), account honest. Each
    of 8 chunks is checked with its own signs: every one fails exact, fp16 and topk answers;
    with an 8-bit codec some chunks can pass, not a whole part: the first failure refuses the
    rest of it."""
    rows = clipped_rows(codec)
    honest_scales = clip_scales(WEIGHTS, [l2_norm(r) for r in rows])
    scales = tuple(0.5 if i == victim else s for i, s in enumerate(honest_scales))
    answer = clipped_answer(rows, WEIGHTS, scales)
    caught = 0
    for chunk in range(8):
        payload, meta, account = reduce(rows, WEIGHTS, codec, answer, chunk)
        try:
            check(payload, meta, account, codec, me=0, mine=rows[0], chunk=chunk,
                  aggregation="norm_clip")
        except WrongAverage as exc:
            assert "weighted mean" in str(exc)
            caught += 1
    assert caught == 8 or (codec in ("uint8", "quantile8", "topk") and caught >= 1), caught


def test_an_honest_norm_clipped_answer_fails_a_member_that_expects_the_mean() -> None:
    rows = clipped_rows("none")
    payload, meta, account = reduce(rows, WEIGHTS, "none", clipped_answer(rows, WEIGHTS))
    with pytest.raises(WrongAverage):
        check(payload, meta, account, "none", me=0, mine=rows[0], aggregation="mean")
