"""``profile_serving_steps.summarize``: a stream's token gaps and the engine calls inside the largest ones, on a
hand-made log (the script's end-to-end run is in ``test_dry_runs.py``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from profile_serving_steps import summarize  # noqa: E402


def test_gaps_and_the_calls_inside_the_largest():
    # calls: (start s, seconds, decodes, prefill tokens, chunks, outputs); three 10 ms decode calls, one 50 ms mixed
    calls = [(0.00, 0.010, 2, 0, 0, 2), (0.01, 0.010, 2, 0, 0, 2), (0.02, 0.050, 1, 512, 1, 1),
             (0.07, 0.010, 2, 0, 0, 2)]
    # request 1 decodes in every call; request 2 sits out the mixed call (its gap spans two calls)
    tokens = [(0.010, 1), (0.010, 2), (0.020, 1), (0.020, 2), (0.070, 1), (0.080, 1), (0.080, 2)]
    s = summarize(calls, tokens, top=2)
    assert s["gaps"] == 5 and s["calls"] == 4
    assert s["largest_gaps"][0]["request"] == 2 and s["largest_gaps"][0]["ms"] == pytest.approx(60.0)
    inside = s["largest_gaps"][0]["calls"]
    assert [c["prefill_tokens"] for c in inside] == [0, 0, 512, 0]       # calls from 0.3 s before to its end
    assert s["slowest_calls"][0]["ms"] == pytest.approx(50.0) and s["slowest_calls"][0]["prefill_tokens"] == 512
    assert s["token_gap_ms"]["50"] == pytest.approx(10.0)        # gaps 10, 10, 10, 50, 60 ms
    assert s["token_gap_ms"]["90"] == pytest.approx(50.0 + 0.6 * 10.0)
    assert summarize([], []) == {"token_gap_ms": {}, "gaps": 0, "call_ms": {}, "calls": 0, "slowest_calls": [],
                                 "largest_gaps": []}
