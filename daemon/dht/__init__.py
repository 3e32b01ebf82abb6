"""Kademlia DHT: signed, expiring, sub-keyed records over a `PeerTransport`."""

from .errors import (
    AccessDenied,
    BadSignature,
    DHTError,
    ForbiddenWrite,
    InvalidRecord,
    MalformedMessage,
    RecordExpired,
    RecordTooLarge,
    StaleRecord,
    StorageFull,
)
from .ids import distance, key_id_of, node_id_of
from .node import DHTConfig, DHTNode
from .protocol import Contact
from .records import Entry, Record, RecordLimits, merge_entries, validate
from .routing import KBucket, NodeInfo, RoutingTable
from .storage import RecordStore

__all__ = [
    "AccessDenied",
    "BadSignature",
    "Contact",
    "DHTConfig",
    "DHTError",
    "DHTNode",
    "Entry",
    "ForbiddenWrite",
    "InvalidRecord",
    "KBucket",
    "MalformedMessage",
    "NodeInfo",
    "Record",
    "RecordExpired",
    "RecordLimits",
    "RecordStore",
    "RecordTooLarge",
    "RoutingTable",
    "StaleRecord",
    "StorageFull",
    "distance",
    "key_id_of",
    "merge_entries",
    "node_id_of",
    "validate",
]
