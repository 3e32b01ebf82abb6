"""Pure tests of record signing, validation and the record store rules."""

from __future__ import annotations

import dataclasses

import pytest

from dedloc.daemon.dht import (
    BadSignature,
    Entry,
    ForbiddenWrite,
    RecordExpired,
    RecordLimits,
    RecordStore,
    RecordTooLarge,
    StaleRecord,
    StorageFull,
    merge_entries,
    validate,
)
from dedloc.daemon.identity import Identity

NOW = 1_000_000.0
LIMITS = RecordLimits()


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.generate()


def test_signed_entry_validates(alice: Identity) -> None:
    entry = Entry.create(alice, "k", b"v", NOW + 10)
    validate(entry, NOW, LIMITS)
    assert entry.signer == alice.peer_id


@pytest.mark.parametrize("field,value", [("value", b"w"), ("key", "other"), ("sub_key", "x"),
                                         ("expiration", NOW + 11)])
def test_any_change_breaks_the_signature(alice: Identity, field: str, value: object) -> None:
    entry = dataclasses.replace(Entry.create(alice, "k", b"v", NOW + 10), **{field: value})
    with pytest.raises(BadSignature):
        validate(entry, NOW, LIMITS)


def test_signature_by_someone_else_refused(alice: Identity, bob: Identity) -> None:
    forged = dataclasses.replace(Entry.create(bob, "k", b"v", NOW + 10), signer=alice.peer_id)
    with pytest.raises(BadSignature):
        validate(forged, NOW, LIMITS)


def test_peer_sub_key_only_written_by_that_peer(alice: Identity, bob: Identity) -> None:
    validate(Entry.create(alice, "run/peers", b"a", NOW + 10, sub_key=alice.peer_id), NOW, LIMITS)
    with pytest.raises(ForbiddenWrite):
        validate(Entry.create(bob, "run/peers", b"b", NOW + 10, sub_key=alice.peer_id), NOW, LIMITS)
    # a sub-key that is not a peer id is open to anyone (signed by its writer)
    validate(Entry.create(bob, "run/peers", b"b", NOW + 10, sub_key="shared"), NOW, LIMITS)


def test_expiration_window(alice: Identity) -> None:
    with pytest.raises(RecordExpired):
        validate(Entry.create(alice, "k", b"v", NOW), NOW, LIMITS)
    with pytest.raises(RecordExpired):
        validate(Entry.create(alice, "k", b"v", NOW + LIMITS.max_ttl + 1), NOW, LIMITS)
    with pytest.raises(RecordExpired):
        validate(Entry.create(alice, "k", b"v", float("nan")), NOW, LIMITS)


def test_size_limits(alice: Identity) -> None:
    limits = RecordLimits(max_value_bytes=100, max_key_bytes=10, max_sub_key_bytes=10)
    validate(Entry.create(alice, "k", b"x" * 100, NOW + 1), NOW, limits)
    with pytest.raises(RecordTooLarge):
        validate(Entry.create(alice, "k", b"x" * 101, NOW + 1), NOW, limits)
    with pytest.raises(RecordTooLarge):
        validate(Entry.create(alice, "k" * 11, b"x", NOW + 1), NOW, limits)
    with pytest.raises(RecordTooLarge):
        validate(Entry.create(alice, "k", b"x", NOW + 1, sub_key="s" * 11), NOW, limits)


def test_store_newer_wins_and_replay_refused(alice: Identity) -> None:
    store = RecordStore()
    old = Entry.create(alice, "k", b"old", NOW + 10)
    new = Entry.create(alice, "k", b"new", NOW + 20)
    assert store.store(old, NOW)
    assert store.store(new, NOW)
    with pytest.raises(StaleRecord):
        store.store(old, NOW)  # replayed older record
    assert not store.store(new, NOW)  # the same record again: accepted, nothing changes
    assert store.get("k", NOW) == [new]
    with pytest.raises(StaleRecord):
        store.store(Entry.create(alice, "k", b"same-time", NOW + 20), NOW)


