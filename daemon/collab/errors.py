"""The collaboration layer's exceptions."""

from __future__ import annotations

from ..errors import DaemonError


class CollaborationError(DaemonError):
    """Root of the errors of `daemon.collab`'s peer-to-peer side."""


class StateSyncError(CollaborationError):
    """A state download failed (the donor vanished or sent something malformed)."""


class LocalStateError(StateSyncError):
    """This peer cannot take a state (too little free shared memory): not the donor's fault."""


class DonorContradicted(StateSyncError):
    """The donor's state header names a head behind, or beside, the one it reported holding: its
    own word against it. Refused before the state itself is downloaded."""


class DonorBusy(StateSyncError):
    """The donor is mid-round or serving others: not a failure, ask again shortly.
    `shed`: it served others lately and we told it we have other donors to ask (state_sync.py,
    "a flash crowd"): ask one of those, and this one again after `retry_after` seconds."""

    def __init__(self, message: str, *, shed: bool = False, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.shed = shed
        self.retry_after = retry_after


class RoundSatOut(CollaborationError):
    """This peer has no place in a grid round (an aux peer, or a newcomer, that does not fit
    beside its cells): it sits the round out, which is no failure."""


class ManifestError(CollaborationError):
    """A run manifest is invalid, or no single run of a name could be found to join."""


class MembershipError(CollaborationError):
    """A token is malformed, forged, expired or revoked, or a peer is not a member of a run."""
