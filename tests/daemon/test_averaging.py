"""averaging.average through real daemons: exact weighted averages, compression, peers killed."""

from __future__ import annotations

import asyncio
import os
import signal
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest
from support import DaemonProcess, p2p_address, wait_until

from dedloc.daemon.averaging.compression import get_codec
from dedloc.rpc import RpcCallError

CHUNK_BYTES = 64 << 10  # small chunks: many flow, and the vector size is not a multiple


async def swarm(daemon_factory: Any, count: int) -> list[DaemonProcess]:
    first = await daemon_factory("--averaging.chunk_bytes", str(CHUNK_BYTES))
    address = await p2p_address(first)
    others = await asyncio.gather(*(daemon_factory("--averaging.chunk_bytes", str(CHUNK_BYTES),
                                                   "--net.bootstrap", address)
                                    for _ in range(count - 1)))
    daemons = [first, *others]

    async def averagers_ready() -> bool:
        for daemon in daemons:
            try:
                await daemon.call("averaging.status")
            except RpcCallError:  # still joining
                return False
        return True

    await wait_until(averagers_ready, timeout=60)
    return daemons


class Buffers:
    def __init__(self, vectors: list[np.ndarray]) -> None:
        self.length = vectors[0].size
        self.shms = [shared_memory.SharedMemory(create=True, size=v.nbytes) for v in vectors]
        for shm, vector in zip(self.shms, vectors, strict=True):
            self.view(shm)[:] = vector

    def view(self, shm: shared_memory.SharedMemory) -> np.ndarray:
        return np.ndarray(self.length, np.float32, shm.buf)

    def results(self) -> list[np.ndarray]:
        return [self.view(shm).copy() for shm in self.shms]

    def close(self) -> None:
        for shm in self.shms:
            shm.close()
            shm.unlink()


async def average_all(daemons: list[DaemonProcess], buffers: Buffers, key: str, weights: list[float],
                      roles: list[str] | None = None, **options: Any) -> list[Any]:
    roles = roles or ["trainer"] * len(daemons)

    async def one(daemon: DaemonProcess, shm: Any, weight: float, role: str) -> Any:
        return await daemon.call("averaging.average", {
            "key": key, "buffer": shm.name, "length": buffers.length, "weight": weight, "role": role,
            "expected_peers": len(daemons), "timeout": 60, **options}, timeout=90)

    return await asyncio.gather(*(one(d, s, w, r) for d, s, w, r in
                                  zip(daemons, buffers.shms, weights, roles, strict=True)),
                                return_exceptions=True)


@pytest.mark.parametrize("count", [2, 3, 5])
async def test_weighted_average_is_exact(daemon_factory: Any, count: int) -> None:
    daemons = await swarm(daemon_factory, count)
    rng = np.random.default_rng(count)
    length = 3 * (CHUNK_BYTES // 4) * count + 1234  # not a multiple of the chunk
    vectors = [rng.standard_normal(length, dtype=np.float32) * (i + 1) for i in range(count)]
    weights = [float(i + 1) ** 2 for i in range(count)]
    buffers = Buffers(vectors)
    try:
        reports = await average_all(daemons, buffers, f"exact-{count}", weights)
        expected = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=weights)
        for report, result in zip(reports, buffers.results(), strict=True):
            assert report["group_size"] == count and not report["failed_parts"], report
            np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
        assert len({r["group_id"] for r in reports}) == 1
        assert sum(b - a for a, b in [r["part"] for r in reports]) == length
        status = await daemons[0].call("averaging.status")
        assert status["rounds"][-1]["group_id"] == reports[0]["group_id"]
    finally:
        buffers.close()


@pytest.mark.parametrize("compression", ["fp16", "uint8", "quantile8"])
async def test_compression_error_within_bound(daemon_factory: Any, compression: str) -> None:
    daemons = await swarm(daemon_factory, 3)
    rng = np.random.default_rng(1)
    length = 200_003
    vectors = [rng.standard_normal(length, dtype=np.float32) for _ in range(3)]
    buffers = Buffers(vectors)
    try:
        reports = await average_all(daemons, buffers, f"lossy-{compression}", [1.0, 1.0, 1.0],
                                    compression=compression)
        expected = np.mean(np.stack(vectors), axis=0)
        codec = get_codec(compression)
        chunk = CHUNK_BYTES // 4
        results = buffers.results()
        for report in reports:
            assert not report["failed_parts"], report
        for result in results:
            np.testing.assert_array_equal(result, results[0])  # every member got the same bytes
        for start in range(0, length, chunk):
            sl = slice(start, start + chunk)
            # Two quantisations at most: each sender's chunk on the way in, the average on the way
            # back; the average of errors is bounded by the largest sender's bound.
            inbound = max(codec.error_bound(v[sl]) for v in vectors)
            outbound = codec.error_bound(expected[sl].astype(np.float32))
            error = np.max(np.abs(results[0][sl] - expected[sl]))
            assert error <= inbound + outbound + 1e-6, (start, error, inbound, outbound)
    finally:
        buffers.close()


