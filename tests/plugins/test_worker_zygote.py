"""Workers forked from a zygote (plugins/worker/zygote.py) behave, seen from the daemon's side, as
workers it started itself: the stand-in it owns serves through the real worker, passes signals
on, and exits as the worker did; a stand-in that dies takes its worker along."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from dedloc.plugins.worker.main import ZYGOTE_ENV

SAFETY_TIMEOUT = 120.0


# as tests/plugins/conftest.py starts workers: a zygote forks only for stand-ins whose start-up
# variables match its own (stand_in.START_UP_ENV)
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start_zygote(socket_path: Path, *args: str, program: tuple[str, ...] = (
        "-m", "dedloc.plugins.worker.zygote")) -> subprocess.Popen[bytes]:
    """A zygote listening at `socket_path` (torch preloaded only: the tests check the handing
    over, not the start's cost)."""
    process = subprocess.Popen(
        [sys.executable, *program, "--socket", str(socket_path), "--preload", "torch", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env={**os.environ, **THREAD_ENV})
    assert process.stdout is not None
    line = process.stdout.readline()  # after the preload: it listens
    assert orjson.loads(line)["listening"] == str(socket_path), line
    return process


def stop_zygote(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait(SAFETY_TIMEOUT)
    if process.stdout is not None:
        process.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    folder = Path(tempfile.mkdtemp(prefix="dlz-", dir="/tmp"))
    socket_path = folder / "z.sock"
    process = start_zygote(socket_path)
    yield process, socket_path
    stop_zygote(process)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def through_zygote(zygote: tuple[subprocess.Popen[bytes], Path],
                   monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv(ZYGOTE_ENV, str(zygote[1]))
    return zygote[0].pid


def parent_of(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


async def gone(pid: int) -> None:
    """Return once process `pid` has exited (a pidfd turns readable then)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, exited.set)
    try:
        async with asyncio.timeout(SAFETY_TIMEOUT):
            await exited.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_a_forked_worker_serves_and_its_stand_in_exits_as_it_did(
        launch: Callable[..., Any], through_zygote: int) -> None:
    worker = launch()
    client = await worker.connect()
    hello = await client.call("worker.hello")
    real_pid = hello["pid"]
    assert real_pid != worker.process.pid
    assert parent_of(real_pid) == through_zygote  # forked, not started by the stand-in
    assert os.readlink(f"/proc/{real_pid}/cwd") == os.getcwd()
    numel = (await client.call("worker.load", {"workload": "tiny"}))["total_numel"]
    assert numel > 0
    assert (await client.call("worker.train", {"samples": 64}))["samples"] == 64
    assert await client.call("worker.stop") == {}
    assert await worker.wait() == 0, worker.log()
    await client.close()
    await gone(real_pid)
    assert '"event":"worker_stopped"' in worker.log()  # the worker wrote to the stand-in's stderr


async def test_sigterm_to_the_stand_in_reaches_the_worker(launch: Callable[..., Any],
                                                         through_zygote: int) -> None:
    worker = launch()
    client = await worker.connect()
    real_pid = (await client.call("worker.hello"))["pid"]
    worker.process.send_signal(signal.SIGTERM)
    assert await worker.wait() == 0, worker.log()
    assert "stop requested" in worker.log()
    await client.close()
    await gone(real_pid)


async def test_a_killed_stand_in_takes_its_worker_along(launch: Callable[..., Any],
                                                        through_zygote: int) -> None:
    worker = launch()
    client = await worker.connect()
    real_pid = (await client.call("worker.hello"))["pid"]
    worker.process.kill()
    assert await worker.wait() == -signal.SIGKILL
    await gone(real_pid)
    await client.close()


async def test_a_worker_killed_by_a_signal_kills_its_stand_in_the_same_way(
        launch: Callable[..., Any], through_zygote: int) -> None:
    worker = launch()
    client = await worker.connect()
    real_pid = (await client.call("worker.hello"))["pid"]
    os.kill(real_pid, signal.SIGKILL)  # as the kernel's OOM killer would
    assert await worker.wait() == -signal.SIGKILL
    await client.close()


def list_workloads(env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "dedloc.plugins.worker", "--list-workloads"],
                          env=env, capture_output=True, timeout=SAFETY_TIMEOUT, check=False)


def test_without_a_zygote_the_worker_runs_itself(short_tmp: Path) -> None:
    done = list_workloads({**os.environ, ZYGOTE_ENV: str(short_tmp / "none.sock")})
    assert done.returncode == 0, done.stderr
    assert "tiny" in {entry["name"] for entry in orjson.loads(done.stdout)["workloads"]}
    assert b"worker_zygote_unused" not in done.stderr  # (none listens yet: not worth a line)


def test_a_stand_in_that_differs_at_start_up_is_refused_and_runs_the_worker_itself(
        zygote: tuple[subprocess.Popen[bytes], Path]) -> None:
    # a forked worker would keep the zygote's hash seed, which is read at the interpreter's start
    done = list_workloads({**os.environ, **THREAD_ENV, ZYGOTE_ENV: str(zygote[1]),
                           "PYTHONHASHSEED": "12345"})
    assert done.returncode == 0, done.stderr
    assert "tiny" in {entry["name"] for entry in orjson.loads(done.stdout)["workloads"]}
    (line,) = [orjson.loads(line) for line in done.stderr.splitlines() if b"zygote" in line]
    assert line["event"] == "worker_zygote_unused" and "PYTHONHASHSEED" in line["reason"]


async def test_a_vanished_zygote_leaves_no_worker_behind(launch: Callable[..., Any],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         short_tmp: Path) -> None:
    socket_path = short_tmp / "z.sock"
    process = start_zygote(socket_path)
    try:
        monkeypatch.setenv(ZYGOTE_ENV, str(socket_path))
        worker = launch()
        client = await worker.connect()
        real_pid = (await client.call("worker.hello"))["pid"]
        assert real_pid != worker.process.pid
        process.kill()
        assert await worker.wait() == -signal.SIGKILL  # its stand-in killed it, then died alike
        await gone(real_pid)
        await client.close()
    finally:
        stop_zygote(process)


@pytest.mark.parametrize(("request_bytes", "reason"), [
    (b"", b"hung up"),                                     # hangs up at once
    (b"\x00\x00\x00\x05[1,2]", b"one JSON object"),        # not an object
    (b"\xff\xff\xff\xffxx", b"over"),                       # a length over the bound
    (b"\x00\x00\x00\x22{\"argv\": 1, \"env\": {}, \"cwd\": \"/\"}", b"argv"),  # (34 bytes)
])
def test_a_bad_request_is_refused_and_the_zygote_serves_on(
        zygote: tuple[subprocess.Popen[bytes], Path], request_bytes: bytes, reason: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(SAFETY_TIMEOUT)
        sock.connect(str(zygote[1]))
        if request_bytes:
            socket.send_fds(sock, [request_bytes], [0, 1, 2])
        sock.shutdown(socket.SHUT_WR)
        answer = orjson.loads(sock.makefile("rb").readline())
    assert "pid" not in answer and reason in answer["error"].encode(), answer
    assert zygote[0].poll() is None
    done = list_workloads({**os.environ, **THREAD_ENV, ZYGOTE_ENV: str(zygote[1])})
    assert done.returncode == 0, done.stderr
    assert b"worker_zygote_unused" not in done.stderr  # served by the zygote


REPORTING_ZYGOTE = """
import os, random, sys
import torch
from dedloc.plugins.worker.zygote import main

def report(argv):
    sys.stdout.write(f"{torch.initial_seed()} {random.random()} {os.getcwd()} "
                     f"{os.environ.get('DEDLOC_TEST_MARK')} {' '.join(argv)}\\n")
    return 3

sys.exit(main(sys.argv[1:], run_worker=report))
"""


def test_a_forked_process_has_its_stand_ins_directory_environment_and_fresh_seeds(
        short_tmp: Path) -> None:
    socket_path = short_tmp / "z.sock"
    process = start_zygote(socket_path, program=("-c", REPORTING_ZYGOTE))
    try:
        lines = []
        for mark in ("one", "two"):
            folder = short_tmp / mark
            folder.mkdir()
            done = subprocess.run(
                [sys.executable, "-m", "dedloc.plugins.worker", "--socket", "x", "--threads", "2"],
                env={**os.environ, **THREAD_ENV, ZYGOTE_ENV: str(socket_path),
                     "DEDLOC_TEST_MARK": mark},
                cwd=folder, capture_output=True, timeout=SAFETY_TIMEOUT, check=False)
            assert done.returncode == 3, done.stderr  # the forked process's exit code
            torch_seed, draw, cwd, seen_mark, argv = done.stdout.decode().split(" ", 4)
            assert (cwd, seen_mark, argv.strip()) == (str(folder), mark, "--socket x --threads 2")
            lines.append((torch_seed, draw))
        assert lines[0][0] != lines[1][0] and lines[0][1] != lines[1][1]
    finally:
        stop_zygote(process)


BREAKING_ZYGOTE = """
import os, signal, sys
from dedloc.plugins.worker.zygote import main

def run(argv):
    if "--break" in argv:  # as a worker whose daemon died: its stderr reads nowhere, or is gone
        os.close(1)
        os.close(2)
        raise RuntimeError("no one reads this")
    sys.stdout.write("forked\\n")
    sys.stdout.flush()
    while True:  # until the test's SIGTERM (its default action ends it)
        signal.pause()

sys.exit(main(sys.argv[1:], run_worker=run))
"""


def test_a_forked_process_that_fails_at_its_end_leaves_its_siblings_alone(short_tmp: Path) -> None:
    # A worker whose daemon was killed fails writing its last log lines; the error once unwound
    # into the zygote's loop in the forked child, whose cleanup then killed every other worker
    socket_path = short_tmp / "z.sock"
    process = start_zygote(socket_path, program=("-c", BREAKING_ZYGOTE))
    env = {**os.environ, **THREAD_ENV, ZYGOTE_ENV: str(socket_path)}
    command = [sys.executable, "-m", "dedloc.plugins.worker", "--socket", "x"]
    sibling = subprocess.Popen([*command, "--wait"], env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE)
    try:
        assert sibling.stdout is not None
        assert sibling.stdout.readline() == b"forked\n"  # the sibling is forked first
        done = subprocess.run([*command, "--break"], env=env, capture_output=True,
                              timeout=SAFETY_TIMEOUT, check=False)
        assert done.returncode == 1
        assert process.poll() is None and sibling.poll() is None  # both still there
        sibling.terminate()
        assert sibling.wait(SAFETY_TIMEOUT) == -signal.SIGTERM  # (pause has no handler)
    finally:
        sibling.kill()
        sibling.wait(SAFETY_TIMEOUT)
        if sibling.stdout is not None:
            sibling.stdout.close()
        stop_zygote(process)
