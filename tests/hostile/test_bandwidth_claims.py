"""A peer lies about its bandwidth: three honest dedlocd processes and one that claims 1e12 B/s
(to be given most of the vector to reduce) or 1 B/s (so that reducers wait hours for its chunks)
in every round, whatever it measured (the test-only switch DEDLOC_TEST_CLAIMED_BANDWIDTH,
corruption.py); its transfers themselves are honest. The honest leaders bound its claim
(claims.py): it never reduces more than the public caps allow, nor more than its peers' typical
figure unless its measured rate backs it (an equal share while nobody has measured it), the
honest peers count the discrepancy, and every round averages all four to their exact weighted
mean."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from support import DaemonProcess, average_in_shared_memory, swarm_with_odd_one

from dedloc.daemon.averaging.round_request import ranked

CHUNK = 16 << 10  # elements (64 KiB chunks): several per part
LENGTH = 4 * 4 * CHUNK + 1234
WEIGHTS = [1.0, 2.0, 3.0, 5.0]
ARGS = ("--averaging.chunk_bytes", str(CHUNK * 4))


async def swarm(daemon_factory: Any, claim: float) -> list[DaemonProcess]:
    return await swarm_with_odd_one(daemon_factory, ARGS, "liar", {
        "DEDLOC_TESTING": "1", "DEDLOC_TEST_CLAIMED_BANDWIDTH": repr(claim)})


async def average(daemons: list[DaemonProcess], key: str, seed: int
                  ) -> tuple[list[Any], list[np.ndarray], np.ndarray]:
    """One round, every daemon a trainer: the reports, the results and the weighted mean."""
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(LENGTH).astype(np.float32) * (i + 1) for i in range(4)]
    reports, results = await average_in_shared_memory(daemons, key, vectors, WEIGHTS)
    mean = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=WEIGHTS)
    return reports, results, mean


def keys(ids: list[str], liar: str, liar_leads: bool) -> itertools.islice[str]:
    """Round keys whose leader (the first by matchmaking's order) is, or is not, the liar."""
    return itertools.islice((k for k in (f"claims/{n}" for n in range(10_000))
                             if (ranked(k, ids)[0] == liar) == liar_leads), 3)


@pytest.mark.parametrize("claim", [1e12, 1.0])
async def test_a_lying_bandwidth_claim_wins_no_share_and_every_round_is_exact(
        daemon_factory: Any, claim: float) -> None:
    daemons = await swarm(daemon_factory, claim)
    ids = [(await d.call("node.info"))["peer_id"] for d in daemons]
    liar = ids[3]
    equal_share = LENGTH / 4 + CHUNK  # whole chunks: one more at most
    honest_led = list(keys(ids, liar, False))[:2]
    liar_led = next(iter(keys(ids, liar, True)))
    for seed, key in enumerate([*honest_led, liar_led]):
        reports, results, mean = await average(daemons, key, seed)
        for report, result in zip(reports, results, strict=True):
            assert report["group_size"] == 4 and not report["failed_parts"], report
            np.testing.assert_allclose(result, mean, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(result, results[0])
        share = reports[0]["shares"][reports[0]["members"].index(liar)]
        if key == honest_led[0]:  # nobody has measured it yet: at most an equal share
            assert share <= equal_share, reports[0]["shares"]
        elif key == honest_led[1]:  # measured: at most its rate, within the public caps
            assert share <= 2 * equal_share, reports[0]["shares"]
        else:  # leading, it keeps (honest code) the public caps its followers check
            assert share <= 2 * equal_share, reports[0]["shares"]
    counters = [(await d.call("averaging.status"))["counters"] for d in daemons[:3]]
    assert sum(c.get("refused_groups", 0) for c in counters) == 0  # honest groups are never refused
    # the honest leaders of the first two rounds bounded the claim
    assert sum(c.get("bandwidth_claims_bounded", 0) for c in counters) >= 2, counters
    if claim > 1e9:  # every honest peer measured it far below its claim, each round
        assert all(c.get("bandwidth_overclaims", 0) >= 1 for c in counters), counters
        assert sum(c.get("bandwidth_claims_cut", 0) for c in counters) >= 2, counters
