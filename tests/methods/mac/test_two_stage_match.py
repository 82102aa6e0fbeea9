"""MAC's two-stage match (``MacConfig(match="two_stage")``): sketches, the candidate + exact stages
against the exact match, the config rule, and the eval harness running it."""
from __future__ import annotations

import pytest
import torch

from macattn.core.threshold import match_threshold
from macattn.methods.mac.config import MATCH_SKETCHES, MacConfig
from macattn.methods.mac.match_sketch import sketch, sketch_dims, sketch_projection
from macattn.methods.mac.reference import (mac_decode_step_reference, mac_match_reference,
                                           mac_match_two_stage_reference)


def _rings(B, Hq, K, d, m, g, dtype=torch.bfloat16, near=0.6):
    """Rings of ``B`` requests at position ``m`` (entries ``m - K .. m - 1``, some slots empty) and a
    query per head that lies near one random entry with probability ``near``."""
    S = B + 1
    qring = torch.randn(S, Hq, K, d, generator=g).to(dtype)
    ring_pos = torch.full((S, K), -1, dtype=torch.int64)
    for s in range(S):
        pos = torch.arange(m - K, m)
        keep = torch.rand(K, generator=g) > 0.1
        ring_pos[s, pos[keep] % K] = pos[keep]
    ring_lse = torch.randn(S, Hq, K, generator=g)
    slots = torch.randperm(S, generator=g)[:B]
    q = torch.randn(B, Hq, d, generator=g)
    pick = torch.randint(0, K, (B, Hq), generator=g)
    close = torch.rand(B, Hq, generator=g) < near
    for b in range(B):
        for h in range(Hq):
            if close[b, h]:
                q[b, h] = qring[slots[b], h, pick[b, h]].float() + 0.05 * torch.randn(d, generator=g)
    return q.to(dtype), qring, ring_lse, ring_pos, slots, torch.full((B,), m, dtype=torch.int64)


@pytest.mark.parametrize("kind", MATCH_SKETCHES)
def test_sketch_shapes_dtypes_and_determinism(kind):
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    y = sketch(x, kind)
    assert y.shape == (3, 5, sketch_dims(kind, 64)) and y.dtype == torch.float32
    assert torch.equal(y, sketch(x.clone(), kind))
    assert torch.isfinite(y).all()
    if kind == "fp8":        # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 in the normal range
        big = x.float().abs() > 2 ** -6
        assert ((y - x.float()).abs()[big] <= x.float().abs()[big] * 2 ** -4 + 1e-6).all()


def test_projection_is_fixed_and_preserves_distances_on_average():
    P = sketch_projection(128, 32)
    assert torch.equal(P, sketch_projection(128, 32)) and P.shape == (128, 32)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4000, 128, generator=g), torch.randn(4000, 128, generator=g)
    ratio = ((a - b) @ P).square().sum(-1) / (a - b).square().sum(-1)
    assert abs(float(ratio.mean()) - 1.0) < 0.05


def test_sketch_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="match_sketch must be one of"):
        sketch(torch.zeros(2, 8), "proj7")


@pytest.mark.parametrize("kind", MATCH_SKETCHES)
@pytest.mark.parametrize("seed", range(3))
def test_every_accepted_two_stage_match_passes_the_exact_test(kind, seed):
    g = torch.Generator().manual_seed(seed)
    B, Hq, K, d, band, tau = 3, 8, 64, 32, 4, 0.45
    q, qring, lse, pos, slots, m = _rings(B, Hq, K, d, 100, g)
    lse[slots[0], 0, :5] = float("-inf")              # some unfinished entries
    mp, dist = mac_match_two_stage_reference(q, qring, lse, pos, slots, m, band=band, tau=tau, sketch=kind,
                                             candidates=2)
    hit = mp >= 0
    assert hit.any() and (~hit).any()
    col = torch.where(hit, mp, torch.zeros_like(mp)) % K
    entry = torch.gather(qring[slots].float(), 2, col[..., None, None].expand(B, Hq, 1, d)).squeeze(2)
    exact = (q.float() - entry).norm(dim=-1)
    assert torch.allclose(exact[hit], dist[hit], rtol=1e-5, atol=1e-5)
    assert (exact[hit] < match_threshold(d, tau)).all()
    assert (torch.gather(pos[slots], 1, col)[hit] == mp[hit]).all()
    assert torch.isfinite(torch.gather(lse[slots], 2, col[..., None]).squeeze(-1)[hit]).all()
    assert (mp[hit] - band >= 0).all() and ((m[:, None] - K <= mp) & (mp < m[:, None]))[hit].all()


