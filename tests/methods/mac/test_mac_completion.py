"""MAC with completion on a miss (``miss_policy="completion"``) against plain MAC and the docs/spec.md §3 reference."""
import math
from types import SimpleNamespace

import pytest
import torch

from macattn.methods.completion.reference import hybrid_decode_step
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.reference import full_attention_reference, mac_decode_step_reference
from macattn.methods.completion.completion_on_miss import CompletionOnMiss, MissCompletionConfig, random_feature_maps

D, K_RING = 16, 32


def _model_cfg(hq, hkv, layers=2):
    return SimpleNamespace(num_hidden_layers=layers, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=D)


def _rings(slots, hq):
    return (torch.full((slots, hq, K_RING, D), float("nan"), dtype=torch.float64),   # poisoned, never a candidate
            torch.full((slots, hq, K_RING, D), float("nan"), dtype=torch.float64),
            torch.full((slots, hq, K_RING), float("-inf"), dtype=torch.float64),
            torch.full((slots, K_RING), -1, dtype=torch.int64))


def _case(hq, hkv, n_prefill, positions, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = len(n_prefill), max(positions) + 3
    k = torch.randn(B, hkv, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, hkv, T, D, generator=g, dtype=torch.float64)
    q = 1.5 * torch.randn(B, hq, D, generator=g, dtype=torch.float64)
    return q, k, v, torch.tensor(n_prefill), torch.tensor(positions)


def _step(q, k, v, pos, band, hq, **kw):
    slots = torch.arange(q.shape[0])
    rings = _rings(q.shape[0], hq)
    res = mac_decode_step_reference(q, q, k, v, pos, slots, *rings, band=band, tau=0.5, **kw)
    return res, rings


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("n_sink,n_tail,band", [(4, 8, 16), (0, 0, 0), (3, 40, 5)])
def test_top_k_covering_mid_equals_plain_miss(hq, hkv, n_sink, n_tail, band):
    # mixed lengths; the second row's prefill is shorter than sink + tail (empty mid)
    q, k, v, npf, pos = _case(hq, hkv, [120, 30], [131, 35], seed=hq * 10 + hkv + band)
    cfg = MissCompletionConfig(n_sink=n_sink, n_tail=n_tail, top_k=10_000, feature_dim=8)
    comp = CompletionOnMiss(cfg, random_feature_maps(_model_cfg(hq, hkv), cfg), 1)
    comp.prefill(k, v, npf, band=band)
    plain, r_plain = _step(q, k, v, pos, band, hq)
    mixed, r_comp = _step(q, k, v, pos, band, hq, miss_policy="completion", completion=comp)
    assert not plain.hit.any()   # empty rings: every head misses
    torch.testing.assert_close(mixed.out, plain.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mixed.out, full_attention_reference(q, k, v, pos), rtol=1e-10, atol=1e-12)
    col = pos % K_RING
    for b in range(q.shape[0]):   # the appended ring entries agree too
        torch.testing.assert_close(r_comp[1][b, :, col[b]], r_plain[1][b, :, col[b]], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r_comp[2][b, :, col[b]], r_plain[2][b, :, col[b]], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hq,hkv,top_k", [(4, 2, 5), (2, 1, 0), (4, 4, 12)])
def test_entry_matches_spec3_reference_over_the_rectified_range(hq, hkv, top_k):
    """The completed ring entry AS^{(m)}_[0, m-r] is docs/spec.md §3's step on keys 0..m-r with the tail
    widened to the band (``macattn.methods.completion.reference.hybrid_decode_step``, an independent reference)."""
    n_sink, n_tail, band = 4, 6, 10
    q, k, v, npf, pos = _case(hq, hkv, [90, 70], [105, 79], seed=top_k + hq)   # m - r + 1 >= N
    cfg = MissCompletionConfig(n_sink=n_sink, n_tail=n_tail, top_k=top_k, feature_dim=16, seed=3)
    maps = random_feature_maps(_model_cfg(hq, hkv), cfg)
    comp = CompletionOnMiss(cfg, maps, 0)
    comp.prefill(k, v, npf, band=band)
    got = comp.entry_summary(q, k, v, pos, band=band)
    with torch.no_grad():
        lpq = maps.log_phi_q(0, q).float()
        lpk = maps.log_phi_k(0, k.transpose(1, 2)).transpose(1, 2).float()
    comp_cache = [torch.stack(x) for x in zip(*[c[:3] for c in comp.caches])]
    ref, parts = hybrid_decode_step(q, k, v, pos - band + 1, npf, n_sink=n_sink, n_tail=max(n_tail, band),
                                    top_k=top_k, completion=(lpq, lpk, *comp_cache), return_parts=True)
    torch.testing.assert_close(got.o, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.lse, torch.logaddexp(parts["lse_exact"], parts["lse_comp"]), rtol=1e-9, atol=1e-9)


def test_hits_pass_through_and_misses_change():
    hq, hkv, band = 4, 2, 8
    q, k, v, npf, pos = _case(hq, hkv, [100], [110], seed=5)
    cfg = MissCompletionConfig(n_sink=4, n_tail=4, top_k=3, feature_dim=16)
    comp = CompletionOnMiss(cfg, random_feature_maps(_model_cfg(hq, hkv), cfg), 0)
    comp.prefill(k, v, npf, band=band)
    rings = _rings(1, hq)
    # seed one ring entry at p = 105 with the query of heads 0 and 1 (they hit; heads 2, 3 miss)
    p = 105
    qr, orr, lse, rpos = rings
    qr[0, :, p % K_RING] = torch.cat([q[0, :2], -q[0, 2:]])
    orr[0, :, p % K_RING] = 0.0
    lse[0, :, p % K_RING] = 0.0
    rpos[0, p % K_RING] = p
    twin = tuple(x.clone() for x in rings)
    a = mac_decode_step_reference(q, q, k, v, pos, torch.tensor([0]), *rings, band=band, tau=0.5)
    b = mac_decode_step_reference(q, q, k, v, pos, torch.tensor([0]), *twin, band=band, tau=0.5,
                                  miss_policy="completion", completion=comp)
    assert a.hit[0].tolist() == [True, True, False, False]
    torch.testing.assert_close(b.out[:, :2], a.out[:, :2], rtol=0, atol=0)
    assert (b.out[:, 2:] - a.out[:, 2:]).abs().max() > 1e-6 and torch.isfinite(b.out).all()
    full_read = comp.miss_cost(110, 0, band=band, gen_len=1)
    assert full_read < 111 and comp.miss_cost(110, 0, band=band, gen_len=64) < full_read


def test_bad_inputs():
    hq, hkv = 2, 1
    q, k, v, npf, pos = _case(hq, hkv, [60], [70], seed=0)
    cfg = MissCompletionConfig(n_sink=2, n_tail=2, top_k=2, feature_dim=4)
    maps = random_feature_maps(_model_cfg(hq, hkv), cfg)
    with pytest.raises(ValueError, match="miss_policy"):
        _step(q, k, v, pos, 4, hq, miss_policy="sometimes")
    with pytest.raises(ValueError, match="completion="):
        _step(q, k, v, pos, 4, hq, miss_policy="completion")
    with pytest.raises(ValueError, match="miss_policy must be one of"):
        MacConfig(miss_policy="partial")
    with pytest.raises(ValueError, match="top_k"):
        MissCompletionConfig(top_k=-1)
    with pytest.raises(ValueError, match="layer must be <"):
        CompletionOnMiss(cfg, maps, 2)
    with pytest.raises(TypeError, match="maps"):
        CompletionOnMiss(cfg, object(), 0)
    comp = CompletionOnMiss(cfg, maps, 0)
    with pytest.raises(ValueError, match="Hkv=1"):
        comp.prefill(torch.zeros(1, 2, 8, D), torch.zeros(1, 2, 8, D), torch.tensor([8]), band=0)
    comp.prefill(k, v, npf, band=4)
    with pytest.raises(ValueError, match="inside its prefill"):
        comp.entry_summary(q, k, v, torch.tensor([40]), band=4)


def test_miss_policy_round_trips_through_the_per_layer_file(tmp_path):
    cfg = MacConfig(miss_policy="completion", layer_overrides={1: {"miss_policy": "full", "tau": 0.6}})
    assert MacConfig().to_dict().keys() == {"window", "band", "tau", "enabled", "layer_overrides"}
    cfg.save(tmp_path / "c.json")
    back = MacConfig.load(tmp_path / "c.json")
    assert back == cfg and back.for_layer(0).miss_policy == "completion" and back.for_layer(1).miss_policy == "full"
    assert math.isclose(back.for_layer(1).tau, 0.6)
