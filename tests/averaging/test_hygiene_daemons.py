"""Bad contributions through real daemons: three honest dedlocd processes and one that sends bad
parts (the test-only switch DEDLOC_TEST_CORRUPT_PARTS: a local NaN is refused by the API itself,
so a bad sender is simulated below it). Its NaN, short and absurdly large parts are rejected round
after round, the honest ones get the weighted average of the honest members only, the third
offence bans it (not admitted to the next group, visible in averaging.status and node metrics),
and the ban expires."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from support import DaemonProcess, average_in_shared_memory, swarm_with_odd_one, wait_until

CHUNK = 16 << 10  # elements (64 KiB chunks): several per part
LENGTH = 3 * 3 * CHUNK + 1234
WEIGHTS = [1.0, 2.0, 3.0, 5.0]
BAN_SECONDS = 20
ARGS = ("--averaging.chunk_bytes", str(CHUNK * 4), "--averaging.ban_after", "3",
        "--averaging.ban_seconds", str(BAN_SECONDS))


async def swarm(daemon_factory: Any) -> list[DaemonProcess]:
    return await swarm_with_odd_one(daemon_factory, ARGS, "bad", {
        "DEDLOC_TESTING": "1", "DEDLOC_TEST_CORRUPT_PARTS": "nan,short,scale=1e6"})


async def average(daemons: list[DaemonProcess], key: str, seed: int) -> tuple[list[Any], list[np.ndarray],
                                                                              np.ndarray]:
    """One round: the honest three as trainers, the bad one as a client (it sends, reduces
    nothing). The reports, the honest results and the honest members' weighted average."""
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(LENGTH).astype(np.float32) * (i + 1) for i in range(4)]
    reports, results = await average_in_shared_memory(
        daemons, key, vectors, WEIGHTS, role=lambda index: "client" if index == 3 else "trainer")
    honest = np.average(np.stack(vectors[:3]).astype(np.float64), axis=0, weights=WEIGHTS[:3])
    return reports, results[:3], honest


def check_honest(reports: list[Any], results: list[np.ndarray], honest: np.ndarray) -> None:
    for report, result in zip(reports[:3], results, strict=True):
        assert not report["failed_parts"], report
        # each honest trainer reduces a part (a reducer judges only what it receives): honest
        # members with like claims are not cut below their peers by a leader's measurements
        start, end = report["part"]
        assert end > start, report
        np.testing.assert_allclose(result, honest, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(result, results[0])


async def test_bad_sender_is_rejected_banned_and_let_back(daemon_factory: Any) -> None:
    daemons = await swarm(daemon_factory)
    bad = (await daemons[3].call("node.info"))["peer_id"]
    for round_index, kind in enumerate(["nonfinite", "malformed", "norm_outlier"]):
        reports, results, honest = await average(daemons, f"hygiene/{round_index}", round_index)
        assert all(r["group_size"] == 4 for r in reports), reports
        check_honest(reports, results, honest)
        for report in reports[:3]:
            assert report["senders_rejected"] == {bad: kind}, report
    banned_at = time.time()
    for daemon in daemons[:3]:
        status = await daemon.call("averaging.status")
        assert [b["peer_id"] for b in status["bans"]["active"]] == [bad], status["bans"]
        counters = status["counters"]
        assert counters["bans"] == 1 and counters["offences"] == 3, counters
        assert counters["offences_nonfinite"] == counters["offences_malformed"] == 1
        assert counters["offences_norm_outlier"] == 1
        assert (await daemon.call("node.info"))["counters"]["averaging.bans"] == 1

    # banned: the honest three average without it, it averages alone
    reports, results, honest = await average(daemons, "hygiene/banned", 3)
    check_honest(reports, results, honest)
    assert [r["group_size"] for r in reports] == [3, 3, 3, 1], reports
    assert not any(r["senders_rejected"] for r in reports[:3])
    refused = [(await d.call("averaging.status"))["counters"].get("refused_banned", 0) for d in daemons[:3]]
    assert sum(refused) >= 1, refused

    # the ban expires: it is admitted again, and caught again (alone, it ran no all-reduce round:
    # its next one is its 4th, "nan" again)
    async def expired() -> bool:
        statuses = [await d.call("averaging.status") for d in daemons[:3]]
        return all(not s["bans"]["active"] and s["counters"].get("bans_expired") == 1 for s in statuses)

    await wait_until(expired, timeout=BAN_SECONDS + 60, interval=0.5)
    assert time.time() - banned_at >= BAN_SECONDS - 1
    reports, results, honest = await average(daemons, "hygiene/after", 4)
    assert all(r["group_size"] == 4 for r in reports), reports
    check_honest(reports, results, honest)
    assert all(r["senders_rejected"] == {bad: "nonfinite"} for r in reports[:3]), reports
