"""The averaging settings: the `[averaging]` section of the daemon's configuration.

The averager is configured with this type directly (the simulator builds one too); daemon/config.py
composes it into `Config`. Values are checked when the settings are made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..settings import documented

# The most members a group may hold: what an answer's account can name in the header a frame
# carries (accounts.MAX_ACCOUNT_SENDERS, which a test keeps equal to this).
MAX_GROUP_SIZE = 195


@dataclass(frozen=True)
class AveragingSettings:
    upload_mbps: float = documented("Starting guess of this machine's upload bandwidth in Mbit/s; "
                                    "replaced by what transfers measure.", default=100.0)
    download_mbps: float = documented("Starting guess of the download bandwidth in Mbit/s.", default=100.0)
    chunk_bytes: int = documented("Size of the chunks a vector is streamed in (1-4 MiB is best).",
                                  default=4 << 20)
    window: float = documented("Seconds matchmaking gathers peers for a round.", default=5.0)
    max_group_size: int = documented("Most peers averaging in one group.", default=64)
    balancing: Literal["lp", "uniform"] = documented(
        "How the vector is split among reducers: lp (by measured bandwidth, DeDLOC) or uniform "
        "(equal parts; for comparison).", default="lp")
    history: int = documented("How many past rounds averaging.status keeps.", default=50)
    # Data hygiene (docs/averaging.md, "Bad contributions"); NaN/Inf and wrong lengths are always
    # rejected.
    max_value: float = documented("A received contribution holding a value of larger magnitude is "
                                  "rejected.", default=1e12)
    max_norm_ratio: float = documented(
        "With 3 or more senders, a sender whose chunk's L2 norm is over this many times the median "
        "of the other senders' is rejected (0: no such rule; else at least 1).", default=1000.0)
    robust_aggregation: Literal["none", "centered_clip"] = documented(
        "none: weighted mean; centered_clip: centered clipping around the coordinate-wise median "
        "(for open runs; every contribution of a chunk is kept until it is averaged).",
        default="none")
    clip_radius: float = documented("centered_clip: the clipping radius, in median distances of the "
                                    "contributions to the median.", default=2.0)
    clip_iterations: int = documented("centered_clip: clipping iterations per chunk.", default=3)
    check_reducers: bool = documented(
        "Reducers send an account of each averaged chunk and members check every answer against it "
        "before applying it; a reducer whose answer contradicts its account is banned at once. All "
        "peers of a run must agree (a checking member refuses answers without an account).",
        default=True)
    ban_after: int = documented("Rounds with a rejected contribution (within offence_window) after which "
                                "a peer is banned (0: never).", default=3)
    offence_window: float = documented("Seconds an offence counts towards a ban.", default=3600.0)
    ban_seconds: float = documented("How long a ban lasts: the peer is not admitted to groups led here and "
                                    "its streams are refused.", default=600.0)

    def __post_init__(self) -> None:
        for name in ("max_value", "clip_radius", "offence_window", "ban_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"averaging.{name}", "must be positive")
        if self.max_value > 1e30:
            raise ConfigError("averaging.max_value", "must be at most 1e30 (sums must not overflow)")
        if not (self.max_norm_ratio == 0 or self.max_norm_ratio >= 1):
            raise ConfigError("averaging.max_norm_ratio", "must be 0 (off) or at least 1")
        if self.clip_iterations < 1:
            raise ConfigError("averaging.clip_iterations", "must be at least 1")
        if self.ban_after < 0:
            raise ConfigError("averaging.ban_after", "must be 0 (never ban) or more")
        if not 1 <= self.max_group_size <= MAX_GROUP_SIZE:
            raise ConfigError("averaging.max_group_size",
                              f"must be 1 to {MAX_GROUP_SIZE} (what an answer's account can "
                              "name in a frame; larger runs average in grid rounds)")
