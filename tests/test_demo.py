"""`make demo` (shortened): four trainer daemons, one joining midway, and an aux daemon; the loss
goes down."""

from __future__ import annotations

import subprocess
import sys

import orjson


def test_demo_collaboration() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dedloc.cli.demo", "--target-batch-size", "256", "--join-epoch", "2",
         "--min-epochs", "5", "--max-seconds", "240"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert summary["peers"] == 4 and summary["joined"] == 1
    assert summary["aux"] == 1 and summary["aux_rounds"] >= 1
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["epochs"] >= 5
    assert summary["daemon_exit_codes"] == [0, 0, 0, 0, 0]
