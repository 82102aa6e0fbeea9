"""The GPU benchmark scripts run end to end on the CPU (``--dry-run``: tiny shapes, no timing), so a
script broken by a change fails here rather than on the device."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,expect", [
    ("bench_e2e.py", "B x ctx"),
    ("eval_fp8.py", "greedy agree"),
    ("bench_fp8_linear.py", "max |fp8_linear - reference|"),
    ("eval_two_stage_match.py", "agree exact"),
    ("bench_selectors.py", "every kernel equals its reference"),
    ("bench_serving.py", "output tok/s"),
    ("profile_serving_steps.py", "token_gap_ms"),
    ("find_host_syncs.py", "synchronising call sites"),
    ("bench_engine_steps.py", "budget"),
    ("bench_ttft.py", "on/off"),
    ("eval_completion_budgets.py", "completion gated exhaustive"),
    ("bench_tp.py", "step ms"),
    ("bench_offload.py", "offloaded = reference: yes"),
    ("eval_calibrated_threshold.py", "skip at equal agreement"),
    ("bench_mka_decode.py", "step / base"),
])
def test_benchmark_dry_run(script, expect):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert expect in run.stdout, run.stdout[-3000:]