async def stop_when_grouped(victim: DaemonProcess, key: str) -> None:
    """Freeze the victim as soon as it knows its group (mid-round, before it can finish), then kill."""

    async def grouped() -> bool:
        return any(e.get("event") == "averaging_group_ready" and e.get("key") == key
                   for e in victim.events())

    await wait_until(grouped, timeout=60, interval=0.01)
    os.kill(victim.process.pid, signal.SIGSTOP)
    await asyncio.sleep(0.3)
    os.kill(victim.process.pid, signal.SIGKILL)


async def test_a_sender_killed_mid_round(daemon_factory: Any) -> None:
    daemons = await swarm(daemon_factory, 5)
    victim = daemons[4]  # a client: it only sends
    rng = np.random.default_rng(5)
    length = 2_000_000
    vectors = [rng.standard_normal(length, dtype=np.float32) for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    buffers = Buffers(vectors)
    try:
        killer = asyncio.create_task(stop_when_grouped(victim, "sender-dies"))
        reports = await average_all(daemons, buffers, "sender-dies", weights,
                                    roles=["trainer"] * 4 + ["client"])
        await killer
        survivors = reports[:4]
        results = buffers.results()[:4]
        assert all(isinstance(r, dict) for r in survivors), survivors
        stacked = np.stack(vectors).astype(np.float64)
        with_victim = np.average(stacked, axis=0, weights=weights)
        without = np.average(stacked[:4], axis=0, weights=weights[:4])
        for result in results:
            np.testing.assert_array_equal(result, results[0])  # identical everywhere
        chunk = CHUNK_BYTES // 4
        for start in range(0, length, chunk):
            sl = slice(start, start + chunk)
            got = results[0][sl]
            assert (np.allclose(got, with_victim[sl], rtol=1e-5, atol=1e-5)
                    or np.allclose(got, without[sl], rtol=1e-5, atol=1e-5)), start
        assert not np.allclose(results[0], with_victim, rtol=1e-5, atol=1e-5)  # it was left out
        assert any(r["senders_excluded"] for r in survivors)
    finally:
        buffers.close()


async def test_a_reducer_killed_mid_round(daemon_factory: Any) -> None:
    daemons = await swarm(daemon_factory, 5)
    victim = daemons[4]  # an auxiliary peer: it only reduces
    rng = np.random.default_rng(6)
    length = 2_000_000
    vectors = [rng.standard_normal(length, dtype=np.float32) for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 0.0]
    buffers = Buffers(vectors)
    try:
        killer = asyncio.create_task(stop_when_grouped(victim, "reducer-dies"))
        reports = await average_all(daemons, buffers, "reducer-dies", weights,
                                    roles=["trainer"] * 4 + ["aux"])
        await killer
        survivors = reports[:4]
        assert all(isinstance(r, dict) for r in survivors), survivors
        results = buffers.results()[:4]
        expected = np.average(np.stack(vectors[:4]).astype(np.float64), axis=0, weights=weights[:4])
        lost = np.zeros(length, dtype=bool)
        for report, result, original in zip(survivors, results, vectors[:4], strict=True):
            assert report["failed_parts"], report  # the aux's part was not averaged, and it says so
            mine = np.zeros(length, dtype=bool)
            for start, end in report["failed_parts"]:
                mine[start:end] = True
                np.testing.assert_array_equal(result[start:end], original[start:end])  # kept local
            lost |= mine
        reduced = ~lost
        for result in results:
            np.testing.assert_allclose(result[reduced], expected[reduced], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(result[reduced], results[0][reduced])
    finally:
        buffers.close()


async def test_bad_buffers_are_refused(daemon_factory: Any) -> None:
    (daemon,) = await swarm(daemon_factory, 1)
    from dedloc.rpc import ErrorCode

    for params in ({"buffer": "no-such-buffer", "length": 10},
                   {"buffer": "../etc/passwd", "length": 10}):
        with pytest.raises(RpcCallError) as caught:
            await daemon.call("averaging.average", {"key": "k", **params})
        assert caught.value.code == ErrorCode.BUFFER_ERROR
    small = shared_memory.SharedMemory(create=True, size=40)
    try:
        with pytest.raises(RpcCallError) as caught:
            await daemon.call("averaging.average", {"key": "k", "buffer": small.name, "length": 11})
        assert caught.value.code == ErrorCode.BUFFER_ERROR
        np.ndarray(10, np.float32, small.buf)[:] = np.nan
        with pytest.raises(RpcCallError) as caught:
            await daemon.call("averaging.average", {"key": "k", "buffer": small.name, "length": 10})
        assert caught.value.code == ErrorCode.BUFFER_ERROR
        np.ndarray(10, np.float32, small.buf)[:] = 1.5
        alone = await daemon.call("averaging.average", {"key": "k", "buffer": small.name, "length": 10,
                                                        "window": 0.2})
        assert alone["group_size"] == 1
        assert np.all(np.ndarray(10, np.float32, small.buf) == 1.5)
    finally:
        small.close()
        small.unlink()
