"""One identity against a node's storage: it may hold only its share (`max_signer_bytes`) and
a few sub-keys of any key (`max_sub_keys_per_signer`), so it can neither fill the node nor crowd
a run's progress key with week-long entries that push the honest 30 s reports out; and a full
node sweeps for expired entries at most once a second, not on every STORE."""

from __future__ import annotations

import pytest

from dedloc.daemon.dht.errors import StorageFull
from dedloc.daemon.dht.records import Entry, RecordLimits
from dedloc.daemon.dht.storage import RecordStore
from dedloc.daemon.identity import Identity

NOW = 1_000_000.0
WEEK = 7 * 24 * 3600.0 - 1
KEY = "collab/run/0123456789abcdef/progress"


def test_one_signer_cannot_crowd_out_the_honest_reports_of_a_key() -> None:
    store = RecordStore(RecordLimits(max_sub_keys=64))
    honest = [Identity.generate() for _ in range(40)]
    for identity in honest:
        store.store(Entry.create(identity, KEY, b"report", NOW + 30, sub_key=identity.peer_id), NOW)
    attacker = Identity.generate()
    written = 0
    with pytest.raises(StorageFull, match="sub-keys"):
        for i in range(1000):
            store.store(Entry.create(attacker, KEY, b"junk", NOW + WEEK, sub_key=str(i)), NOW)
            written += 1
    assert written == RecordLimits().max_sub_keys_per_signer
    held = {e.sub_key for e in store.get(KEY, NOW)}
    assert {i.peer_id for i in honest} <= held  # nobody honest was pushed out


def test_one_signer_holds_its_share_of_a_node_only() -> None:
    limits = RecordLimits(max_signer_bytes=64 * 1024)
    store = RecordStore(limits)
    attacker = Identity.generate()
    with pytest.raises(StorageFull, match="its share"):
        for i in range(1000):
            store.store(Entry.create(attacker, f"junk/{i}", b"x" * 4000, NOW + WEEK), NOW)
    assert store.bytes_used <= limits.max_signer_bytes
    other = Identity.generate()  # others still store
    assert store.store(Entry.create(other, "fine", b"y" * 4000, NOW + 60), NOW)
    # replacing one's own entry is not counted twice
    mine = Entry.create(other, "fine", b"z" * 4000, NOW + 120)
    assert store.store(mine, NOW)


def test_a_full_node_sweeps_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    store = RecordStore(RecordLimits(max_entries=10))
    for i in range(10):
        store.store(Entry.create(Identity.generate(), f"k{i}", b"v", NOW + 3600), NOW)
    sweeps = []
    original = store.sweep
    monkeypatch.setattr(store, "sweep", lambda now: sweeps.append(now) or original(now))
    writer = Identity.generate()
    for i in range(100):
        with pytest.raises(StorageFull):
            store.store(Entry.create(writer, f"more{i}", b"v", NOW + 60), NOW + i * 0.01)
    assert len(sweeps) == 1


def test_one_signer_cannot_fill_a_key_with_a_few_big_sub_keys() -> None:
    store = RecordStore()
    honest = [Identity.generate() for _ in range(20)]
    for identity in honest:
        store.store(Entry.create(identity, KEY, b"r" * 2000, NOW + 30, sub_key=identity.peer_id), NOW)
    attacker = Identity.generate()
    with pytest.raises(StorageFull, match="share of a key"):
        for i in range(16):  # 16 x 60 KiB would be most of the key's 1 MiB
            store.store(Entry.create(attacker, KEY, b"j" * 60_000, NOW + WEEK, sub_key=str(i)), NOW)
    held = {e.sub_key for e in store.get(KEY, NOW)}
    assert {i.peer_id for i in honest} <= held
    mine = [e for e in store.get(KEY, NOW) if e.signer == attacker.peer_id]
    assert sum(e.size for e in mine) <= RecordLimits().max_signer_key_bytes
