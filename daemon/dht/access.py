"""`KeyAccess`: who may read and write which keys (closed runs' keys), as a DHTNode applies it.

The node takes an optional `KeyAccess` (daemon/collab/membership.py's registry) and checks:
- on serving a read (FIND_VALUE, serving.py): the reader's token (`authorize_read`);
- on serving a STORE (serving.py): the signature first, then the writer's proof
  (`authorize_write`), and reports what it stored (`stored`);
- on receiving records in replies (queries.py, `checked`): the writer's proof again;
- on its own store (node.py): the value is concealed (`conceal`) and the proof attached
  (`credential`); a read sends the reader's token (`credential`) and reveals what it got
  (`readable`, here).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Protocol

from .records import Entry


class KeyAccess(Protocol):
    """Who may read and write which keys (closed runs' keys; see daemon/collab/membership.py).
    `authorize_*` raise AccessDenied (or a subclass) to refuse."""

    def credential(self, key: str) -> str | None: ...

    def authorize_read(self, peer_id: str, key: str, token: Any) -> None: ...

    def authorize_write(self, signer: str, key: str, proof: Any) -> None: ...

    def stored(self, entry: Entry) -> None:
        """`entry` was stored here (a revocation list, say, is worth learning from)."""

    def conceal(self, key: str, sub_key: str | None, value: bytes) -> bytes:
        """The bytes to sign and store for `value` (a closed run's are encrypted for its members;
        raise AccessDenied when this node may not write them)."""

    def reveal(self, entry: Entry) -> bytes | None:
        """The value of `entry` as its writer gave it to `conceal`; None if this node cannot read
        it (the entry is then dropped from what `get` returns)."""


def readable(access: KeyAccess | None, entries: list[Entry], stats: Counter[str]) -> list[Entry]:
    """`entries` with the values their writers gave (see `DHTNode.get`); unreadable ones left out
    (counted: `unreadable_records`). (Their signatures are over the stored bytes: such entries are
    for reading, not storing.)"""
    if access is None:
        return entries
    result = []
    for entry in entries:
        value = access.reveal(entry)
        if value is None:
            stats["unreadable_records"] += 1
        elif value is entry.value:
            result.append(entry)
        else:
            result.append(dataclasses.replace(entry, value=value))
    return result
