"""The collaboration's settings: the `[run]` section (the run a daemon takes part in by itself,
daemon/collab/autojoin.py) and the `[limits]` section (when this machine may train,
daemon/collab/availability.py) of the daemon's configuration. Values are checked when the
settings are made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..settings import documented
from .availability import TrainingHours
from .errors import MembershipError
from .tokens import MembershipToken

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
BASE_DELAY = 2.0  # seconds before the second attempt to join; doubles up to retry_max_seconds

@dataclass(frozen=True)
class LimitsSettings:
    hours: str = documented("Train only in these windows of local time, like 22:00-07:00 or "
                            "12:00-13:30,19:00-24:00; empty: always. Outside them runs leave their "
                            "rounds and wait.", default="")
    idle_only: bool = documented("Train only while other programs leave the CPU idle (see idle_cpu_share "
                                 "and idle_seconds).", default=False)
    idle_cpu_share: float = documented("idle_only: the machine is busy while other programs use more "
                                       "than this share of its CPU time.", default=0.25)
    idle_seconds: float = documented("idle_only: how long the machine must stay idle before training "
                                     "starts again.", default=300.0)

    def __post_init__(self) -> None:
        try:
            TrainingHours.parse(self.hours)
        except ValueError as exc:
            raise ConfigError("limits.hours", str(exc)) from None
        if not 0.0 < self.idle_cpu_share <= 1.0:
            raise ConfigError("limits.idle_cpu_share", "must be in (0, 1]")
        if self.idle_seconds < 0:
            raise ConfigError("limits.idle_seconds", "must be 0 or more")


@dataclass(frozen=True)
class RunSettings:
    join: str = documented(
        "Join the collaborative run of this name whenever the daemon starts (as `dedloc join NAME` "
        "does), retrying with backoff until a peer publishes it. A run the volunteer stops "
        "(dedloc stop) stays stopped, restarts included, until it is started again. Empty: none.",
        default="")
    token: str = documented("The membership token of a closed run (from its owner's `dedloc token "
                            "issue`): join that run at start. token_file keeps it private.", default="")
    token_file: str = documented("A file holding that token (mode 0600, readable by the daemon's user); "
                                 "`dedloc service install --token` writes /etc/dedloc/run-token.",
                                 default="")
    aux: bool = documented("Join that run as an aux peer (no worker: it reduces in the run's rounds).",
                           default=False)
    device: str = documented("Device for that run's worker; empty: workers.device.", default="")
    manifest: str = documented(
        "The run owner's side: a manifest file written by `dedloc run create`; the run it "
        "describes is started (resumed from its checkpoint) whenever the daemon starts. Empty: "
        "none.", default="")
    retry_max_seconds: float = documented("Longest wait between two attempts to join (the waits grow "
                                          "from 2 s, with jitter).", default=60.0)

    def __post_init__(self) -> None:
        try:
            check_run_settings(self)
        except ValueError as exc:
            raise ConfigError(f"run.{exc.args[0]}", exc.args[1]) from None


def check_run_settings(settings: RunSettings) -> None:
    """ValueError(key, reason) for a [run] section that can never work."""
    if settings.join and not RUN_NAME.match(settings.join):
        raise ValueError("join", f"{settings.join!r} is not a run name (1-64 letters, digits, '_', "
                                 "'.' or '-')")
    if settings.token and settings.token_file:
        raise ValueError("token", "give the token or token_file, not both")
    if settings.token:
        try:
            token = MembershipToken.decode(settings.token)
        except MembershipError as exc:
            raise ValueError("token", str(exc)) from None
        if settings.join and settings.join != token.run:
            raise ValueError("token", f"the token is for run {token.run!r}, not {settings.join!r}")
    if settings.manifest and (settings.join or settings.token or settings.token_file or settings.aux):
        raise ValueError("manifest", "the owner's manifest starts a run this daemon owns; join, "
                                     "token, token_file and aux are for joining someone else's")
    if not settings.retry_max_seconds >= BASE_DELAY:
        raise ValueError("retry_max_seconds", f"must be at least {BASE_DELAY:g}")
