"""benchmarks/local_updates.py: its configurations, sample budget and result assembly, and a smoke
run with the `tiny` workload and 2 daemons (gradients, local H=2, a codec the manifest may refuse,
the reference trainer alone). No timing is asserted."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "local_updates.py"


lu = load_benchmark("local_updates")


def test_configuration_names() -> None:
    specs = lu.parse_configs("gradients, local_h25,local_h100_topk,gradients_fp16,alone")
    assert [(s.name, s.sync, s.inner_steps, s.compression) for s in specs] == [
        ("gradients", "gradients", 0, "none"), ("local_h25", "local", 25, "none"),
        ("local_h100_topk", "local", 100, "topk"), ("gradients_fp16", "gradients", 0, "fp16"),
        ("alone", "alone", 0, "none")]
    assert [s.epoch_batches for s in specs] == [1, 25, 100, 1, 1]
    for bad in ("local", "local_h0", "alone_fp16", "diloco", "gradients,gradients", ""):
        with pytest.raises(ValueError):
            lu.parse_configs(bad)


def test_the_shaped_part_gives_local_runs_more_samples_only_when_asked() -> None:
    args = lu.build_parser().parse_args(["--configs", "gradients,local_h25", "--workload", "tiny"])
    assert lu.make_plan(args).shaped_local_budget == 3
    args = lu.build_parser().parse_args(["--local-workload-config", '{"lr": 0.5}', "--workload",
                                         "tiny", "--workload-config", '{"hidden": 8}'])
    plan = lu.make_plan(args)
    assert plan.local_config == {"lr": 0.5} and plan.config["hidden"] == 8 and "lr" not in plan.config
    args = lu.build_parser().parse_args(["--shaped-local-budget", "0"])
    with pytest.raises(ValueError, match="shaped-local-budget"):
        lu.make_plan(args)


def test_local_runs_scale_the_inner_lr_unless_their_config_gives_the_inner_lr() -> None:
    def plan(*extra: str) -> Any:
        return lu.make_plan(lu.build_parser().parse_args(["--workload", "tiny", *extra]))

    assert "inner_lr_scale" not in plan().outer  # the daemon's default: auto
    assert plan("--local-workload-config", '{"lr": 0.5}').outer["inner_lr_scale"] == 1.0
    assert plan("--local-workload-config", '{"lr": 0.5}', "--inner-lr-scale", "auto"
                ).outer["inner_lr_scale"] == "auto"
    assert plan("--inner-lr-scale", "0.5").outer["inner_lr_scale"] == 0.5
    (local,) = lu.parse_configs("local_h4")
    params = lu.run_params(local, "tiny", {"batch_size": 16}, 2, 32, 1280, 4, {"inner_lr_scale": 0.5})
    assert params["inner_lr_scale"] == 0.5 and lu.manifest_problem(params) is None
    params["inner_lr_scale"] = 20.0
    assert "inner_lr_scale" in (lu.manifest_problem(params) or "")


def test_the_budget_is_whole_outer_steps_of_the_largest_h() -> None:
    specs = lu.parse_configs("gradients,local_h25,local_h100")
    assert lu.sample_budget(None, 64, specs, 3) == 3 * 100 * 64
    assert lu.sample_budget(6400, 64, specs, 3) == 6400
    assert lu.sample_budget(6401, 64, specs, 3) == 2 * 6400
    assert lu.sample_budget(10, 64, lu.parse_configs("gradients"), 3) == 64


def test_run_parameters_give_every_configuration_the_same_samples() -> None:
    gradients, local = lu.parse_configs("gradients,local_h4")
    a = lu.run_params(gradients, "tiny", {"batch_size": 16}, 2, 32, 1280, 4)
    b = lu.run_params(local, "tiny", {"batch_size": 16}, 2, 32, 1280, 4, {"outer_lr": 1.0})
    assert a["epochs"] * a["target_batch_size"] == b["epochs"] * b["inner_steps"] * b["target_batch_size"]
    assert (a["epochs"], a["checkpoint_every"], b["epochs"], b["checkpoint_every"]) == (40, 10, 10, 2)
    assert "sync" not in a and b["sync"] == "local" and b["outer_lr"] == 1.0
    assert a["min_peers"] == 2 and a["average_state_every"] == 0 and a["name"] != b["name"]
    assert lu.manifest_problem(a) is None and lu.manifest_problem(b) is None
    bad = lu.run_params(gradients, "tiny", {}, 2, 32, 1280, 4)
    bad["compression"] = "no-such-codec"
    problem = lu.manifest_problem(bad)
    assert problem is not None and "no-such-codec" in problem


def test_samples_at_interpolates_between_polls() -> None:
    progress = [(0.0, 0), (1.0, 100), (2.0, 300)]
    assert lu.samples_at(progress, 0.5, 400) == 50
    assert lu.samples_at(progress, 1.5, 400) == 200
    assert lu.samples_at(progress, 3.0, 400) == 400


def test_loss_at_samples_interpolates_the_curve() -> None:
    curve = [[1, 1, 100, 4.0], [2, 2, 300, 2.0]]
    assert lu.loss_at_samples(curve, 200) == 3.0
    assert lu.loss_at_samples(curve, 100) == 4.0
    assert lu.loss_at_samples(curve, 50) is None  # before the first checkpoint
    assert lu.loss_at_samples(curve, 400) == 2.0


def _entry(name: str, loss: float, bps: float, curve: list[list[float]]) -> dict[str, Any]:
    return {"name": name, "heldout_loss": loss, "bytes_per_sample": bps, "curve": curve}


def test_goals_compare_each_local_configuration_with_gradients() -> None:
    configs = [_entry("gradients", 2.0, 10000.0, [[10, 1, 64, 3.0], [20, 2, 128, 2.0]]),
               _entry("local_h25", 2.05, 400.0, [[5, 1, 64, 2.5], [8, 2, 128, 2.05]]),
               _entry("local_h100", 2.1, 50.0, [[5, 1, 64, 2.2], [9, 2, 128, 2.1]]),
               {"name": "local_h25_topk", "skipped": "refused"}]
    shaped = [_entry("gradients", 2.0, 10000.0, [[50, 1, 64, 3.0], [100, 2, 128, 2.0]]),
              _entry("local_h25", 2.0, 400.0, [[10, 1, 64, 2.4], [15, 2, 128, 1.9]])]
    lu.finish_entries(configs, 128)
    lu.finish_entries(shaped, 128)
    assert configs[0]["seconds_to_gradients_loss"] == 20
    assert configs[1]["seconds_to_gradients_loss"] is None and configs[2]["seconds_to_gradients_loss"] is None
    assert shaped[1]["seconds_to_gradients_loss"] == 15
    assert [e["heldout_loss_at_budget"] for e in configs[:3]] == [2.0, 2.05, 2.1]
    result = {r["name"]: r for r in lu.goals(configs, shaped)["results"]}
    assert set(result) == {"local_h25", "local_h100"}
    h25, h100 = result["local_h25"], result["local_h100"]
    assert h25["bytes_per_sample_reduction"] == 25.0 and not h25["bytes_goal_met"]
    assert h25["heldout_loss_vs_gradients"] == pytest.approx(0.025) and h25["loss_goal_met"]
    assert h25["heldout_loss_at_budget_vs_gradients"] == pytest.approx(0.025)
    assert h25["shaped_speedup"] == pytest.approx(100 / 15, abs=0.01) and h25["shaped_goal_met"]
    assert h100["bytes_per_sample_reduction"] == 200.0 and h100["bytes_goal_met"]
    assert not h100["loss_goal_met"] and "shaped_speedup" not in h100


def test_a_failed_run_is_reported_with_what_it_reached() -> None:
    configs = [_entry("gradients", 2.0, 10000.0, [[10, 1, 64, 3.0], [20, 2, 128, 2.0]]),
               {**_entry("local_h25", 1.9, 400.0, [[5, 1, 64, 2.5], [8, 2, 128, 1.9]]),
                "failed": "daemon 2's run is failed: diverged"}]
    shaped = [_entry("gradients", 2.0, 10000.0, [[50, 1, 64, 3.0], [100, 2, 128, 2.0]]),
              {**_entry("local_h25", 1.9, 400.0, [[10, 1, 64, 2.4], [20, 2, 128, 1.9]]),
               "failed": "not finished within 10 s"}]
    lu.finish_entries(configs, 128)
    lu.finish_entries(shaped, 128)
    (row,) = lu.goals(configs, shaped)["results"]
    assert row["failed"].endswith("diverged") and row["loss_goal_met"] is False
    assert row["shaped_failed"] == "not finished within 10 s" and row["shaped_speedup"] == 5.0


@pytest.mark.timeout(240)
def test_smoke_run_with_the_tiny_workload(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--workload", "tiny", "--peers", "2",
         "--samples", "256", "--configs", "gradients,local_h2,local_h2_topk,alone",
         "--curve-points", "2", "--eval-samples", "128", "--max-seconds", "120"],
        capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 1, completed.stdout  # --json: exactly one object on stdout
    summary = orjson.loads(lines[0])
    assert summary["benchmark"] == "local_updates" and summary["peers"] == 2
    assert summary["target_batch_size"] == 32 and summary["samples_per_config"] == 256
    entries = {e["name"]: e for e in summary["configs"]}
    assert list(entries) == ["gradients", "local_h2", "local_h2_topk", "alone"]
    topk = entries.pop("local_h2_topk")
    if "skipped" in topk:  # a dedloc whose manifests do not take topk says why
        assert "topk" in topk["skipped"]
    else:
        entries["local_h2_topk"] = topk
    for name, entry in entries.items():
        assert entry["samples"] >= 256, entry
        assert math.isfinite(entry["heldout_loss"]) and entry["wall_seconds"] > 0, entry
        assert entry["curve"] and entry["curve"][-1][3] == entry["heldout_loss"], entry
        assert entry["curve"][-1][1] == entry["epochs"], entry
        if name == "alone":
            assert entry["bytes_sent_per_peer"] == 0
        else:
            assert entry["bytes_sent_per_peer"] > 0 and entry["bytes_per_sample"] > 0, entry
            assert entry["failed_rounds"] == 0, entry
    # a local run with H=2 exchanges about half of what the gradient rounds do, per sample
    assert entries["local_h2"]["bytes_per_sample"] < entries["gradients"]["bytes_per_sample"]
    assert entries["gradients"]["seconds_to_gradients_loss"] is not None
    assert summary["shaped"]["configs"] == [] and "--shaped" in summary["shaped"]["skipped"]
    assert [r["name"] for r in summary["goals"]["results"]] == [
        n for n in ("local_h2", "local_h2_topk") if n in entries]