@pytest.mark.parametrize("kind", MATCH_SKETCHES)
def test_with_every_entry_a_candidate_it_is_the_exact_match(kind):
    g = torch.Generator().manual_seed(7)
    K = 16
    q, qring, lse, pos, slots, m = _rings(2, 4, K, 32, 40, g)
    want = mac_match_reference(q, qring, lse, pos, slots, m, band=2, tau=0.45)
    got = mac_match_two_stage_reference(q, qring, lse, pos, slots, m, band=2, tau=0.45, sketch=kind, candidates=K)
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_ties_and_empty_rings():
    K, d = 8, 16
    qring = torch.zeros(1, 1, K, d)
    qring[0, 0, 3] = qring[0, 0, 6] = 1.0                # two identical nearest entries
    pos = torch.arange(K).view(1, K) + 8                 # positions 8..15 at slots 0..7
    lse = torch.zeros(1, 1, K)
    q = torch.ones(1, 1, d)
    args = (q, qring, lse, pos, torch.tensor([0]), torch.tensor([16]))
    mp, _ = mac_match_two_stage_reference(*args, band=0, tau=0.0, sketch="fp8", candidates=3)
    assert mp.item() == 11                                # the lower ring index, as the exact match
    assert mac_match_reference(*args, band=0, tau=0.0)[0].item() == 11
    empty = torch.full((1, K), -1, dtype=torch.int64)
    mp, dist = mac_match_two_stage_reference(q, qring, lse, empty, torch.tensor([0]), torch.tensor([16]), band=0,
                                             tau=0.0, sketch="proj16", candidates=4)
    assert mp.item() == -1 and dist.item() == float("inf")


def test_decode_step_with_two_stage_match():
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, K, d, m = 2, 4, 2, 16, 32, 40
    q, qring, lse, pos, slots, positions = _rings(B, Hq, K, d, m, g, dtype=torch.float32)
    oring = torch.randn(qring.shape, generator=g)
    k, v = torch.randn(B, Hkv, m + 1, d, generator=g), torch.randn(B, Hkv, m + 1, d, generator=g)
    rings = (qring.clone(), oring.clone(), lse.clone(), pos.clone())
    res = mac_decode_step_reference(q, q, k, v, positions, slots, *rings, band=2, tau=0.45, match="two_stage",
                                    match_sketch="proj32", match_candidates=2)
    want, _ = mac_match_two_stage_reference(q, qring, lse, pos, slots, positions, band=2, tau=0.45,
                                            sketch="proj32", candidates=2)
    assert torch.equal(res.match_pos, want) and torch.isfinite(res.out).all()
    assert (rings[3][slots, m % K] == m).all()           # the step appended its entry
    with pytest.raises(ValueError, match="match must be one of"):
        mac_decode_step_reference(q, q, k, v, positions, slots, *rings, band=2, tau=0.45, match="approx")


def test_config_validates_and_the_onnx_build_refuses_two_stage(tmp_path):
    from macattn.builder.build import build_engine_dir

    with pytest.raises(ValueError, match="match_candidates must be one of"):
        MacConfig(match="two_stage", match_candidates=0)
    with pytest.raises(ValueError, match="match_sketch must be one of"):
        MacConfig(match_sketch="pca")
    cfg = MacConfig(window=8, band=2).with_overrides({1: {"match": "two_stage", "match_sketch": "proj16"}})
    assert MacConfig.from_dict(cfg.to_dict()) == cfg
    assert "match" not in MacConfig().to_dict()          # defaults stay out of saved files
    with pytest.raises(ValueError, match=r"match='two_stage'.*macattn build.*layers \[1\]"):
        build_engine_dir("llama", tmp_path, mac=cfg)


def test_eval_harness_runs_two_stage():
    from macattn.evaluation.harness import EvalSettings, byte_encoder, run_eval
    from macattn.evaluation.methods import Mac
    from macattn.models.builtin import build_builtin_model

    model = build_builtin_model("llama", seed=0, num_hidden_layers=2)
    g = torch.Generator().manual_seed(0)
    hay = torch.randint(300, model.config.vocab_size, (4096,), generator=g).tolist()
    methods = [Mac(MacConfig(window=16, band=8, tau=0.0)),
               Mac(MacConfig(window=16, band=8, tau=0.0, match="two_stage", match_candidates=16))]
    res = run_eval(model, methods, EvalSettings(lengths=(160,), tasks=("niah_single",), n=1, gen=4),
                   encode=byte_encoder(model.config.vocab_size), haystack_ids=hay, progress=False,
                   baseline=methods[0].name)
    exact, two = (res["methods"][m.name] for m in methods)
    assert "two_stage(fp8,c=16)" in methods[1].name
    # every entry a candidate: the two-stage match is the exact one, so every figure agrees
    assert two["hit_rate"] == exact["hit_rate"] and two["greedy_agreement"] == exact["greedy_agreement"]
    assert exact["hit_rate"] > 0 and two["greedy_agreement_vs_baseline"] == 1.0
    with pytest.raises(ValueError, match="baseline must be one of"):
        run_eval(model, methods, EvalSettings(lengths=(160,), tasks=("niah_single",), n=1, gen=4),
                 encode=byte_encoder(model.config.vocab_size), haystack_ids=hay, progress=False, baseline="mac")
