"""The test-only switch DEDLOC_TEST_CLAIMED_WEIGHT (corruption.py) that makes a real daemon claim
an averaging weight of its choosing (benchmarks/hostile.py's `weight` attack): refused without
DEDLOC_TESTING=1, and honoured by the averager with it. averaging.average over the control API
takes no weight bound (the local caller is trusted; a run's engine sets one), so two daemons
averaging there show the claim at work: the honest one ends with the liar's vector."""

from __future__ import annotations

import asyncio
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest
from support import p2p_address, wait_until

from dedloc.daemon.averaging.corruption import claimed_weight_from_environment

LENGTH = 50_000


def test_the_switch_needs_the_testing_flag_and_a_positive_weight() -> None:
    assert claimed_weight_from_environment({}) is None
    assert claimed_weight_from_environment({"DEDLOC_TEST_CLAIMED_WEIGHT": "1e15"}) is None
    assert claimed_weight_from_environment(
        {"DEDLOC_TEST_CLAIMED_WEIGHT": " 1e15 ", "DEDLOC_TESTING": "1"}) == 1e15
    for bad in ("0", "-3", "inf", "nan", "heavy"):
        with pytest.raises(ValueError):
            claimed_weight_from_environment({"DEDLOC_TEST_CLAIMED_WEIGHT": bad, "DEDLOC_TESTING": "1"})


@pytest.mark.parametrize("testing", [True, False])
async def test_a_daemon_with_the_switch_weights_its_vector_by_the_claim(
        daemon_factory: Any, testing: bool) -> None:
    honest = await daemon_factory()
    env = {"DEDLOC_TEST_CLAIMED_WEIGHT": "1e6", **({"DEDLOC_TESTING": "1"} if testing else {})}
    liar = await daemon_factory("--net.bootstrap", await p2p_address(honest), name="liar", env=env)

    async def joined() -> bool:
        infos = [await d.call("node.info") for d in (honest, liar)]
        return all(info["dht"]["joined"] for info in infos)

    await wait_until(joined, timeout=60)
    vectors = [np.full(LENGTH, 1.0, np.float32), np.full(LENGTH, 3.0, np.float32)]
    shms = [shared_memory.SharedMemory(create=True, size=LENGTH * 4) for _ in vectors]
    try:
        for shm, vector in zip(shms, vectors, strict=True):
            np.ndarray(LENGTH, np.float32, shm.buf)[:] = vector
        reports = await asyncio.gather(*(daemon.call("averaging.average", {
            "key": "weight/0", "buffer": shm.name, "length": LENGTH, "weight": 1.0,
            "expected_peers": 2, "window": 5, "timeout": 60}, timeout=90)
            for daemon, shm in zip((honest, liar), shms, strict=True)))
        results = [np.ndarray(LENGTH, np.float32, shm.buf).copy() for shm in shms]
    finally:
        for shm in shms:
            shm.close()
            shm.unlink()
    assert all(r["group_size"] == 2 and not r["failed_parts"] for r in reports), reports
    expected = (1.0 + 3.0 * 1e6) / (1.0 + 1e6) if testing else 2.0
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=1e-5)
