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
from .link import LinkLimits
from .link_stream import LinkStream
from .transport import LinkEvent, TlsTransport, TransportLimits

__all__ = [
    "CallTimeout",
    "HandshakeError",
    "LimitExceeded",
    "LinkEvent",
    "LinkInfo",
    "LinkLimits",
    "LinkStream",
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
    "TlsTransport",
    "TransportClosed",
    "TransportError",
    "TransportLimits",
    "UnknownMethod",
]
