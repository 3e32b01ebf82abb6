"""`dedloc status` for people: render_status on full, minimal and None-filled statuses (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from dedloc.cli.render import format_bytes, format_duration, render_status

OWN = "Bq7KzWmN3xYt" + "own-rest-of-the-id"


def full_status(**changes: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": "swarm", "workload": "mnist", "state": "running", "role": "trainer",
        "phase": "averaging", "peer_id": OWN,
        "epoch": 11, "run_epoch": 12, "epochs": 100,
        "samples": 5000, "accumulated": 300, "target_batch_size": 2000,
        "run_samples_accumulated": 1000, "run_eta_seconds": 184.2,
        "run_peers": 4, "run_aux_peers": 1,
        "samples_per_second": 120.53, "run_samples_per_second": 480.2,
        "loss": 0.43214, "loss_first": 2.30259, "collaborative": True,
        "last_round": {"group_size": 4, "seconds": 0.1234, "bytes_sent": 1_200_000,
                       "bytes_received": 1_150_000, "failed_parts": []},
        "epoch_overhead_seconds": 0.8, "run_epoch_overhead_seconds": 1.4,
        "contributions": {OWN: 5000, "Cx1aaaaaaaaaXXXX": 9000, "Dy2bbbbbbbbbYYYY": 7000,
                          "Ez3ccccccccc": 100},
        "failed_rounds": 0, "state_downloads": 0, "skipped_steps": 0, "restarts": 0,
        "error": None, "worker": {"state": "running", "last_log_lines": []},
    }
    status.update(changes)
    return status


def test_full_status_shows_every_fact() -> None:
    text = render_status(full_status())
    lines = text.splitlines()
    assert lines[0].startswith("swarm [mnist]  running")
    assert "epoch 12/100 (own 11)" in lines[0]
    assert "trainer" in text and "averaging" in text
    (step,) = [line for line in lines if "next step" in line]
    assert "[" + "#" * 10 + "." * 10 + "]  50.0%" in step
    assert "1,000/2,000 samples" in step and "eta 3m04s" in step
    assert "4 peers training · 1 aux" in text
    assert "own 120.5 samples/s" in text and "run 480.2 samples/s" in text
    assert "0.4321 (from 2.3026)" in text
    assert "group 4 · 0.12 s · ↑1.2 MB ↓1.1 MB" in text and "failed" not in text
    assert "own 0.80 s" in text and "run worst 1.40 s" in text
    assert "5,000 by this peer" in text and "21,100 from 4 peers" in text
    assert "events" not in text and "error" not in text


def test_contributions_are_sorted_shortened_and_own_peer_marked() -> None:
    lines = render_status(full_status()).splitlines()
    start = next(i for i, line in enumerate(lines) if "run samples" in line) + 1
    table = lines[start:start + 4]
    assert [row.split()[0] for row in table] == ["Cx1aaaaaaaaa", "Dy2bbbbbbbbb", "Bq7KzWmN3xYt",
                                                  "Ez3ccccccccc"]
    assert [row.split()[1] for row in table] == ["9,000", "7,000", "5,000", "100"]
    assert table[2].endswith("(you)") and not any(row.endswith("(you)") for row in table[:2] + table[3:])
    assert "XXXX" not in "\n".join(table) and "own-rest" not in "\n".join(table)


def test_contributions_table_stops_at_ten_rows() -> None:
    contributions = {f"peer{i:02d}-" + "x" * 40: 1000 - i for i in range(25)}
    contributions[OWN] = 1
    text = render_status(full_status(contributions=contributions))
    assert "peer00-xxxxx" in text and "peer09-xxxxx" in text and "peer10" not in text
    assert "… and 16 more (this peer is #26)" in text
    assert "from 26 peers" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(("peer0", "peer1"))]
    assert len(rows) == 10


def test_failed_round_and_counters_are_flagged() -> None:
    text = render_status(full_status(
        last_round={"group_size": 3, "seconds": 2.5, "bytes_sent": 999, "bytes_received": 0,
                    "failed_parts": [[0, 100], [200, 300]]},
        failed_rounds=2, state_downloads=1, skipped_steps=0, restarts=3,
        error={"message": "worker crashed", "code": -32001}))
    (round_line,) = [line for line in text.splitlines() if "last round" in line]
    assert "group 3 · 2.50 s · ↑999 B ↓0 B" in round_line and "failed (2 parts not averaged)" in round_line
    assert "2 failed rounds · 1 state download · 3 restarts" in text
    assert "skipped" not in text
    assert "error       worker crashed" in text


def test_phase_reads_as_words() -> None:
    assert "trainer · now downloading state" in render_status(full_status(phase="downloading_state"))
    assert "role        — · now syncing" in render_status({"phase": "syncing"})
    assert "role" not in render_status(full_status(role=None, phase=None))


def test_single_peer_and_aux_counts() -> None:
    text = render_status(full_status(run_peers=1, run_aux_peers=0))
    assert "1 peer training · 0 aux" in text


def test_aux_peer_without_loss_or_samples() -> None:
    text = render_status(full_status(
        role="aux", phase="idle", loss=None, loss_first=None, samples=0, accumulated=0,
        samples_per_second=None, run_eta_seconds=None, epoch=12))
    assert "aux · now idle" in text
    assert "loss" not in text and "by this peer" not in text
    assert "eta —" in text
    assert "epoch 12/100" in text and "own" not in text.splitlines()[0]
    assert "run 480.2 samples/s" in text and "own —" not in text


@pytest.mark.parametrize("status", [{}, {"name": "x"}, dict.fromkeys(full_status())])
def test_minimal_and_none_filled_statuses_do_not_crash(status: dict[str, Any]) -> None:
    text = render_status(status)
    assert text.endswith("\n") and "None" not in text


def test_none_filled_collaborative_status_shows_dashes() -> None:
    status = dict.fromkeys(full_status())
    status.update(name="swarm", workload="mnist", state="running", collaborative=True)
    text = render_status(status)
    assert text.startswith("swarm [mnist]  running\n")
    assert "None" not in text
    assert "peers       not known yet" in text
    assert "last round  none yet" in text
    assert "own — · run —" in text
    assert "loss        —" in text


def test_partial_last_round_and_odd_values() -> None:
    text = render_status(full_status(last_round={"group_size": 2}, contributions={"p": None, "q": 5},
                                     run_eta_seconds=float("nan"), epochs=None, run_epoch=None))
    assert "group 2 · — · ↑— ↓—" in text
    assert "eta —" in text
    assert "epoch 11\n" in text or text.splitlines()[0].endswith("epoch 11")
    table = text.splitlines()[-2:]
    assert table[0].split() == ["q", "5"] and table[1].split() == ["p", "—"]


def test_local_run_keeps_its_short_form() -> None:
    text = render_status({
        "name": "tiny", "workload": "tiny", "state": "finished", "epoch": 3, "epochs": 3,
        "samples": 96, "accumulated": 8, "target_batch_size": 32, "loss": 0.1, "loss_first": 2.0,
        "samples_per_second": 300.0, "collaborative": False, "run_peers": None, "contributions": {},
        "last_round": None, "failed_rounds": 0, "state_downloads": 0, "skipped_steps": 0,
        "restarts": 0, "error": None})
    assert text.splitlines()[0] == "tiny [tiny]  finished · epoch 3/3"
    assert "25.0%  8/32 samples" in text
    assert "eta" not in text and "peers" not in text and "last round" not in text
    assert "300.0 samples/s" in text and "96 trained" in text


def test_crashed_run_shows_the_workers_last_lines() -> None:
    text = render_status(full_status(state="crashed", error={"message": "exit 1"},
                                     worker={"last_log_lines": [f"line {i}" for i in range(15)]}))
    assert "worker's last lines" in text and "line 14" in text and "line 4\n" not in text


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "—"), ("soon", "—"), (float("inf"), "—"), (float("nan"), "—"), (True, "—"),
    (0, "0s"), (0.2, "<1s"), (-5, "0s"), (0.6, "1s"), (12, "12s"), (12.4, "12s"), (59.4, "59s"),
    (59.6, "1m00s"), (60, "1m00s"), (184.2, "3m04s"), (3599, "59m59s"), (3600, "1h00m"),
    (3720, "1h02m"), (3749, "1h02m"), (86399, "1d00h"), (86400, "1d00h"), (90000, "1d01h"),
])
def test_format_duration(seconds: Any, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("count", "text"), [
    (None, "—"), (0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (1_200_000, "1.2 MB"),
    (3_500_000_000, "3.5 GB"), (7e12, "7.0 TB"),
])
def test_format_bytes(count: Any, text: str) -> None:
    assert format_bytes(count) == text


def test_a_local_update_run_shows_its_outer_and_inner_steps() -> None:
    sync = {"mode": "local", "inner_steps": 25, "outer_step": 7, "inner_step": 12,
            "bytes_sent_per_step": 2_500_000, "compression_ratio": 102.4}
    text = render_status(full_status(sync=sync, run_samples_accumulated=25_000))
    (step,) = [line for line in text.splitlines() if "next outer step" in line]
    assert "25,000/50,000 samples" in step  # H target batches per outer step
    (row,) = [line for line in text.splitlines() if line.lstrip().startswith("sync")]
    assert "local updates, H 25 · outer step 7 · inner step 12 · ↑2.5 MB/outer step" in row
    assert "compression ×102.4" in row and "inner lr" not in row  # no inner step yet
    sync.update(inner_lr=0.0075, inner_lr_scale="auto")
    (row,) = [line for line in render_status(full_status(sync=sync)).splitlines()
              if line.lstrip().startswith("sync")]
    assert row.endswith("inner lr 0.0075 (auto)")
    # a gradients run has no sync row
    assert not [line for line in render_status(full_status(sync={"mode": "gradients"})).splitlines()
                if line.lstrip().startswith("sync")]
