"""`make demo` (shortened): four trainer daemons, one joining midway, and an aux daemon; the loss
goes down."""

from __future__ import annotations

import argparse
import subprocess
import sys

import orjson

from dedloc.cli.demo import StallWatch, waiting_for


def test_demo_collaboration() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dedloc.cli.demo", "--target-batch-size", "256", "--join-epoch", "2",
         "--min-epochs", "5"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert summary["peers"] == 4 and summary["joined"] == 1
    assert summary["aux"] == 1 and summary["aux_rounds"] >= 1
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["epochs"] >= 5
    assert summary["daemon_exit_codes"] == [0, 0, 0, 0, 0]


def test_the_demo_gives_up_only_when_nothing_moves() -> None:
    watch = StallWatch(minimum=120)
    watch.observe(0.0, (1,))
    assert not watch.stalled(100.0)  # slow, not stalled
    watch.observe(100.0, (2,))  # an epoch took 100 s: the window grows to 500 s
    assert not watch.stalled(400.0) and watch.stalled(601.0)
    watch.observe(601.0, (2,))  # the same value is no move
    assert watch.stalled(601.0)


def test_the_demo_says_what_it_waits_for() -> None:
    args = argparse.Namespace(min_epochs=3, join_epoch=2, peers=3)
    status = {"epoch_losses": [2.0, 1.8]}
    assert waiting_for(status, None, args, 0.5) == [
        "3 epochs (at 2)", "the loss at 0.5 of the first epoch's (now 0.90)",
        "epoch 2, when a fourth trainer joins"]
    late = {"state_downloads": 1, "last_round": {"senders": 3}}
    status = {"epoch_losses": [2.0, 1.8, 0.9]}
    assert waiting_for(status, late, args, 0.5) == ["a round of all 4 trainers with the newcomer in it"]
    late["last_round"]["senders"] = 4
    assert waiting_for(status, late, args, 0.5) == []
