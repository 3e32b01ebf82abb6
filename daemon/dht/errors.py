"""The DHT's exceptions. The class name travels as the `kind` of a RemoteError, so a writer sees
why a node refused its record (`ForbiddenWrite`, `StaleRecord`, ...)."""

from __future__ import annotations

from ..errors import DaemonError


class DHTError(DaemonError):
    """Root of the errors of `daemon.dht`."""


class InvalidRecord(DHTError):
    """A record breaks the rules (the writer's or the sending peer's fault); never stored."""


class BadSignature(InvalidRecord):
    """The signature does not match the record and its claimed writer."""


class ForbiddenWrite(InvalidRecord):
    """A sub-key named by a peer id was written by another peer."""


class StaleRecord(InvalidRecord):
    """A record with the same or a later expiration is already held (a replay of an older one)."""


class RecordExpired(InvalidRecord):
    """The record's expiration has passed (or lies beyond the allowed horizon)."""


class RecordTooLarge(InvalidRecord):
    """The value, key or sub-key is over its size limit."""


class StorageFull(DHTError):
    """This node holds as much as its limits allow; the record was not stored."""


class AccessDenied(DHTError):
    """The key belongs to a closed run and the caller (or the record's writer) is not a member."""


class MalformedMessage(DHTError):
    """A DHT request or reply does not have the expected shape (the sending peer's fault)."""
