"""Shared buffers the daemon owns: named after their owner's pid, so a dead owner's are swept."""

from __future__ import annotations

import os
from pathlib import Path

from dedloc.daemon.workers.buffers import SharedBuffer


def test_orphans_of_dead_daemons_are_swept(tmp_path: Path) -> None:
    """A daemon killed with SIGKILL leaves its segments; the next start removes those whose
    owner is dead, and only those."""
    import subprocess
    import sys

    from dedloc.daemon.workers.buffers import sweep_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f"dedloc-{dead_pid}-00aa11bb22cc"
    mine = tmp_path / f"dedloc-{os.getpid()}-00aa11bb22cc"
    foreign = tmp_path / f"other-{dead_pid}-00aa11bb22cc"
    unnamed = tmp_path / "dedloc-00aa11bb22cc"
    for path in (orphan, mine, foreign, unnamed):
        path.write_bytes(b"x")
    assert sweep_orphans(directory=tmp_path) == 1
    assert not orphan.exists() and mine.exists() and foreign.exists() and unnamed.exists()
    buffer = SharedBuffer(4)
    try:
        assert buffer.name.startswith(f"dedloc-{os.getpid()}-")
    finally:
        buffer.close()
