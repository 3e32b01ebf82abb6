"""systemd's notify protocol (sd_notify) over the datagram socket in $NOTIFY_SOCKET.

Without $NOTIFY_SOCKET every call does nothing, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket
import typing

import structlog

log = structlog.get_logger(__name__)


class SystemdNotifier:
    def __init__(self, env: typing.Mapping[str, str] = os.environ) -> None:
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None
        self._socket: socket.socket | None = None
        self._failed = False
        self._watchdog_seconds = _watchdog_seconds(env)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), None if not asked for."""
        return None if self._watchdog_seconds is None else self._watchdog_seconds / 2

    def notify(self, *assignments: str) -> bool:
        """Send one datagram of NAME=value lines; False if not under systemd or it failed."""
        if self._address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.setblocking(False)
            self._socket.sendto(message, self._address)
        except OSError as exc:
            if not self._failed:  # say it once, not on every watchdog ping
                log.warning("sd_notify_failed", socket=self._address, error=str(exc))
                self._failed = True
            return False
        return True

    async def ping_watchdog(self) -> None:
        """Ping the watchdog until cancelled; a blocked event loop stops the pings (as it should)."""
        interval = self.watchdog_interval
        if interval is None or not self.enabled:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _watchdog_seconds(env: typing.Mapping[str, str]) -> float | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 1_000_000
