"""Bandwidth caps through real daemons: config, node.set_bandwidth, the CLI, and an averaging round
whose upload a cap set at run time holds back."""

from __future__ import annotations

import asyncio
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import orjson
import pytest
from support import DaemonProcess, dedloc_cli, p2p_address, wait_until

from dedloc.daemon.config import build_config, render_default_config
from dedloc.daemon.errors import ConfigError
from dedloc.rpc import RpcCallError

MB = 1_000_000


dedloc = dedloc_cli


async def test_caps_from_config_and_json_rpc(daemon_factory: Any) -> None:
    daemon = await daemon_factory("--net.upload_bytes_per_second", "1000000")
    caps = await daemon.call("node.bandwidth")
    assert caps["upload_bytes_per_second"] == 1 * MB and caps["download_bytes_per_second"] == 0
    caps = await daemon.call("node.set_bandwidth", {"download_bytes_per_second": 500_000})
    assert caps["upload_bytes_per_second"] == 1 * MB and caps["download_bytes_per_second"] == 500_000
    counters = (await daemon.call("node.info"))["counters"]
    assert counters["net.upload_cap_bytes_per_second"] == 1 * MB
    assert counters["net.download_cap_bytes_per_second"] == 500_000
    assert counters["net.throttled_ms_up"] >= 0 and "net.throttled_ms_down" in counters
    for bad in ({"upload_bytes_per_second": -1}, {"upload_bytes_per_second": 100},
                {"download_bytes_per_second": "fast"}):
        with pytest.raises(RpcCallError) as caught:
            await daemon.call("node.set_bandwidth", bad)
        assert caught.value.message == "Invalid params"
    assert (await daemon.call("node.bandwidth"))["upload_bytes_per_second"] == 1 * MB  # unchanged
    caps = await daemon.call("node.set_bandwidth", {"upload_bytes_per_second": 0})
    assert caps["upload_bytes_per_second"] == 0 and caps["download_bytes_per_second"] == 500_000


def test_caps_in_the_config_are_checked_and_documented() -> None:
    config = build_config(overrides={"net.upload_bytes_per_second": 4 * MB})
    assert config.net.upload_bytes_per_second == 4 * MB and config.net.download_bytes_per_second == 0
    for bad in (-1, 10, float("inf")):
        with pytest.raises(ConfigError, match=r"net\.download_bytes_per_second"):
            build_config(overrides={"net.download_bytes_per_second": bad})
    text = render_default_config()
    assert "upload_bytes_per_second = 0.0" in text and "download_bytes_per_second = 0.0" in text


async def test_cli_shows_and_sets_the_caps(daemon: DaemonProcess) -> None:
    socket = daemon.socket_path
    code, out, _ = await dedloc(socket, "bandwidth")
    assert code == 0 and "upload: no cap" in out and "download: no cap" in out
    code, out, _ = await dedloc(socket, "bandwidth", "--upload", "10MB/s", "--download", "80Mbit/s")
    assert code == 0, out
    assert "upload: 10 MB/s (80 Mbit/s)" in out and "download: 10 MB/s (80 Mbit/s)" in out
    code, out, _ = await dedloc(socket, "--json", "bandwidth", "--download", "500KB/s")
    assert code == 0
    caps = orjson.loads(out)
    assert caps["upload_bytes_per_second"] == 10 * MB and caps["download_bytes_per_second"] == 500_000
    code, out, _ = await dedloc(socket, "bandwidth", "--upload", "off")
    assert code == 0 and "upload: no cap" in out and "download: 500 KB/s (4 Mbit/s)" in out
    code, _, err = await dedloc(socket, "bandwidth", "--upload", "lots")
    assert code == 2 and "not a rate" in err
    code, _, err = await dedloc(socket, "bandwidth", "--upload", "1KB/s")  # under 16 KiB/s
    assert code == 1 and "16384" in err
    status = await daemon.call("node.bandwidth")
    assert status["upload_bytes_per_second"] == 0 and status["download_bytes_per_second"] == 500_000


async def test_a_cap_set_at_run_time_holds_an_averaging_round(daemon_factory: Any) -> None:
    """Two daemons average a 16 MiB vector; the first one's upload is capped through JSON-RPC
    first: its averaging advertises the cap, and it sends no faster than the cap."""
    first = await daemon_factory()
    second = await daemon_factory("--net.bootstrap", await p2p_address(first))

    async def ready() -> bool:
        try:
            for daemon in (first, second):
                await daemon.call("averaging.status")
        except RpcCallError:
            return False
        return True

    await wait_until(ready, timeout=60)
    cap = 2 * MB
    await first.call("node.set_bandwidth", {"upload_bytes_per_second": cap})
    status = await first.call("averaging.status")
    assert status["bandwidth"]["advertised"]["upload_bytes_per_second"] == cap
    length = 4 * 1024 * 1024  # 16 MiB of float32: with two peers each sends the whole size
    rng = np.random.default_rng(0)
    vectors = [rng.standard_normal(length, dtype=np.float32) for _ in range(2)]
    shms = [shared_memory.SharedMemory(create=True, size=v.nbytes) for v in vectors]
    try:
        for shm, vector in zip(shms, vectors, strict=True):
            np.ndarray(length, np.float32, shm.buf)[:] = vector
        reports = await asyncio.gather(*(daemon.call("averaging.average", {
            "key": "capped", "buffer": shm.name, "length": length, "expected_peers": 2,
            "timeout": 90}, timeout=120) for daemon, shm in zip((first, second), shms, strict=True)))
        for report in reports:
            assert report["group_size"] == 2 and not report["failed_parts"], report
        expected = (vectors[0] + vectors[1]) / 2
        for shm in shms:
            np.testing.assert_allclose(np.ndarray(length, np.float32, shm.buf), expected, rtol=1e-5,
                                       atol=1e-6)
    finally:
        for shm in shms:
            shm.close()
            shm.unlink()
    sent, seconds = reports[0]["bytes_sent"], reports[0]["allreduce_seconds"]
    rate = sent / seconds
    print(f"averaging with a {cap} B/s upload cap: sent {sent} bytes in {seconds:.2f} s, "
          f"{rate:.0f} B/s ({rate / cap:.3f} x cap)")
    assert sent >= length * 4 * 0.99
    assert rate <= 1.1 * cap
    counters = (await first.call("node.info"))["counters"]
    assert counters["net.throttled_ms_up"] > 1000 and counters["net.throttled_bytes_up"] > 0
