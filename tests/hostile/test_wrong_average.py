"""A reducer that answers with a wrong average: three honest dedlocd processes and one whose
reducer answers every chunk of its part with zeros (or its average scaled by 10) while its
account stays honest (the test-only switch DEDLOC_TEST_WRONG_ANSWERS, corruption.py; its
contributions as a sender stay honest). Each honest member checks every answer against the
reducer's account before writing it (accounts.py): the wrong part is never applied (it keeps the
member's own values, reported in failed_parts), the reducer is banned at once and counted, and
the next round averages the honest three to their exact weighted mean."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import DaemonProcess, average_in_shared_memory, swarm_with_odd_one, wait_until

from dedloc.daemon.averaging.compression import get_codec

CHUNK = 16 << 10  # elements (64 KiB chunks): several per part
LENGTH = 4 * 3 * CHUNK + 1234
WEIGHTS = [1.0, 2.0, 3.0, 5.0]
ARGS = ("--averaging.chunk_bytes", str(CHUNK * 4))


async def swarm(daemon_factory: Any, mode: str) -> list[DaemonProcess]:
    return await swarm_with_odd_one(daemon_factory, ARGS, "bad", {
        "DEDLOC_TESTING": "1", "DEDLOC_TEST_WRONG_ANSWERS": mode})


async def average(daemons: list[DaemonProcess], key: str, seed: int, compression: str
                  ) -> tuple[list[Any], list[np.ndarray], list[np.ndarray]]:
    """One round, every daemon a trainer: the reports, the results and the inputs."""
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(LENGTH).astype(np.float32) * (i + 1) for i in range(4)]
    reports, results = await average_in_shared_memory(daemons, key, vectors, WEIGHTS,
                                                      compression=compression)
    return reports, results, vectors


def bad_part(reports: list[Any], bad: str) -> tuple[int, int]:
    """The element range the bad reducer reduced in the round."""
    position, shares = reports[0]["members"].index(bad), reports[0]["shares"]
    start = sum(shares[:position])
    return start, start + shares[position]


async def applied_by_the_honest_three(daemons: list[DaemonProcess], key: str) -> str:
    """One round in which nothing the honest three can check contradicts the bad reducer's
    zeros: all three apply them. The bad reducer's peer id."""
    bad = (await daemons[3].call("node.info"))["peer_id"]
    reports, results, _ = await average(daemons, key, 0, "none")
    assert all(r["group_size"] == 4 for r in reports), reports
    start, end = bad_part(reports, bad)
    for index in range(3):
        assert not reports[index]["failed_parts"], reports[index]
        assert not results[index][start:end].any()
    return bad


async def banned_by_the_honest_three(daemons: list[DaemonProcess], bad: str) -> None:
    async def all_banned() -> bool:
        for daemon in daemons[:3]:
            status = await daemon.call("averaging.status")
            if [b["peer_id"] for b in status["bans"]["active"]] != [bad]:
                return False
        return True

    await wait_until(all_banned, timeout=60)


async def the_honest_three_average_without_it(daemons: list[DaemonProcess], bad: str, key: str,
                                              compression: str = "none", atol: float = 1e-5) -> None:
    """Banned: the next round leaves it out and gives the honest three's exact weighted mean."""
    reports, results, vectors = await average(daemons, key, 1, compression)
    assert [r["group_size"] for r in reports[:3]] == [3, 3, 3], reports
    assert all(bad not in r["members"] for r in reports[:3])
    honest = np.average(np.stack(vectors[:3]).astype(np.float64), axis=0, weights=WEIGHTS[:3])
    for report, result in zip(reports[:3], results[:3], strict=True):
        assert not report["failed_parts"], report
        np.testing.assert_allclose(result, honest, rtol=1e-5, atol=atol)
        np.testing.assert_array_equal(result, results[0])


