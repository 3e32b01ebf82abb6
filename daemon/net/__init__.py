"""Peer-to-peer transport: addresses, authenticated links, calls and streams (`PeerTransport`)."""

from .addresses import PeerAddress
from .errors import (
    CallTimeout,
    HandshakeError,
    LimitExceeded,
    PeerIdMismatchError,
    PeerUnreachableError,
    ProtocolViolation,
    RemoteError,
    StreamAborted,
    TransportClosed,
    TransportError,
    UnknownMethod,
)
from .interface import LinkInfo, Message, PeerTransport, RequestContext, Stream

__all__ = [
    "CallTimeout",
    "HandshakeError",
    "LimitExceeded",
    "LinkInfo",
    "Message",
    "PeerAddress",
    "PeerIdMismatchError",
    "PeerTransport",
    "PeerUnreachableError",
    "ProtocolViolation",
    "RemoteError",
    "RequestContext",
    "Stream",
    "StreamAborted",
    "TransportClosed",
    "TransportError",
    "UnknownMethod",
]
