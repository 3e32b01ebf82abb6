"""The volunteer's limits, pure: training hours, the idle monitor and why training waits."""

from __future__ import annotations

from datetime import datetime

import pytest

from dedloc.daemon.collab.availability import Availability, IdleMonitor, TrainingHours, own_process_tree


def at(hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, 30, hour, minute)


def test_training_hours() -> None:
    always = TrainingHours.parse("")
    assert always.allows(at(3)) and always.describe() == "always"
    night = TrainingHours.parse("22:00-07:00")
    assert night.allows(at(23)) and night.allows(at(0)) and night.allows(at(6, 59))
    assert not night.allows(at(7)) and not night.allows(at(12)) and not night.allows(at(21, 59))
    two = TrainingHours.parse("12:00-13:30, 18:00-24:00")
    assert two.allows(at(12, 15)) and two.allows(at(23, 59)) and not two.allows(at(13, 30))
    assert two.describe() == "12:00-13:30,18:00-24:00"
    for bad in ("22-07", "25:00-01:00", "10:61-11:00", "10:00-10:00", "morning"):
        with pytest.raises(ValueError, match="training hours"):
            TrainingHours.parse(bad)


class FakeMachine:
    """A /proc/stat and per-process CPU counters that the test moves forward."""

    def __init__(self) -> None:
        self.busy = 0
        self.idle = 0
        self.ours = 0
        self.now = 0.0

    def advance(self, seconds: float, others: float, ours: float) -> None:
        total = int(seconds * 100)
        self.busy += int(total * (others + ours))
        self.ours += int(total * ours)
        self.idle += total - int(total * (others + ours))
        self.now += seconds

    def stat(self) -> str:
        return f"cpu  {self.busy} 0 0 {self.idle} 0 0 0 0 0 0\ncpu0 ...\n"


def test_idle_monitor_ignores_our_own_load() -> None:
    machine = FakeMachine()
    monitor = IdleMonitor(lambda: [42], threshold=0.25, idle_seconds=60, clock=lambda: machine.now,
                          read_stat=machine.stat, read_pid=lambda pid: machine.ours)
    monitor.sample()
    for _ in range(10):  # we use 90% of the CPU, others 5%: idle, once it lasted a minute
        machine.advance(10, others=0.05, ours=0.9)
        monitor.sample()
    assert monitor.others_share == pytest.approx(0.05, abs=0.01)
    assert monitor.idle()
    machine.advance(10, others=0.5, ours=0.4)  # the volunteer is back
    monitor.sample()
    assert not monitor.idle() and monitor.others_share == pytest.approx(0.5, abs=0.01)
    machine.advance(10, others=0.0, ours=0.9)
    monitor.sample()
    assert not monitor.idle()  # not idle again until it stayed so for idle_seconds
    hours = Availability(TrainingHours(), monitor)
    assert "idle" in (hours.blocked() or "") and "0%" in (hours.blocked() or "")
    for _ in range(7):
        machine.advance(10, others=0.0, ours=0.9)
        monitor.sample()
    assert hours.blocked() is None


def test_availability_says_why() -> None:
    clock = [at(12)]
    availability = Availability(TrainingHours.parse("22:00-07:00"), clock=lambda: clock[0])
    assert availability.blocked() == "outside the training hours (22:00-07:00)"
    clock[0] = at(23)
    assert availability.blocked() is None
    availability.paused_by = "paused by the volunteer"
    assert availability.blocked() == "paused by the volunteer"


def test_own_process_tree_holds_this_process() -> None:
    assert own_process_tree()[0] > 0