def test_store_refuses_forged_and_foreign_sub_key(alice: Identity, bob: Identity) -> None:
    store = RecordStore()
    mine = Entry.create(alice, "run", b"a", NOW + 10, sub_key=alice.peer_id)
    store.store(mine, NOW)
    with pytest.raises(ForbiddenWrite):
        store.store(Entry.create(bob, "run", b"b", NOW + 20, sub_key=alice.peer_id), NOW)
    with pytest.raises(BadSignature):
        store.store(dataclasses.replace(mine, value=b"evil", expiration=NOW + 30), NOW)
    assert store.get("run", NOW) == [mine]


def test_sub_keys_and_plain_values(alice: Identity, bob: Identity) -> None:
    store = RecordStore()
    a = Entry.create(alice, "run", b"a", NOW + 10, sub_key=alice.peer_id)
    b = Entry.create(bob, "run", b"b", NOW + 20, sub_key=bob.peer_id)
    store.store(a, NOW)
    store.store(b, NOW)
    assert sorted(store.get("run", NOW), key=lambda e: e.expiration) == [a, b]
    with pytest.raises(StaleRecord):  # a plain value must outlive every sub-key to replace them
        store.store(Entry.create(bob, "run", b"p", NOW + 15), NOW)
    plain = Entry.create(bob, "run", b"p", NOW + 25)
    store.store(plain, NOW)
    assert store.get("run", NOW) == [plain]
    assert len(store) == 1
    with pytest.raises(StaleRecord):
        store.store(Entry.create(alice, "run", b"a", NOW + 24, sub_key=alice.peer_id), NOW)


def test_expired_entries_vanish(alice: Identity) -> None:
    store = RecordStore()
    store.store(Entry.create(alice, "k", b"v", NOW + 10), NOW)
    store.store(Entry.create(alice, "d", b"v", NOW + 5, sub_key="s"), NOW)
    store.store(Entry.create(alice, "d", b"w", NOW + 50, sub_key="t"), NOW)
    assert store.get("k", NOW + 10) == []
    assert [e.sub_key for e in store.get("d", NOW + 6)] == ["t"]
    assert store.sweep(NOW + 100) == 1
    assert len(store) == 0 and store.bytes_used == 0


def test_storage_limits(alice: Identity) -> None:
    store = RecordStore(RecordLimits(max_entries=3))
    for i in range(3):
        store.store(Entry.create(alice, f"k{i}", b"v", NOW + 10), NOW)
    with pytest.raises(StorageFull):
        store.store(Entry.create(alice, "k3", b"v", NOW + 10), NOW)
    # once entries expire, there is room again
    store.store(Entry.create(alice, "k3", b"v", NOW + 20), NOW + 11)
    bytes_store = RecordStore(RecordLimits(max_bytes=2000))
    bytes_store.store(Entry.create(alice, "a", b"x" * 1500, NOW + 10), NOW)
    with pytest.raises(StorageFull):
        bytes_store.store(Entry.create(alice, "b", b"x" * 1000, NOW + 10), NOW)


def test_full_key_gives_way_to_later_expiring_sub_key(alice: Identity) -> None:
    store = RecordStore(RecordLimits(max_sub_keys=2))
    store.store(Entry.create(alice, "d", b"1", NOW + 10, sub_key="a"), NOW)
    store.store(Entry.create(alice, "d", b"2", NOW + 20, sub_key="b"), NOW)
    with pytest.raises(StorageFull):
        store.store(Entry.create(alice, "d", b"3", NOW + 5, sub_key="c"), NOW)
    store.store(Entry.create(alice, "d", b"3", NOW + 30, sub_key="c"), NOW)
    assert sorted(e.sub_key or "" for e in store.get("d", NOW)) == ["b", "c"]


def test_merge_entries(alice: Identity, bob: Identity) -> None:
    a1 = Entry.create(alice, "run", b"a1", NOW + 10, sub_key=alice.peer_id)
    a2 = Entry.create(alice, "run", b"a2", NOW + 30, sub_key=alice.peer_id)
    b1 = Entry.create(bob, "run", b"b1", NOW + 20, sub_key=bob.peer_id)
    dead = Entry.create(bob, "run", b"x", NOW - 1 + 2, sub_key="gone")
    merged = merge_entries([a1, b1, a2, dead], NOW + 1)
    assert set(merged) == {a2, b1}
    plain = Entry.create(bob, "run", b"p", NOW + 25)
    assert set(merge_entries([a2, b1, plain], NOW)) == {a2}  # plain shadows b1, a2 outlives it
    assert merge_entries([a1, plain], NOW) == [plain]