@pytest.mark.parametrize(("mode", "compression"), [("zeros", "none"), ("scale=10", "uint8")])
async def test_wrong_average_is_not_applied_and_its_reducer_is_banned(
        daemon_factory: Any, mode: str, compression: str) -> None:
    daemons = await swarm(daemon_factory, mode)
    bad = (await daemons[3].call("node.info"))["peer_id"]
    reports, results, vectors = await average(daemons, "wrong/0", 0, compression)
    # a value crosses the wire twice: at most the inbound plus the outbound codec bound (the
    # widest vector's bound covers both; compression.py)
    tolerance = 1e-5 if compression == "none" else 2 * get_codec(compression).error_bound(vectors[3])
    assert all(r["group_size"] == 4 for r in reports), reports
    everyone = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=WEIGHTS)
    start, end = bad_part(reports, bad)
    assert end > start
    for index in range(3):
        report, result = reports[index], results[index]
        assert report["failed_parts"] == [[start, end]], report
        # the bad part keeps this member's own values: the wrong average was never written
        np.testing.assert_array_equal(result[start:end], vectors[index][start:end])
        outside = np.r_[0:start, end:LENGTH]
        np.testing.assert_allclose(result[outside], everyone[outside], rtol=1e-5, atol=tolerance)
    for daemon in daemons[:3]:
        status = await daemon.call("averaging.status")
        assert [b["peer_id"] for b in status["bans"]["active"]] == [bad], status["bans"]
        counters = status["counters"]
        assert counters["offences_wrong_average"] == 1 and counters["bans"] == 1, counters
        assert (await daemon.call("node.info"))["counters"]["averaging.offences_wrong_average"] == 1

    await the_honest_three_average_without_it(daemons, bad, "wrong/1", compression, tolerance)


async def misstated_round(daemons: list[DaemonProcess], key: str) -> tuple[str, int, set[int]]:
    """One round in which the reducer's account misstates the sender of largest weight among
    the contributions of each chunk (the victim, weight 3): the victim refuses (or is denied)
    the reducer's part and keeps its own values there; the others applied the zeros. The
    reducer's peer id, the victim's index and the members that refused a part of it: once the
    victim has refused and left the reducer's chunks, the next chunks' largest sender is
    another member (weight 2), which may refuse those too (a loaded machine averages the later
    chunks after the victim left)."""
    bad = (await daemons[3].call("node.info"))["peer_id"]
    reports, results, vectors = await average(daemons, key, 0, "none")
    assert all(r["group_size"] == 4 for r in reports), reports
    start, end = bad_part(reports, bad)
    victim = WEIGHTS.index(3.0)
    refused = {i for i in range(3) if reports[i]["failed_parts"]}
    assert victim in refused, reports
    for index in range(3):
        failed = reports[index]["failed_parts"]
        if index == victim:  # refused (or skipped): its own values kept
            assert failed == [[start, end]], reports[index]
            np.testing.assert_array_equal(results[index][start:end], vectors[index][start:end])
        elif failed:  # (see above) the chunks it refused are the reducer's, the rest zeros
            assert index == WEIGHTS.index(2.0) and len(failed) == 1, reports[index]
            (a, b), = failed
            assert start <= a < b <= end, (failed, start, end)
            np.testing.assert_array_equal(results[index][a:b], vectors[index][a:b])
            assert not results[index][start:a].any()
        else:  # nothing in the answer contradicts what they can check themselves: applied
            assert not results[index][start:end].any()
    return bad, victim, refused


async def test_a_forged_account_is_proven_by_the_sender_it_misstates_and_its_reducer_banned(
        daemon_factory: Any) -> None:
    """The reducer answers zeros and forges its account to agree: it rewrites the projections
    of the sender of largest weight (member of weight 3), whose check alone can see it. That
    sender refuses the answer and shows the others the chunk it signed (accusations.py); they
    applied the zeros already (the accusation comes after), find the account misstated it, and
    ban the reducer. The next round averages the honest three to their exact weighted mean."""
    daemons = await swarm(daemon_factory, "forge")
    bad, _, refused = await misstated_round(daemons, "forged/0")
    await banned_by_the_honest_three(daemons, bad)
    for index, daemon in enumerate(daemons[:3]):
        counters = (await daemon.call("node.info"))["counters"]
        if index in refused:
            assert counters["averaging.offences_wrong_average"] == 1, counters
            assert counters["averaging.allreduce.accusations_sent"] == 2, counters
        else:
            assert counters["averaging.offences_forged_account"] >= 1, counters
            assert counters["averaging.allreduce.forged_accounts"] >= 1, counters
        assert counters.get("averaging.allreduce.accusations_false", 0) == 0, counters

    await the_honest_three_average_without_it(daemons, bad, "forged/1")


