"""sd_notify against a real datagram socket, as systemd would provide it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from support import NotifyListener

from dedloc.daemon.sdnotify import SystemdNotifier


async def test_notifier_sends_to_the_socket(short_tmp: Path) -> None:
    listener = NotifyListener(short_tmp / "n.sock")
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "200000",
                                "WATCHDOG_PID": str(os.getpid())})
    assert notifier.enabled and notifier.watchdog_interval == 0.1
    assert notifier.notify("READY=1", "STATUS=ok")
    pinging = asyncio.create_task(notifier.ping_watchdog())
    await listener.wait_for("WATCHDOG=1", timeout=10)
    pinging.cancel()
    await listener.wait_for("STATUS=ok", timeout=10)
    assert "READY=1\nSTATUS=ok" in listener.messages
    notifier.close()
    listener.close()


def test_without_systemd_nothing_is_sent() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    assert not notifier.notify("READY=1")


def test_watchdog_for_another_pid_is_ignored() -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert notifier.watchdog_interval is None


async def test_daemon_notifies_ready_watchdog_stopping(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    daemon = await daemon_factory(env={"WATCHDOG_USEC": "400000"})
    await daemon.notify.wait_for("READY=1")
    await daemon.notify.wait_for("WATCHDOG=1", timeout=30)
    assert any(line.startswith("STATUS=") for line in daemon.notify.assignments())
    assert await daemon.terminate() == 0
    assert "STOPPING=1" in daemon.notify.assignments()
