"""The averaging layer's exceptions."""

from __future__ import annotations

from ..errors import DaemonError


class AveragingError(DaemonError):
    """Root of the errors of `daemon.averaging`."""


class MatchmakingError(AveragingError):
    """Matchmaking was misused, or a peer's join was refused (the message says why)."""


class NotGathering(MatchmakingError):
    """Asked to take a join for a round it is not forming (not yet, or no more)."""


class LeaderComing(NotGathering):
    """Asked to take a join for a round it is not forming yet, but will soon: it is still in an
    earlier stage of the same grid round (a follower may wait for it longer)."""


class RoundOver(NotGathering):
    """Asked to take a join for a round this peer has moved past (gatherings.py): it does not
    form it again (a follower moves on at once)."""
