"""``macattn recurrence``: the windowed nearest-query search against brute force, the oracle hit / skip
on a prompt whose layer-0 queries repeat exactly, input checks and the CLI's JSON + PNG."""
import json
import math

import pytest
import torch

from macattn.models.attention import capture_pre_rope_queries
from macattn.evaluation.recurrence import (RecurrenceSettings, nearest_in_window,
                                           query_recurrence)


def _brute(q, first, K):
    H, T, _ = q.shape
    dist = torch.full((H, T - first), float("inf"), dtype=torch.float64)
    pos = torch.full((H, T - first), -1, dtype=torch.int64)
    for h in range(H):
        for m in range(first, T):
            for p in range(max(0, m - K), m):
                dd = float((q[h, m].double() - q[h, p].double()).norm())
                if dd < dist[h, m - first]:
                    dist[h, m - first], pos[h, m - first] = dd, p
    return dist, pos


@pytest.mark.parametrize("first,windows,block", [(0, (1, 7, 100), 16), (5, (3, 64), 7), (69, (200,), 256)])
def test_nearest_in_window_matches_brute_force(first, windows, block):
    g = torch.Generator().manual_seed(first)
    q = torch.randn(2, 70, 5, generator=g)
    dist, pos = nearest_in_window(q, first, windows, block=block)
    assert dist.shape == pos.shape == (len(windows), 2, 70 - first) and dist.dtype == torch.float32
    for i, K in enumerate(windows):
        bd, bp = _brute(q, first, K)
        torch.testing.assert_close(dist[i].double(), bd, rtol=1e-4, atol=1e-4)
        assert torch.equal(pos[i], bp)
    if first == 0:   # m = 0 has no earlier query
        assert torch.isinf(dist[:, :, 0]).all() and (pos[:, :, 0] == -1).all()


def test_nearest_in_window_checks_inputs():
    with pytest.raises(ValueError, match=r"q must be \[H, T, d\]"):
        nearest_in_window(torch.zeros(4, 3), 0, (2,))
    with pytest.raises(ValueError, match="first must lie in"):
        nearest_in_window(torch.zeros(1, 4, 3), 4, (2,))


@pytest.mark.parametrize("kw,match", [(dict(taus=(1.0,)), "taus"), (dict(taus=()), "taus"),
                                      (dict(windows=(0,)), "windows"), (dict(windows=(2.5,)), "windows"),
                                      (dict(band=-1), "band"), (dict(positions=0), "positions"),
                                      (dict(band=True), "band")])
def test_settings_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        RecurrenceSettings(**kw)


def _tiny_llama(seed=0):
    from macattn.models.builtin import build_builtin_model

    return build_builtin_model("llama", seed=seed, vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               max_position_embeddings=512)


def test_captured_queries_are_the_q_proj_output():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 9))
    qs = capture_pre_rope_queries(model, ids)
    assert len(qs) == 2 and qs[0].shape == (4, 9, 8)
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        ref = model.model.layers[0].self_attn.q_proj(x)[0].view(9, 4, 8).transpose(0, 1)
    torch.testing.assert_close(qs[0], ref)


def test_period_prompt_hits_exactly_where_the_repeat_is_past_the_band():
    """Layer-0 queries depend on the token alone: a prompt of a period of P distinct tokens repeated has
    its exact repeat at m - P. With K = P that repeat is the only candidate at distance 0, so the oracle
    hits iff m - P - r >= 0, with skip (m - P - r) / m."""
    model = _tiny_llama(1)
    with torch.no_grad():   # distinct tokens' queries far apart (>> sqrt(2d)(1 - tau)): only repeats hit
        model.model.layers[0].self_attn.q_proj.weight.mul_(200.0)
    P, r, T, n = 20, 7, 90, 85
    period = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:P]
    ids = period.repeat(T // P + 1)[:T].unsqueeze(0)
    res = query_recurrence(model, [ids], RecurrenceSettings(taus=(0.45,), windows=(P,), band=r, positions=n),
                           progress=False)
    ms = torch.arange(T - n, T, dtype=torch.float64)
    ok = ms - P - r >= 0
    assert 0 < int(ok.sum()) < n
    layer0 = res["per_layer"][0]
    assert layer0["hit"]["0.45"][str(P)] == pytest.approx(float(ok.double().mean()))
    assert layer0["skip"]["0.45"][str(P)] == pytest.approx(float(torch.where(ok, (ms - P - r) / ms, 0.0).mean()))
    assert layer0["median_gap"]["0.45"] == P
    assert layer0["nn_over_sqrt2d"]["q10"] < 1e-3
    assert res["scored_tokens"] == n and res["prompts"] == 1
    assert 0.0 <= res["mean"]["hit"]["0.45"][str(P)] <= 1.0
    assert math.isfinite(layer0["query_rms"]) and layer0["query_rms"] > 0


def test_prompts_must_be_single_rows():
    model = _tiny_llama()
    with pytest.raises(ValueError, match=r"each prompt must be \[1, T\]"):
        query_recurrence(model, [torch.zeros(2, 5, dtype=torch.int64)], RecurrenceSettings(), progress=False)


def test_cli_writes_json_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    from macattn.cli import main

    out = tmp_path / "rec.json"
    assert main(["recurrence", "--model", "random", "--lengths", "256", "--tasks", "niah_single", "--n", "1",
                 "--taus", "0.3,0.45", "--windows", "32,128", "--band", "16", "--positions", "64",
                 "--plot-window", "128", "--quiet", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    per = res["models"]["random"]["per_layer"]
    assert per and set(per[0]["hit"]) == {"0.3", "0.45"} and set(per[0]["hit"]["0.45"]) == {"32", "128"}
    assert res["prompts"]["lengths"] == [256]
    assert out.with_suffix(".png").stat().st_size > 10_000
