"""benchmarks/board.py: a board read of summaries brings every report, in fewer bytes than three
nodes' full replies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "board.py"


@pytest.mark.timeout(300)
def test_board_reads_side_by_side() -> None:
    completed = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "24", "--reads", "6", "--json"],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 1, completed.stdout  # --json: exactly one object on stdout
    result = orjson.loads(lines[0])
    assert result["benchmark"] == "board" and result["reads"] == 6
    # every way reads every report
    assert result["three_full_entries_per_read"] == result["summaries_entries_per_read"] == 24
    assert result["lookup_entries_per_read"] == result["lookup_by_route_entries_per_read"] == 24
    assert result["lookup_by_route_bytes_per_read"] < result["lookup_bytes_per_read"]
    assert result["summaries_bytes_per_read"] < result["three_full_bytes_per_read"]
    assert result["bytes_ratio"] > 1