async def test_a_forged_account_withheld_from_the_sender_it_misstates_is_proven_all_the_same(
        daemon_factory: Any) -> None:
    """The reducer forges the same way but sends the sender it misstates a skip in place of
    every answer: that sender holds nothing signed of it. The others tell it after the round
    which answers they applied (answers.py); it asks one of them for the account it got
    (withheld.py), finds its own entry misstated under the reducer's signature, bans it and
    shows the others, who ban it too."""
    daemons = await swarm(daemon_factory, "forge_skip")
    bad, victim, refused = await misstated_round(daemons, "withheld/0")
    assert refused == {victim}  # (skipped: it sends the reducer all it has, and stays)
    await banned_by_the_honest_three(daemons, bad)
    for index, daemon in enumerate(daemons[:3]):
        counters = (await daemon.call("node.info"))["counters"]
        assert counters["averaging.offences_forged_account"] == 1, counters
        assert counters.get("averaging.offences_wrong_average", 0) == 0, counters
        if index == victim:
            assert counters["averaging.allreduce.withheld_forgeries"] == 1, counters
            assert counters["averaging.allreduce.accusations_sent"] == 2, counters
        else:
            assert counters["averaging.allreduce.forged_accounts"] == 1, counters
        assert counters.get("averaging.allreduce.accusations_false", 0) == 0, counters
    await the_honest_three_average_without_it(daemons, bad, "withheld/1")


async def test_a_reducer_that_misstates_its_own_contribution_fails_its_audits_and_is_banned(
        daemon_factory: Any) -> None:
    """The reducer answers zeros and states its own projections so that its account agrees:
    no member can see it in the answer (nobody else has its own contribution), so all three
    apply it. After the round each member audits a random segment of its own contribution
    (audits.py): the account misstated it in every segment, so every audit fails and each member
    bans it. The honest reducers pass theirs; the next round averages the honest three."""
    daemons = await swarm(daemon_factory, "forge_own")
    bad = await applied_by_the_honest_three(daemons, "own/0")
    await banned_by_the_honest_three(daemons, bad)

    async def audits_done() -> bool:
        counters = [(await d.call("node.info"))["counters"] for d in daemons[:3]]
        return all(c.get("averaging.allreduce.audits_passed", 0) == 2 for c in counters)

    await wait_until(audits_done, timeout=60)  # each honest member audited the two honest reducers
    for daemon in daemons[:3]:
        counters = (await daemon.call("node.info"))["counters"]
        assert counters["averaging.allreduce.audits_failed"] == 1, counters
        assert counters["averaging.offences_forged_account"] == 1, counters
        assert counters.get("averaging.allreduce.audits_unanswered", 0) == 0, counters

    await the_honest_three_average_without_it(daemons, bad, "own/1")


async def test_a_reducer_that_tells_each_member_another_account_is_proven_by_comparing_them(
        daemon_factory: Any) -> None:
    """The reducer answers zeros and sends each member an account in which that member's own
    entry is true and another sender's is forged to agree (the same answer, the same signs):
    every member's check passes and all three apply it, and its own entry passes the audits.
    After the round the members tell each other what the reducer signed (answers.py): two
    signed accounts for one chunk prove it, and each member bans it."""
    daemons = await swarm(daemon_factory, "equivocate")
    bad = await applied_by_the_honest_three(daemons, "equivocal/0")  # each saw a true own entry
    await banned_by_the_honest_three(daemons, bad)
    for daemon in daemons[:3]:
        counters = (await daemon.call("node.info"))["counters"]
        # (proven by each of the two other honest members' summaries)
        assert counters["averaging.offences_equivocation"] >= 1, counters
        assert counters["averaging.allreduce.equivocations"] >= 1, counters
        assert counters.get("averaging.allreduce.accusations_sent", 0) == 0, counters
        assert counters.get("averaging.allreduce.audits_failed", 0) == 0, counters
    await the_honest_three_average_without_it(daemons, bad, "equivocal/1")
