"""benchmarks/workloads.py --quick: both paper workloads (albert-large, SwAV ResNet-50) build, train
a step through the worker's Session and report throughput, memory and their parameter counts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads.py"

ALBERT_LARGE_PARAMETERS = 17.85e6  # one shared 1024-wide layer, 128-dim embeddings of 30000 tokens
RESNET50_TRUNK_PARAMETERS = 23_508_032  # torchvision's resnet50 without its classifier
SWAV_HEAD_PARAMETERS = (2048 * 2048 + 2048) + 2 * 2048 + (2048 * 128 + 128)  # Linear, BatchNorm, Linear
SWAV_PROTOTYPE_PARAMETERS = 128 * 3000


@pytest.mark.timeout(600)
def test_quick_run_measures_both_workloads(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", "--steps", "1", "--warmup", "1",
         "--cache-dir", str(tmp_path / "albert-cache")],
        capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 1, completed.stdout  # --json: exactly one object on stdout
    summary = orjson.loads(lines[0])
    assert summary["benchmark"] == "workloads"
    assert summary["quick"] is True
    results = {r["workload"]: r for r in summary["results"]}
    assert set(results) == {"albert", "swav"}
    for result in results.values():
        assert "error" not in result, result
        assert result["device"] == summary["device"]
        assert result["steps"] == 1 and result["warmup_steps"] == 1
        assert len(result["seconds_per_step"]) == 1 and len(result["losses"]) == 2
        assert result["samples_per_second"] > 0
        assert result["seconds_per_step_median"] > 0
        assert result["apply_seconds_median"] > 0
        assert math.isfinite(result["loss_first"]) and math.isfinite(result["loss_last"])
        assert result["peak_rss_mib"] > 0 and result["peak_rss_increase_mib"] > 0
        assert result["peak_rss_mib"] >= result["rss_before_build_mib"]
        assert result["leftover_threads"] == []
        assert result["torch_threads"] >= 1
        if summary["device"] == "cuda":
            assert result["cuda_max_allocated_mib"] > 0
        assert sum(result["parameters_by_module"].values()) == result["parameters"]

    albert = results["albert"]
    assert albert["preset"] == "albert-large"
    assert albert["batch_size"] == 1 and albert["max_seq_length"] == 128
    assert albert["parameters"] == pytest.approx(ALBERT_LARGE_PARAMETERS, rel=0.01)
    assert albert["tokens_per_second"] == pytest.approx(albert["samples_per_second"] * 128, rel=0.01)
    assert albert["mixed_precision"] in (("off",) if summary["device"] == "cpu" else ("bfloat16", "float16"))

    swav = results["swav"]
    assert swav["preset"] == "resnet50"
    assert swav["batch_size"] == 2 and swav["crops"] == "2,6"
    by_module = swav["parameters_by_module"]
    assert by_module["trunk"] == RESNET50_TRUNK_PARAMETERS
    assert by_module["head"] == SWAV_HEAD_PARAMETERS
    assert by_module["prototypes"] == SWAV_PROTOTYPE_PARAMETERS
    assert swav["parameters"] == RESNET50_TRUNK_PARAMETERS + SWAV_HEAD_PARAMETERS + SWAV_PROTOTYPE_PARAMETERS
