"""What one node holds: `RecordStore`, bounded in entries and bytes. Pure: times are arguments.

A key holds either one plain entry or a dict of sub-key entries. The later expiration wins: a
plain value replaces a sub-key dict only if it expires after every sub-key, and a sub-key replaces
a plain value only if it expires after it. For the same (key, sub-key) an entry with an earlier
expiration is a replay and is refused (`StaleRecord`); the very same entry again is accepted as a
no-op (republishing is idempotent).

Identities are free, but one identity's share is bounded: at most `max_signer_bytes` per node,
and `max_sub_keys_per_signer` sub-keys and `max_signer_key_bytes` bytes per key (an honest peer
writes one sub-key per key: its own), so one signer can neither fill a node nor crowd a run's
keys with long-lived entries that push honest short-lived ones out. A full store sweeps expired
entries at most once a second (sweeping all of them on every STORE cost a node's CPU).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from .errors import StaleRecord, StorageFull
from .records import Entry, RecordLimits, validate


class RecordStore:
    def __init__(self, limits: RecordLimits | None = None) -> None:
        self.limits = limits or RecordLimits()
        self._plain: dict[str, Entry] = {}
        self._dicts: dict[str, dict[str, Entry]] = {}
        self._entries = 0
        self._bytes = 0
        self._by_signer: collections.Counter[str] = collections.Counter()  # bytes held per signer
        self._signer_subs: collections.Counter[tuple[str, str]] = collections.Counter()  # (key, signer)
        self._signer_key_bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._swept_at = float("-inf")

    def __len__(self) -> int:
        return self._entries

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def keys(self) -> list[str]:
        return [*self._plain, *self._dicts]

    def entries(self) -> Iterator[Entry]:
        yield from list(self._plain.values())
        for sub in list(self._dicts.values()):
            yield from list(sub.values())

    def get(self, key: str, now: float) -> list[Entry]:
        """The live entries of `key`: [plain] or the sub-key entries; [] when none."""
        plain = self._plain.get(key)
        if plain is not None:
            if plain.expiration > now:
                return [plain]
            self._drop_key(key)
            return []
        sub = self._dicts.get(key)
        if sub is None:
            return []
        live = [entry for entry in sub.values() if entry.expiration > now]
        if len(live) != len(sub):
            for sub_key in [s for s, entry in sub.items() if entry.expiration <= now]:
                self._drop_sub(key, sub_key)
        return live

    def store(self, entry: Entry, now: float) -> bool:
        """Validate and keep `entry`. True if it changed what is held, False if it was already held.
        Raises an InvalidRecord subclass (the writer's fault) or StorageFull (ours)."""
        validate(entry, now, self.limits)
        current = self.get(entry.key, now)  # also drops expired entries of this key
        self._check_signer(entry)
        if entry.sub_key is None:
            return self._store_plain(entry, current, now)
        return self._store_sub(entry, current, now)

    def _store_plain(self, entry: Entry, current: list[Entry], now: float) -> bool:
        if current:
            newest = max(old.expiration for old in current)
            if len(current) == 1 and current[0] == entry:
                return False
            if entry.expiration <= newest:
                raise StaleRecord(f"{entry.key!r} already holds a record expiring at {newest}")
            self._drop_key(entry.key)
        self._make_room(entry.size, 1, now)
        self._plain[entry.key] = entry
        self._account(entry, +1)
        return True

    def _store_sub(self, entry: Entry, current: list[Entry], now: float) -> bool:
        assert entry.sub_key is not None
        plain = self._plain.get(entry.key)
        if plain is not None:
            if entry.expiration <= plain.expiration:
                raise StaleRecord(f"{entry.key!r} holds a plain value expiring at {plain.expiration}")
            self._drop_key(entry.key)
        sub = self._dicts.setdefault(entry.key, {})
        old = sub.get(entry.sub_key)
        if old is not None:
            if old == entry:
                return False
            if entry.expiration <= old.expiration:
                raise StaleRecord(f"{entry.key!r}/{entry.sub_key} already holds a record expiring "
                                  f"at {old.expiration}")
            self._drop_sub(entry.key, entry.sub_key)
            sub = self._dicts.setdefault(entry.key, {})
        limits = self.limits
        while sub and (len(sub) >= limits.max_sub_keys or
                       sum(e.size for e in sub.values()) + entry.size > limits.max_key_total_bytes):
            # The key is full: the sub-key that expires first makes way, if it expires before ours.
            first = min(sub.values(), key=lambda e: e.expiration)
            if first.expiration >= entry.expiration:
                raise StorageFull(f"{entry.key!r} holds as many sub-keys as allowed")
            assert first.sub_key is not None
            self._drop_sub(entry.key, first.sub_key)
            sub = self._dicts.setdefault(entry.key, {})
        self._make_room(entry.size, 1, now)
        self._dicts.setdefault(entry.key, {})[entry.sub_key] = entry
        self._account(entry, +1)
        return True

    def _check_signer(self, entry: Entry) -> None:
        """StorageFull if `entry` would take its signer past its share (what it replaces of its
        own is not counted twice)."""
        limits = self.limits
        replaced = self._held(entry.key, entry.sub_key)
        same = replaced is not None and replaced.signer == entry.signer
        held = self._by_signer[entry.signer] - (replaced.size if same and replaced else 0)
        if held + entry.size > limits.max_signer_bytes:
            raise StorageFull(f"{entry.signer[:16]} holds {held} bytes on this node, its share")
        if entry.sub_key is not None and not same and \
                self._signer_subs[(entry.key, entry.signer)] >= limits.max_sub_keys_per_signer:
            raise StorageFull(f"{entry.signer[:16]} holds {limits.max_sub_keys_per_signer} "
                              f"sub-keys of {entry.key[:80]!r} already")
        if entry.sub_key is not None:
            in_key = self._signer_key_bytes[(entry.key, entry.signer)] - \
                (replaced.size if same and replaced else 0)
            if in_key + entry.size > limits.max_signer_key_bytes:
                raise StorageFull(f"{entry.signer[:16]} holds {in_key} bytes of {entry.key[:80]!r}, "
                                  "its share of a key")

    def _held(self, key: str, sub_key: str | None) -> Entry | None:
        if sub_key is None:
            return self._plain.get(key)
        return self._dicts.get(key, {}).get(sub_key)

    def _make_room(self, size: int, count: int, now: float) -> None:
        limits = self.limits
        if self._entries + count <= limits.max_entries and self._bytes + size <= limits.max_bytes:
            return
        if now - self._swept_at >= 1.0:
            self._swept_at = now
            self.sweep(now)
        if self._entries + count > limits.max_entries or self._bytes + size > limits.max_bytes:
            raise StorageFull(f"this node holds {self._entries} entries ({self._bytes} bytes), "
                              "its limit")

    def sweep(self, now: float) -> int:
        """Drop every expired entry; return how many."""
        before = self._entries
        for key in list(self._plain):
            self.get(key, now)
        for key in list(self._dicts):
            self.get(key, now)
        return before - self._entries

    def remove(self, key: str, sub_key: str | None = None) -> None:
        if sub_key is None:
            self._drop_key(key)
        else:
            self._drop_sub(key, sub_key)

    def replace_unchecked(self, entry: Entry) -> None:
        """Put `entry` in place without any check: for tests that play a malicious node."""
        if entry.sub_key is None:
            self._drop_key(entry.key)
            self._plain[entry.key] = entry
        else:
            self._drop_sub(entry.key, entry.sub_key)
            self._dicts.setdefault(entry.key, {})[entry.sub_key] = entry
        self._account(entry, +1)

    def _drop_key(self, key: str) -> None:
        plain = self._plain.pop(key, None)
        if plain is not None:
            self._account(plain, -1)
        for entry in self._dicts.pop(key, {}).values():
            self._account(entry, -1)

    def _drop_sub(self, key: str, sub_key: str) -> None:
        sub = self._dicts.get(key)
        if sub is None:
            return
        entry = sub.pop(sub_key, None)
        if entry is not None:
            self._account(entry, -1)
        if not sub:
            del self._dicts[key]

    def _account(self, entry: Entry, sign: int) -> None:
        self._entries += sign
        self._bytes += sign * entry.size
        self._by_signer[entry.signer] += sign * entry.size
        if self._by_signer[entry.signer] <= 0:
            del self._by_signer[entry.signer]
        if entry.sub_key is not None:
            pair = (entry.key, entry.signer)
            self._signer_subs[pair] += sign
            self._signer_key_bytes[pair] += sign * entry.size
            if self._signer_subs[pair] <= 0:
                del self._signer_subs[pair]
                self._signer_key_bytes.pop(pair, None)
