"""``eval_completion_budgets.py --merge``: runs of disjoint budgets (one process each, possibly on different GPUs)
joined into one report."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import eval_completion_budgets as ecb  # noqa: E402


def _run(budget: float, gpu: str | None, full_accuracy: float = 0.5) -> dict:
    name = f"top-k alone pages N=64 b={budget:g} k=3"
    return {"benchmark": "eval_completion_budgets", "gpu": gpu, "seconds": 10.0 * budget,
            "settings": {"budgets": [budget], "selectors": ["pages"], "lengths": [64]},
            "gates": {f"{budget:g} pages N=64": {"gate": [False]}},
            "rows": [{"method": name, "length": 64, "greedy_agreement": 0.9}],
            "raw": {"64 pages": {"methods": {"full": {"accuracy": {"t": full_accuracy}}, name: {"x": budget}}}}}


def test_merge_joins_disjoint_budgets_and_names_every_gpu():
    out = ecb.merge([_run(0.02, "H200"), _run(0.01, "H100"), _run(0.05, "H200")])
    assert out["settings"]["budgets"] == [0.01, 0.02, 0.05] and out["settings"]["selectors"] == ["pages"]
    assert len(out["rows"]) == 3 and set(out["gates"]) == {"0.01 pages N=64", "0.02 pages N=64", "0.05 pages N=64"}
    assert len(out["raw"]["64 pages"]["methods"]) == 4                        # full + one method per run
    assert out["gpu"] == "H100, H200" and [m["gpu"] for m in out["merged_from"]] == ["H200", "H100", "H200"]
    assert out["seconds"] == 0.5
    assert ecb.merge([_run(0.01, None)])["gpu"] is None                      # CPU runs name no GPU


def test_merge_refuses_overlapping_budgets_and_different_prompts():
    with pytest.raises(ValueError, match="overlap"):
        ecb.merge([_run(0.01, "H100"), _run(0.01, "H100")])
    with pytest.raises(ValueError, match="full attention differs"):
        ecb.merge([_run(0.01, "H100"), _run(0.02, "H100", full_accuracy=0.25)])
