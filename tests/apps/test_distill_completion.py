"""Completion feature maps (ReZero block, Performer init) and the distillation trainer / CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch

from macattn.models.attention import capture_qkv
from macattn.methods.completion.feature_maps import (CompletionFeatureMaps, FeatureMapSpec, load_feature_maps,
                                     save_feature_maps, student_logits)
from macattn.apps.distill_completion import DistillConfig, LossConfig, distill, distill_loss, maps_for_model
from macattn.models.builtin import build_builtin_model

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256)


def _tokens(n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 256, (37,), generator=g)
    ids = motif.repeat(n // 37 + 1)[:n].clone()
    flip = torch.rand(n, generator=g) < 0.3
    ids[flip] = torch.randint(0, 256, (int(flip.sum()),), generator=g)
    return ids


def test_student_logits_is_log_of_kernel():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 7, generator=g) * 3, torch.randn(3, 11, 7, generator=g) * 3
    want = torch.logsumexp(a[:, :, None, :] + b[:, None, :, :], -1)
    torch.testing.assert_close(student_logits(a, b), want, rtol=1e-5, atol=1e-5)


def test_init_is_positive_random_features_of_exp_kernel():
    # alpha = 0 at init: phi_q . phi_k is the Performer estimator of exp(s q.k), unbiased; F large
    spec = FeatureMapSpec(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=4, feature_dim=20000, hidden=4)
    maps = CompletionFeatureMaps(spec)
    g = torch.Generator().manual_seed(1)
    q, k = 0.4 * torch.randn(2, 2, 4, generator=g), 0.4 * torch.randn(6, 1, 4, generator=g)
    with torch.no_grad():
        lpq = maps.log_phi_q(0, q)   # [2 tokens, 2 heads, F]
        lpk = maps.log_phi_k(0, k)   # [6, 1, F]
        est = student_logits(lpq.transpose(0, 1), lpk.transpose(0, 1).expand(2, -1, -1))   # [2 heads, 2, 6]
    want = 0.5 * torch.einsum("thd,sd->hts", q, k[:, 0])
    assert (est - want).abs().max() < 0.05
    assert (est - want).abs().max() > 0   # an estimate, not the closed form
    assert all(float(m.alpha.detach().abs().sum()) == 0 for m in list(maps.phi_q) + list(maps.phi_k))


def test_loss_parts_zero_at_teacher_and_one_sided():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(4, 50, generator=g) * 4
    loss, parts = distill_loss(z, z)
    assert float(loss) < 1e-9 and all(float(v) < 1e-9 for v in parts.values())
    far = (z - z.amax(-1, keepdim=True)) < -6
    assert far.any()
    up = z + 10.0 * far                      # far keys pushed up into the top band
    _, p_up = distill_loss(z, up)
    assert float(p_up["far"]) > 0 and float(p_up["logz"]) > 0
    down = z - 10.0 * far                    # far keys pushed down: no false positive, less mass
    _, p_down = distill_loss(z, down)
    assert float(p_down["far"]) == 0 and float(p_down["logz"]) == 0 and float(p_down["kl"]) > 0
    _, p_off = distill_loss(z, z + 1.0)       # a constant offset leaves KL at 0 but not the scale terms
    assert float(p_off["kl"]) < 1e-6 and float(p_off["top"]) > 0.4 and float(p_off["logz"]) > 0.4
    with pytest.raises(ValueError, match="same shape"):
        distill_loss(z, z[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        LossConfig(temperature=0)


def test_capture_matches_model_attention():
    model = build_builtin_model("llama", seed=0, **TINY)
    ids = _tokens(40)[None]
    q, k, v = capture_qkv(model, ids)[1]
    assert q.shape == (1, 4, 40, 16) and k.shape == v.shape == (1, 2, 40, 16)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    attn = model.model.layers[1].self_attn
    got = {}
    h = attn.o_proj.register_forward_hook(lambda m, a, o: got.setdefault("x", a[0]))
    with torch.no_grad():
        model(ids)
    h.remove()
    torch.testing.assert_close(out.transpose(1, 2).reshape(1, 40, 64), got["x"], rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_short_training_decreases_loss_and_resume_is_exact(tmp_path):
    model = build_builtin_model("llama", seed=0, **TINY)
    toks = _tokens()
    cfg = DistillConfig(steps=16, batch=2, seq_len=96, n_queries=8, n_sink=4, n_tail=8, lr=2e-2, save_every=8,
                        calibrate_windows=1)
    maps = maps_for_model(model, feature_dim=16, hidden=16)
    rep = distill(model, toks, cfg, maps, tmp_path / "a", progress=False)
    ls = rep["losses"]
    assert sum(ls[-4:]) / 4 < 0.7 * sum(ls[:4]) / 4, ls
    assert (tmp_path / "a" / "step_000008" / "maps.safetensors").is_file()
    # interrupted at step 8 and resumed == uninterrupted
    short = DistillConfig(**{**cfg.__dict__, "steps": 8})
    distill(model, toks, short, maps_for_model(model, feature_dim=16, hidden=16), tmp_path / "b", progress=False)
    resumed = maps_for_model(model, feature_dim=16, hidden=16)
    rep_b = distill(model, toks, cfg, resumed, tmp_path / "b", resume=True, progress=False)
    assert rep_b["resumed_from_step"] == 8
    for (n, p), (_, r) in zip(maps.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=n)
    loaded = load_feature_maps(tmp_path / "a")
    for (n, p), (_, r) in zip(maps.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, r), n


def test_save_load_and_bad_config(tmp_path):
    spec = FeatureMapSpec(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, feature_dim=6, hidden=5, seed=4)
    maps = CompletionFeatureMaps(spec)
    save_feature_maps(maps, tmp_path)
    back = load_feature_maps(tmp_path)
    assert back.spec == spec
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(back.log_phi_q(1, x), maps.log_phi_q(1, x))
    with pytest.raises(FileNotFoundError, match="distill-completion"):
        load_feature_maps(tmp_path / "nope")
    with pytest.raises(ValueError, match="num_q_heads"):
        FeatureMapSpec(num_layers=1, num_q_heads=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="seq_len"):
        DistillConfig(seq_len=20, n_sink=4, n_tail=8, n_queries=8)


def test_cli_runs(tmp_path):
    from macattn.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    rc = main(["distill-completion", "--out", str(out), "--corpus", str(corpus), "--steps", "2", "--batch", "1",
               "--seq-len", "80", "--n-queries", "4", "--n-sink", "4", "--n-tail", "8", "--features", "8",
               "--hidden", "8", "--no-progress", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert len(rep["losses"]) == 2 and all(math.isfinite(x) for x in rep["losses"])
    assert load_feature_maps(out).spec.num_layers == 4


def test_mass_calibration_zeroes_the_mean_log_partition_error():
    from macattn.apps.distill_completion import calibrate_mass, log_partition_bias

    model = build_builtin_model("llama", seed=0, **TINY)
    toks = _tokens()
    cfg = DistillConfig(steps=1, batch=1, seq_len=64, n_queries=4, n_sink=2, n_tail=4, calibrate_windows=2)
    maps = maps_for_model(model, feature_dim=8, hidden=8)
    with torch.no_grad():
        for m in maps.phi_q:
            m.stem_b += 1.5   # a student that over-estimates the mid mass by ~1.5 nats
    windows = [cfg.steps + 1, cfg.steps + 2]
    before = log_partition_bias(model, toks, cfg, maps, windows)
    assert float(before.min()) > 0.5
    removed = calibrate_mass(model, toks, cfg, maps)
    torch.testing.assert_close(removed, before)
    after = log_partition_bias(model, toks, cfg, maps, windows)
    assert float(after.abs().max()) < 1e-4
