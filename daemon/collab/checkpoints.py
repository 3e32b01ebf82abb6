"""A run's checkpoints on disk: versioned worker checkpoints and one record that vouches for them.

Each checkpoint is a file of its own, `checkpoint-<epoch>.pt`, which the worker writes atomically.
The daemon then hashes it and rewrites `run.json` atomically (write, fsync, rename, fsync the
directory) to list it, newest first, with its epoch, size, SHA-256 and the run's progress at that
epoch. Only a listed file whose size and hash still match is ever loaded, so a checkpoint cut
short by a kill (the daemon or the machine dying before the record lists it, or a file damaged
later) is skipped for the previous one. The last `keep` checkpoints are kept; leftovers of killed
writes are removed when the store opens.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

log = structlog.get_logger(__name__)

RECORD = "run.json"
RECORD_VERSION = 2


@dataclass(frozen=True)
class CheckpointEntry:
    file: str
    epoch: int
    size: int
    sha256: str
    progress: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "epoch": self.epoch, "size": self.size, "sha256": self.sha256,
                "progress": self.progress}

    @classmethod
    def from_json(cls, data: Any) -> CheckpointEntry:
        if not isinstance(data, dict):
            raise ValueError("a checkpoint entry must be an object")
        entry = cls(str(data["file"]), int(data["epoch"]), int(data["size"]), str(data["sha256"]),
                    dict(data.get("progress") or {}))
        if not entry.file or "/" in entry.file or "\0" in entry.file or entry.file.startswith("."):
            raise ValueError(f"checkpoint file name {entry.file!r} is not a plain name")
        return entry


class CheckpointStore:
    def __init__(self, run_dir: Path, fingerprint: str, keep: int = 2) -> None:
        self.run_dir = run_dir
        self.fingerprint = fingerprint
        self.keep = max(1, keep)
        self.rejected = 0  # listed checkpoints that failed their check when resuming

    @property
    def record_path(self) -> Path:
        return self.run_dir / RECORD

    def path_for(self, epoch: int) -> Path:
        return self.run_dir / f"checkpoint-{epoch:09d}.pt"

    def prepare(self) -> None:
        """Create the directory and remove what killed writes left (never a listed checkpoint)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        listed = {entry.file for entry in self.entries()}
        for path in self.run_dir.iterdir():
            name = path.name
            leftover = (name.endswith(".tmp")
                        or (name.startswith("checkpoint-") and name.endswith(".pt") and name not in listed))
            if leftover and path.is_file():
                with contextlib.suppress(OSError):
                    path.unlink()
                    log.info("checkpoint_leftover_removed", path=str(path))

    def _read_record(self) -> dict[str, Any] | None:
        try:
            record = orjson.loads(self.record_path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError) as exc:
            log.warning("run_record_unreadable", path=str(self.record_path), error=str(exc))
            return None
        if not isinstance(record, dict) or record.get("fingerprint") != self.fingerprint:
            if isinstance(record, dict):
                log.info("checkpoint_of_other_manifest_ignored", path=str(self.record_path))
            return None
        return record

    def entries(self) -> list[CheckpointEntry]:
        """The listed checkpoints of this manifest, newest first."""
        record = self._read_record()
        if record is None or record.get("version") != RECORD_VERSION:
            return []
        entries = []
        items = record.get("checkpoints")
        for item in items if isinstance(items, list) else []:
            try:
                entries.append(CheckpointEntry.from_json(item))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("checkpoint_entry_malformed", error=str(exc))
        return sorted(entries, key=lambda e: e.epoch, reverse=True)

    def verified(self) -> Iterator[tuple[CheckpointEntry, Path]]:
        """The listed checkpoints whose file is intact, newest first (hashing runs in the caller's
        thread: call it through asyncio.to_thread)."""
        for entry in self.entries():
            path = self.run_dir / entry.file
            problem = _check_file(path, entry)
            if problem is None:
                yield entry, path
                continue
            self.rejected += 1
            log.warning("checkpoint_rejected", path=str(path), epoch=entry.epoch, reason=problem)

    def commit(self, epoch: int, progress: dict[str, Any], spec: dict[str, Any]) -> CheckpointEntry:
        """List the worker's freshly written `path_for(epoch)` in the record; drop old ones."""
        path = self.path_for(epoch)
        digest, size = _sha256(path)
        entry = CheckpointEntry(path.name, epoch, size, digest, progress)
        kept = [entry, *(e for e in self.entries() if e.file != entry.file)][: self.keep]
        record = {"version": RECORD_VERSION, "fingerprint": self.fingerprint, "spec": spec,
                  "checkpoints": [e.to_json() for e in kept]}
        write_atomically(self.record_path, orjson.dumps(record, option=orjson.OPT_INDENT_2))
        keep_files = {e.file for e in kept}
        for old in self.run_dir.glob("checkpoint-*.pt"):
            if old.name not in keep_files:
                with contextlib.suppress(OSError):
                    old.unlink()
        return entry

    def discard_unlisted(self, epoch: int) -> None:
        """Remove what a failed save at `epoch` left (its file unless listed, the record's .tmp)."""
        listed = {entry.file for entry in self.entries()}
        name = self.path_for(epoch).name
        left = [self.path_for(epoch), self.record_path.with_name(RECORD + ".tmp"),
                *self.run_dir.glob(f".{name}.*.tmp")]  # (the worker's temporary file)
        for path in left:
            if path.name not in listed:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)


def _sha256(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _check_file(path: Path, entry: CheckpointEntry) -> str | None:
    try:
        if path.stat().st_size != entry.size:
            return f"size {path.stat().st_size} is not the recorded {entry.size} (cut short)"
        digest, _ = _sha256(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable: {exc}"
    if digest != entry.sha256:
        return "content does not match the recorded SHA-256 (damaged)"
    return None


def write_atomically(path: Path, data: bytes) -> None:
    """Write, fsync, rename over `path`, fsync the directory: the old file or the new, never torn."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
