"""Tests of a run's checkpoint store on disk: the record that vouches for the checkpoints, what is
kept, what is loaded when resuming, and what is cleaned up. The worker's checkpoint files are
written here as plain bytes."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import orjson
import pytest

from dedloc.daemon.collab.checkpoints import (
    RECORD,
    RECORD_VERSION,
    CheckpointEntry,
    CheckpointStore,
    write_atomically,
)

FINGERPRINT = "0123456789abcdef"
SPEC = {"name": "r", "workload": "tiny"}


def content(epoch: int) -> bytes:
    return f"weights of epoch {epoch} ".encode() * (100 + epoch)


def save(store: CheckpointStore, epoch: int, data: bytes | None = None) -> CheckpointEntry:
    """What a checkpoint does: the worker writes the file, then the daemon commits it."""
    store.path_for(epoch).write_bytes(content(epoch) if data is None else data)
    return store.commit(epoch, {"epoch": epoch, "samples": 10 * epoch}, SPEC)


def names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "runs" / "r" / FINGERPRINT, FINGERPRINT, keep=2)
    store.prepare()
    return store


# --- commit --------------------------------------------------------------------------------------

def test_prepare_creates_the_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "a" / "b", FINGERPRINT)
    store.prepare()
    assert store.run_dir.is_dir()
    assert store.entries() == []
    assert list(store.verified()) == []


def test_commit_records_size_hash_and_progress(store: CheckpointStore) -> None:
    entry = save(store, 3)
    data = content(3)
    assert entry == CheckpointEntry("checkpoint-000000003.pt", 3, len(data),
                                    hashlib.sha256(data).hexdigest(), {"epoch": 3, "samples": 30})
    record = orjson.loads(store.record_path.read_bytes())
    assert record["version"] == RECORD_VERSION
    assert record["fingerprint"] == FINGERPRINT
    assert record["spec"] == SPEC
    assert record["checkpoints"] == [entry.to_json()]
    assert store.entries() == [entry]


def test_path_for_is_zero_padded_so_names_sort_by_epoch(store: CheckpointStore) -> None:
    assert store.path_for(7).name == "checkpoint-000000007.pt"
    assert store.path_for(7).parent == store.run_dir
    assert sorted([store.path_for(10).name, store.path_for(9).name])[0] == store.path_for(9).name


def test_commit_lists_newest_first_and_keeps_keep(store: CheckpointStore) -> None:
    for epoch in (1, 2, 3, 4):
        save(store, epoch)
    assert [e.epoch for e in store.entries()] == [4, 3]
    assert names(store.run_dir) == {RECORD, "checkpoint-000000004.pt", "checkpoint-000000003.pt"}


@pytest.mark.parametrize("keep", [1, 3])
def test_keep(tmp_path: Path, keep: int) -> None:
    store = CheckpointStore(tmp_path, FINGERPRINT, keep=keep)
    store.prepare()
    for epoch in range(1, 6):
        save(store, epoch)
        assert [e.epoch for e in store.entries()] == list(range(epoch, max(0, epoch - keep), -1))
    files = sorted(p.name for p in tmp_path.glob("checkpoint-*.pt"))
    assert files == [store.path_for(e).name for e in range(6 - keep, 6)]


def test_keep_is_at_least_one(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, FINGERPRINT, keep=0)
    assert store.keep == 1
    save(store, 1)
    save(store, 2)
    assert [e.epoch for e in store.entries()] == [2]
    assert not store.path_for(1).exists()


def test_recommitting_an_epoch_replaces_its_entry(store: CheckpointStore) -> None:
    save(store, 1)
    save(store, 2)
    again = save(store, 2, b"rewritten")
    assert [e.epoch for e in store.entries()] == [2, 1]
    assert store.entries()[0] == again
    assert again.size == len(b"rewritten")


def test_commit_orders_by_epoch_not_by_commit_time(store: CheckpointStore) -> None:
    save(store, 5)
    save(store, 3)  # e.g. a run that resynchronised to an older state
    assert [e.epoch for e in store.entries()] == [5, 3]


def test_commit_of_a_missing_file_raises_and_changes_nothing(store: CheckpointStore) -> None:
    save(store, 1)
    before = store.record_path.read_bytes()
    with pytest.raises(FileNotFoundError):
        store.commit(2, {}, SPEC)
    assert store.record_path.read_bytes() == before


def test_a_new_store_reads_what_another_committed(store: CheckpointStore) -> None:
    save(store, 1)
    save(store, 2)
    reopened = CheckpointStore(store.run_dir, FINGERPRINT, keep=2)
    reopened.prepare()
    assert [e.epoch for e, _ in reopened.verified()] == [2, 1]


# --- verified ------------------------------------------------------------------------------------

def test_verified_yields_intact_files_newest_first(store: CheckpointStore) -> None:
    save(store, 1)
    save(store, 2)
    found = list(store.verified())
    assert [(e.epoch, p) for e, p in found] == [(2, store.path_for(2)), (1, store.path_for(1))]
    assert found[0][0].progress == {"epoch": 2, "samples": 20}
    assert store.rejected == 0


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def modify(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))


def remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [truncate, modify, remove])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(store: CheckpointStore,
                                                                damage: object) -> None:
    save(store, 1)
    save(store, 2)
    damage(store.path_for(2))  # type: ignore[operator]
    found = list(store.verified())
    assert [e.epoch for e, _ in found] == [1]
    assert store.rejected == 1


def test_every_damage_is_counted(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, FINGERPRINT, keep=4)
    store.prepare()
    for epoch in (1, 2, 3, 4):
        save(store, epoch)
    truncate(store.path_for(4))
    modify(store.path_for(3))
    remove(store.path_for(2))
    assert [e.epoch for e, _ in store.verified()] == [1]
    assert store.rejected == 3
    remove(store.path_for(1))
    assert list(store.verified()) == []
    assert store.rejected == 3 + 4


def test_a_longer_file_is_rejected(store: CheckpointStore) -> None:
    save(store, 1)
    with open(store.path_for(1), "ab") as handle:
        handle.write(b"appended")
    assert list(store.verified()) == []
    assert store.rejected == 1


def test_verified_is_lazy(store: CheckpointStore) -> None:
    save(store, 1)
    save(store, 2)
    modify(store.path_for(1))
    found = store.verified()
    entry, _ = next(found)
    assert entry.epoch == 2
    assert store.rejected == 0  # the older file is not checked until asked for


def test_a_record_of_another_fingerprint_is_ignored(store: CheckpointStore) -> None:
    save(store, 1)
    other = CheckpointStore(store.run_dir, "fedcba9876543210")
    assert other.entries() == []
    assert list(other.verified()) == []
    assert other.rejected == 0


def test_a_record_of_another_version_is_ignored(store: CheckpointStore) -> None:
    save(store, 1)
    record = orjson.loads(store.record_path.read_bytes())
    record["version"] = RECORD_VERSION + 1
    store.record_path.write_bytes(orjson.dumps(record))
    assert store.entries() == []


@pytest.mark.parametrize("garbage", [
    b"",
    b"\xff\xfe\x00garbage\x80",
    b'{"version": 2, "fingerprint": "0123',  # cut short
    b"[1, 2, 3]",
    b"null",
    b'"run"',
    random.Random(226).randbytes(64),  # the same bytes in every test process
])
def test_a_corrupt_record_gives_no_entries(store: CheckpointStore, garbage: bytes) -> None:
    store.record_path.write_bytes(garbage)
    assert store.entries() == []
    assert list(store.verified()) == []
    store.prepare()  # no exception either


@pytest.mark.parametrize("checkpoints", [5, True, "checkpoint-000000001.pt", {"a": 1}, None])
def test_a_record_with_a_malformed_list_gives_no_entries(store: CheckpointStore,
                                                         checkpoints: object) -> None:
    store.record_path.write_bytes(orjson.dumps({"version": RECORD_VERSION, "fingerprint": FINGERPRINT,
                                                "checkpoints": checkpoints}))
    assert store.entries() == []
    store.prepare()


def test_malformed_entries_are_skipped(store: CheckpointStore) -> None:
    good = save(store, 1)
    record = orjson.loads(store.record_path.read_bytes())
    record["checkpoints"] += [
        3,
        {"file": "x.pt"},  # missing fields
        {**good.to_json(), "epoch": "many"},
        {**good.to_json(), "progress": [1, 2]},
        {**good.to_json(), "file": "../escape.pt"},
        {**good.to_json(), "file": "sub/dir.pt"},
        {**good.to_json(), "file": ".hidden.pt"},
        {**good.to_json(), "file": ""},
        {**good.to_json(), "file": "nul\u0000.pt"},
    ]
    store.record_path.write_bytes(orjson.dumps(record))
    assert store.entries() == [good]
    assert [e for e, _ in store.verified()] == [good]


def test_entry_json_round_trip() -> None:
    entry = CheckpointEntry("checkpoint-000000001.pt", 1, 10, "ab" * 32, {"samples": 5})
    assert CheckpointEntry.from_json(entry.to_json()) == entry
    assert CheckpointEntry.from_json({**entry.to_json(), "progress": None}).progress == {}
    with pytest.raises(ValueError, match="object"):
        CheckpointEntry.from_json([entry.to_json()])


# --- prepare -------------------------------------------------------------------------------------

def test_prepare_removes_leftovers_but_never_a_listed_checkpoint(store: CheckpointStore) -> None:
    save(store, 1)
    save(store, 2)
    run_dir = store.run_dir
    (run_dir / "checkpoint-000000003.pt").write_bytes(b"written, never listed (killed)")
    (run_dir / "checkpoint-000000003.pt.tmp").write_bytes(b"half")
    (run_dir / f"{RECORD}.tmp").write_bytes(b"half a record")
    (run_dir / "checkpoint-000000000.pt").write_bytes(b"older, unlisted")
    (run_dir / "notes.txt").write_bytes(b"someone else's")
    (run_dir / "checkpoint-dir.pt").mkdir()  # not a file: left alone
    store.prepare()
    assert names(run_dir) == {RECORD, "checkpoint-000000001.pt", "checkpoint-000000002.pt",
                              "notes.txt", "checkpoint-dir.pt"}
    assert [e.epoch for e, _ in store.verified()] == [2, 1]


def test_prepare_keeps_a_listed_checkpoint_even_if_damaged(store: CheckpointStore) -> None:
    save(store, 1)
    modify(store.path_for(1))
    store.prepare()
    assert store.path_for(1).exists()  # prepare does not judge content; verified() does


def test_prepare_is_idempotent(store: CheckpointStore) -> None:
    save(store, 1)
    store.prepare()
    store.prepare()
    assert names(store.run_dir) == {RECORD, "checkpoint-000000001.pt"}


# --- write_atomically ----------------------------------------------------------------------------

def test_write_atomically(tmp_path: Path) -> None:
    target = tmp_path / "file.json"
    write_atomically(target, b"first")
    assert target.read_bytes() == b"first"
    write_atomically(target, b"second, longer")
    assert target.read_bytes() == b"second, longer"
    write_atomically(target, b"")
    assert target.read_bytes() == b""
    assert names(tmp_path) == {"file.json"}


def test_write_atomically_replaces_a_stale_tmp(tmp_path: Path) -> None:
    target = tmp_path / "file.json"
    (tmp_path / "file.json.tmp").write_bytes(b"left by a killed write" * 100)
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new"
    assert names(tmp_path) == {"file.json"}


def test_commit_leaves_no_tmp_behind(store: CheckpointStore) -> None:
    for epoch in range(1, 4):
        save(store, epoch)
    assert not [name for name in names(store.run_dir) if name.endswith(".tmp")]
