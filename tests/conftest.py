"""Fixtures that start real dedlocd processes on unix sockets in a temporary directory."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from natlab import NatLab, unavailable_reason
from support import DaemonProcess

from dedloc.daemon import timebase
from dedloc.plugins.worker.main import ZYGOTE_ENV
from dedloc.sim.clock import SkewedClock
from dedloc.sim.loop import VirtualClockLoop

# In CI the property tests draw the same examples every run (a submission must not pass or fail
# by luck); on a developer's machine they explore new ones each time. Neither has a deadline per
# example: hypothesis's default (200 ms) failed a pure test on a loaded machine.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# The modules whose tests take longest (30-130 s each on 2 shared cores: swarm scenarios, real
# daemons with torch workers, the NAT lab), heaviest first. They are handed out first, so the
# suite does not end with one process still busy with a long test that began last while the
# others sit idle (collected in file order, the simulator's and the top-level files' tests came
# last).
HEAVY_FIRST = (
    "tests/sim/test_scenarios.py",
    "tests/collab/test_chaos.py",
    "tests/net/test_network_faults.py",
    "tests/test_demo.py",
    "tests/collab/test_restart.py",
    "tests/test_benchmark_workloads.py",
    "tests/test_benchmark_local_updates.py",
    "tests/collab/test_local_updates.py",
    "tests/collab/test_leave.py",
    "tests/test_benchmark_hostile.py",
    "tests/plugins/swav/test_model.py",
    "tests/collab/test_autojoin.py",
    "tests/collab/test_join.py",
    "tests/collab/test_equivalence.py",
    "tests/test_cli.py",
    "tests/collab/test_workload_runs.py",
    "tests/daemon/test_collaboration.py",
    "tests/plugins/albert/test_albert_data.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` runs the suite in a few processes (pytest-xdist, `--dist loadgroup`): the NAT
    lab's tests share the root namespace's bridges, NAT rules and conntrack table, so they run
    one after another in one process. The heaviest modules go first (`HEAVY_FIRST`)."""
    for item in items:
        if "natlab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("natlab"))
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # (stable)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests marked `virtual_time` run on the simulator's virtual clock: their timeouts cannot
    expire because the machine is loaded, and their waits take no wall time."""
    if item.get_closest_marker("virtual_time") is not None:
        return {"virtual_time": VirtualClockLoop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture(autouse=True)
async def _virtual_clock(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """On virtual time the daemon's wall clock (timebase.now) follows the loop too."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualClockLoop):
        yield
        return
    token = timebase.use(SkewedClock(loop))
    try:
        yield
    finally:
        timebase.reset(token)


@pytest.fixture(scope="session", autouse=True)
def _worker_zygote() -> Iterator[None]:
    """One worker zygote per test process (plugins/worker/zygote.py): the ~160 torch workers the
    suite starts fork from it instead of importing torch each (about 3 s of CPU a start on this
    2-core machine's budget). Workers started before it listens, or in a network namespace of the
    NAT lab, start as usual. tests/plugins/test_worker_lifecycle.py removes the variable: it
    checks the plain start. DEDLOC_TEST_ZYGOTE=0 runs the whole suite without it."""
    if os.environ.get("DEDLOC_TEST_ZYGOTE", "1") == "0" or ZYGOTE_ENV in os.environ:
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="dl-zygote-", dir="/tmp"))  # mode 0700
    socket_path = folder / "zygote.sock"
    with (folder / "zygote.log").open("wb") as log_file:
        zygote = subprocess.Popen(
            [sys.executable, "-m", "dedloc.plugins.worker.zygote", "--socket", str(socket_path),
             "--parent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
            start_new_session=True)  # (a Ctrl-C of pytest is not its)
    os.environ[ZYGOTE_ENV] = str(socket_path)
    try:
        yield
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        zygote.terminate()
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory under /tmp: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dl-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item (fixtures read `item.failed_call`)."""
    report = yield
    if report.when == "call" and report.failed:
        item.failed_call = True  # type: ignore[attr-defined]
    return report


LOG_LINES_ON_FAILURE = 60


@pytest.fixture
async def daemon_factory(short_tmp: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """Start daemons (each in its own directory); every one is stopped after the test. When the
    test failed, the last log lines of each daemon go to the report (captured output)."""
    started: list[DaemonProcess] = []
    names = itertools.count()

    async def start(*args: str, env: dict[str, str] | None = None, name: str = "d") -> DaemonProcess:
        root = short_tmp / f"{name}{next(names)}"
        root.mkdir()
        daemon = await DaemonProcess.start(root, *args, env=env)
        started.append(daemon)
        return daemon

    yield start
    if getattr(request.node, "failed_call", False):
        for index, daemon in enumerate(started):
            lines = daemon.log_lines[-LOG_LINES_ON_FAILURE:]
            print(f"--- daemon {index} ({daemon.root}): last {len(lines)} log lines ---")
            print("\n".join(lines))
            print(f"--- daemon {index}: its threads' stacks now ---")
            print(await daemon.dump_stacks())
    for daemon in started:
        await daemon.kill()  # also closes what a daemon that already exited left open


@pytest.fixture
async def daemon(daemon_factory: Any) -> DaemonProcess:
    return await daemon_factory()


@pytest.fixture
async def natlab() -> AsyncIterator[NatLab]:
    """A small internet in network namespaces (tests/natlab.py), removed after the test.

    Needs root and working `ip netns` (`make system-deps` installs the tools): elsewhere the test
    is skipped, except in CI, where a missing capability is a failure.
    """
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"natlab: {reason}", pytrace=False)
        pytest.skip(f"natlab: {reason}")
    lab = NatLab()
    try:
        yield lab
    finally:
        await lab.aclose()
