"""Offences of peers against this daemon's reducers, and the temporary bans they lead to.

An offence is a round in which a sender's contribution was rejected here (screening.py: NaN/Inf,
wrong length or bad codec meta, a chunk out of order, a value over the cap, a norm outlier), or
in which a reducer's answer contradicted its own account (accounts.py: `wrong_average`); a
round counts once per peer however many of its chunks were bad. `ban_after` offences within
`window` seconds ban the peer for `seconds`; a wrong average bans at once (`conclusive`). While
banned, this daemon does not admit it to the groups it leads nor takes it as a leader
(matchmaking_methods.py, matchmaking.py), refuses its all-reduce streams and sends it no part
to reduce (reducing.py, butterfly.py). A ban expires by itself; the peer's count then starts again from zero.

Everything is counted in the `counters` it is given (the averager's, so that node metrics show
them): `offences`, `offences_<kind>`, `bans`, `bans_expired`, `refused_banned`. Memory is bounded:
at most `MAX_TRACKED` peers with offences and as many bans are remembered (the oldest offences
and the bans closest to expiry go first).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from .. import timebase

log = structlog.get_logger(__name__)

MAX_TRACKED = 4096


@dataclass
class _Ban:
    until: float
    reason: str
    since: float


@dataclass
class _Record:
    times: collections.deque[float] = field(default_factory=collections.deque)
    last_reason: str = ""


class BanList:
    def __init__(self, *, ban_after: int = 3, window: float = 3600.0, seconds: float = 600.0,
                 counters: collections.Counter[str] | None = None,
                 clock: Callable[[], float] = timebase.now) -> None:
        self.ban_after = ban_after
        self.window = window
        self.seconds = seconds
        self.counters: collections.Counter[str] = counters if counters is not None else collections.Counter()
        self._clock = clock
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()
        self._bans: dict[str, _Ban] = {}

    def offence(self, peer_id: str, kind: str, reason: str, *, conclusive: bool = False) -> bool:
        """Record one offence of `peer_id`; True if it is banned now (by this one or before).
        A `conclusive` offence (one no honest peer commits by accident, such as an answer that
        contradicts its reducer's own account) bans at once, whatever `ban_after` says."""
        now = self._clock()
        self.counters["offences"] += 1
        self.counters[f"offences_{kind}"] += 1
        if self.banned(peer_id) is not None:
            return True
        record = self._records.pop(peer_id, None) or _Record()
        self._records[peer_id] = record  # most recent last
        while len(self._records) > MAX_TRACKED:
            self._records.popitem(last=False)
        record.times.append(now)
        record.last_reason = f"{kind}: {reason}"[:300]
        while record.times and record.times[0] < now - self.window:
            record.times.popleft()
        log.warning("averaging_offence", peer=peer_id, kind=kind, reason=reason[:300],
                    count=len(record.times))
        if not conclusive and (self.ban_after <= 0 or len(record.times) < self.ban_after):
            return False
        del self._records[peer_id]
        reason_text = f"{len(record.times)} offences within {self.window:g}s, the last {record.last_reason}"
        self._bans[peer_id] = _Ban(now + self.seconds, reason_text, now)
        if len(self._bans) > MAX_TRACKED:  # a swarm of offending ids: the soonest to expire goes
            self._expire(min(self._bans, key=lambda p: self._bans[p].until))
        self.counters["bans"] += 1
        log.warning("averaging_peer_banned", peer=peer_id, seconds=self.seconds, reason=reason_text)
        return True

    def banned(self, peer_id: str) -> str | None:
        """Why `peer_id` is banned here (with until when), or None if it is not."""
        ban = self._bans.get(peer_id)
        if ban is None:
            return None
        left = ban.until - self._clock()
        if left <= 0:
            self._expire(peer_id)
            return None
        return f"banned here for {left:.0f}s more ({ban.reason})"

    def refused(self, peer_id: str, what: str) -> None:
        """Count a refusal of a banned peer (`what` it was refused: a join, a stream)."""
        self.counters["refused_banned"] += 1
        log.info("averaging_banned_peer_refused", peer=peer_id, refused=what)

    def _expire(self, peer_id: str) -> None:
        self._bans.pop(peer_id, None)
        self.counters["bans_expired"] += 1
        log.info("averaging_ban_expired", peer=peer_id)

    def status(self) -> dict[str, Any]:
        """The active bans and the peers with offences on record (expired bans removed)."""
        now = self._clock()
        for peer_id in [p for p, ban in self._bans.items() if ban.until <= now]:
            self._expire(peer_id)
        return {
            "policy": {"ban_after": self.ban_after, "window_seconds": self.window,
                       "ban_seconds": self.seconds},
            "active": [{"peer_id": peer_id, "since": ban.since, "until": ban.until,
                        "seconds_left": round(ban.until - now, 1), "reason": ban.reason}
                       for peer_id, ban in sorted(self._bans.items())],
            "offenders": {peer_id: {"offences": sum(1 for t in r.times if t >= now - self.window),
                                    "last": r.last_reason}
                          for peer_id, r in self._records.items()},
        }
