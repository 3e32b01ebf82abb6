"""The transport's exceptions: whose fault it was, in the type."""

from __future__ import annotations

from ..errors import DaemonError


class TransportError(DaemonError):
    """Root of the errors of `daemon.net`."""


class TransportClosed(TransportError):
    """The transport (or the link) was closed while the call was pending."""


class PeerUnreachableError(TransportError):
    """No known address of the peer answered (dial failed or timed out)."""


class PeerIdMismatchError(TransportError):
    """The peer that answered at an address is not the peer the address names (impersonation or
    a stale address)."""


class HandshakeError(TransportError):
    """The peer failed the authenticated handshake (bad signature, wrong protocol, too slow)."""


class ProtocolViolation(TransportError):
    """The peer sent bytes that break the framing or the protocol; its link is closed."""


class LimitExceeded(TransportError):
    """A hard limit (frame size, open streams, pending bytes) was reached."""


class CallTimeout(TransportError, TimeoutError):
    """The call's deadline passed before the reply came."""


class RemoteError(TransportError):
    """The peer's handler raised (or refused the call); `kind` names the remote error class."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class UnknownMethod(RemoteError):
    """The peer serves no handler for that method."""


class StreamAborted(TransportError):
    """The stream was aborted by either side."""
