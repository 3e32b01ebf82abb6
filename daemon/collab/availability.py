"""When a volunteer's machine may train: paused by hand, outside the set hours, or while the
machine's owner is using it.

- `TrainingHours`: windows of local time like "22:00-07:00,12:00-13:30" (a window may cross
  midnight); empty: always.
- `IdleMonitor`: the share of the machine's CPU time used by everything *but* this daemon and its
  workers, from /proc/stat and /proc/<pid>/stat; the machine counts as idle once that share stayed
  below a threshold for a while (and busy again as soon as one sample is above it).
- `Availability`: the three together; `blocked()` says why the runs may not train now, or None.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

import structlog

from .. import timebase

log = structlog.get_logger(__name__)

_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")
MINUTES_PER_DAY = 24 * 60


@dataclass(frozen=True)
class TrainingHours:
    """Windows of local time, as (start, end) minutes after midnight; end < start crosses midnight."""

    windows: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> TrainingHours:
        """ "HH:MM-HH:MM[,HH:MM-HH:MM...]" (empty: always); ValueError saying what is wrong."""
        windows = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = _WINDOW.match(part)
            if match is None:
                raise ValueError(f"training hours {part!r}: write HH:MM-HH:MM, e.g. 22:00-07:00")
            h1, m1, h2, m2 = (int(g) for g in match.groups())
            if h1 > 24 or h2 > 24 or m1 > 59 or m2 > 59 or (h1 == 24 and m1) or (h2 == 24 and m2):
                raise ValueError(f"training hours {part!r}: not a time of day")
            start, end = h1 * 60 + m1, h2 * 60 + m2
            if start == end:
                raise ValueError(f"training hours {part!r}: an empty window (for always, leave "
                                 "the setting empty)")
            windows.append((start % MINUTES_PER_DAY, end % MINUTES_PER_DAY or MINUTES_PER_DAY))
        return cls(tuple(windows))

    def allows(self, when: datetime) -> bool:
        if not self.windows:
            return True
        minute = when.hour * 60 + when.minute
        for start, end in self.windows:
            if start < end and start <= minute < end:
                return True
            if start > end and (minute >= start or minute < end):
                return True
        return False

    def describe(self) -> str:
        return ",".join(f"{s // 60:02d}:{s % 60:02d}-{e // 60:02d}:{e % 60:02d}"
                        for s, e in self.windows) or "always"


def _total_jiffies(stat: str) -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine from /proc/stat's first line."""
    fields = [int(x) for x in stat.split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def _process_jiffies(pid: int) -> int:
    """utime + stime of `pid` and of its waited-for children (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return 0
    fields = text.rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15])  # utime stime cutime cstime


class IdleMonitor:
    """Whether the machine is idle apart from us (see the module docstring)."""

    def __init__(self, own_pids: Callable[[], Iterable[int]], threshold: float = 0.25,
                 idle_seconds: float = 300.0, clock: Callable[[], float] = timebase.monotonic,
                 read_stat: Callable[[], str] | None = None,
                 read_pid: Callable[[int], int] = _process_jiffies) -> None:
        self.own_pids = own_pids
        self.threshold = threshold
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._read_stat = read_stat or (lambda: open("/proc/stat").read())  # noqa: SIM115
        self._read_pid = read_pid
        self._last: tuple[int, int, dict[int, int]] | None = None
        self._idle_since: float | None = None
        self.others_share: float | None = None

    def sample(self) -> None:
        """Take one measurement (call every few seconds)."""
        try:
            busy, total = _total_jiffies(self._read_stat())
        except (OSError, ValueError, IndexError) as exc:
            log.warning("idle_monitor_unavailable", error=str(exc))
            return
        own = {pid: self._read_pid(pid) for pid in set(self.own_pids())}
        if self._last is not None:
            last_busy, last_total, last_own = self._last
            elapsed = total - last_total
            if elapsed > 0:
                ours = sum(max(0, j - last_own.get(pid, j)) for pid, j in own.items())
                self.others_share = max(0.0, (busy - last_busy - ours) / elapsed)
                now = self._clock()
                if self.others_share < self.threshold:
                    self._idle_since = self._idle_since if self._idle_since is not None else now
                else:
                    self._idle_since = None
        self._last = (busy, total, own)

    def idle(self) -> bool:
        return self._idle_since is not None and self._clock() - self._idle_since >= self.idle_seconds


@dataclass
class Availability:
    """Why this daemon's runs may not train now (None: they may)."""

    hours: TrainingHours
    idle: IdleMonitor | None = None
    paused_by: str | None = None  # why the volunteer paused (dedloc pause), or None
    clock: Callable[[], datetime] = datetime.now

    def blocked(self) -> str | None:
        if self.paused_by is not None:
            return self.paused_by
        if not self.hours.allows(self.clock()):
            return f"outside the training hours ({self.hours.describe()})"
        if self.idle is not None and not self.idle.idle():
            share = self.idle.others_share
            used = "" if share is None else f" (others use {share:.0%} of the CPU)"
            return f"waiting for the machine to be idle{used}"
        return None


def own_process_tree(root: int | None = None) -> list[int]:
    """This process and its descendants (the daemon and its workers and their replicas)."""
    root = root or os.getpid()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    todo.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return found
