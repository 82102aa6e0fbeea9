"""Reference of Top-k retrieval + linear-attention completion (macattn.methods.completion.reference, docs/spec.md §3)."""
from __future__ import annotations

import math

import pytest
import torch

from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.reference import (ExhaustiveTopK, PageSummaryTopK, budget_top_k, build_completion_cache, build_completion_cache_batched, full_attention_step, hybrid_decode_step, partition, retrieval_completion_step, selection_only_step, sink_tail_step, subtract_retrieved, token_equivalents)


def _full(q, k, v, seq_lens, scale=None):
    """Independent fp64 full attention via torch's SDPA on each row."""
    out = torch.empty(q.shape, dtype=torch.float64)
    grp = q.shape[1] // k.shape[1]
    for i, L in enumerate(seq_lens.tolist()):
        kk = k[i, :, :L].double().repeat_interleave(grp, 0)
        vv = v[i, :, :L].double().repeat_interleave(grp, 0)
        out[i] = torch.nn.functional.scaled_dot_product_attention(q[i].double()[:, None], kk, vv,
                                                                  scale=scale)[:, 0]
    return out


def _problem(seq_lens, n_prefill, *, hq=4, hkv=2, d=8, f=6, t=None, seed=0, finite_keys=False):
    """Random batch; padding beyond seq_lens and non-mid log φ_k rows are NaN (must never be read).

    finite_keys: every key is one of ``f`` atoms ``U``; then log φ_k = log one-hot(atom) and
    log φ_q(q)_f = scale·q·U_f is an exact positive feature map (φ_q·φ_k(k) = exp(scale·q·k)).
    """
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    t = t or max(seq_lens)
    seq_lens = torch.tensor(seq_lens)
    n_prefill = torch.tensor(n_prefill)
    q = torch.randn(b, hq, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    if finite_keys:
        atoms = 1.5 * torch.randn(hkv, f, d, generator=g, dtype=torch.float64)
        ids = torch.randint(0, f, (b, hkv, t), generator=g)
        k = atoms[torch.arange(hkv)[None, :, None], ids]
        lpk = torch.full((b, hkv, t, f), -math.inf, dtype=torch.float64)
        lpk.scatter_(-1, ids[..., None], 0.0)
        grp = hq // hkv
        lpq = torch.einsum("bhd,hfd->bhf", q, atoms.repeat_interleave(grp, 0)) / math.sqrt(d)
    else:
        k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
        lpk = torch.randn(b, hkv, t, f, generator=g, dtype=torch.float64) - 2.0
        lpq = torch.randn(b, hq, f, generator=g, dtype=torch.float64)
    for i, L in enumerate(seq_lens.tolist()):
        k[i, :, L:] = math.nan
        v[i, :, L:] = math.nan
    return q, k, v, seq_lens, n_prefill, lpq, lpk


def _cache_and_poison(lpk, v, n_prefill, n_sink, n_tail):
    a, b, sh = build_completion_cache_batched(lpk, v, n_prefill, n_sink=n_sink, n_tail=n_tail)
    lpk = lpk.clone()
    for i, n in enumerate(n_prefill.tolist()):
        p = partition(n, n, n_sink=n_sink, n_tail=n_tail)
        lpk[i, :, :p.mid_start] = math.nan
        lpk[i, :, p.mid_end:] = math.nan
    return a.double(), b.double(), sh.double(), lpk


def test_partition_edges():
    assert partition(100, 120, n_sink=4, n_tail=8) == partition(100, 120, n_sink=4, n_tail=8)
    p = partition(100, 120, n_sink=4, n_tail=8)
    assert (p.mid_start, p.mid_end, p.mid_len) == (4, 92, 88)
    p = partition(10, 11, n_sink=4, n_tail=8)  # N <= n_sink + n_tail: empty mid
    assert p.mid_len == 0 and p.mid_start == 4
    p = partition(2, 5, n_sink=4, n_tail=8)  # N < n_sink
    assert (p.mid_start, p.mid_end) == (2, 2)
    with pytest.raises(ValueError, match="seq_len"):
        partition(10, 9, n_sink=1, n_tail=1)
    with pytest.raises(ValueError, match="n_sink"):
        partition(10, 10, n_sink=-1, n_tail=1)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (6, 1)])
def test_completion_with_exact_feature_map_equals_full(hq, hkv):
    seq_lens, n_prefill = [60, 45, 30, 7], [50, 40, 30, 3]
    q, k, v, sl, npf, lpq, lpk = _problem(seq_lens, n_prefill, hq=hq, hkv=hkv, finite_keys=True, seed=1)
    a, b, sh, lpk = _cache_and_poison(lpk, v, npf, 3, 5)
    full = _full(q, k, v, sl)
    for top_k in (0, 1, 7, 100):
        out = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, a, b, sh, n_sink=3, n_tail=5, top_k=top_k)
        torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)  # the cache is fp32 by contract
    sel = selection_only_step(q, k, v, sl, npf, n_sink=3, n_tail=5, top_k=1)
    assert (sel - full).abs().max() > 1e-3  # the comparison above is not vacuous


def test_exact_when_top_k_covers_mid():
    seq_lens, n_prefill = [40, 33, 12], [36, 20, 12]
    q, k, v, sl, npf, lpq, lpk = _problem(seq_lens, n_prefill, seed=2)
    a, b, sh, lpk = _cache_and_poison(lpk, v, npf, 2, 4)
    full = _full(q, k, v, sl)
    out = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, a, b, sh, n_sink=2, n_tail=4, top_k=64)
    torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(selection_only_step(q, k, v, sl, npf, n_sink=2, n_tail=4, top_k=64), full,
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full_attention_step(q, k, v, sl), full, rtol=1e-10, atol=1e-10)
    # an approximate (non-exact) feature map does change the output when mid tokens are left over
    out5 = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, a, b, sh, n_sink=2, n_tail=4, top_k=5)
    assert (out5 - full).abs().max() > 1e-3


def test_empty_mid_and_short_prefill_are_exact():
    # N <= n_sink + n_tail and N < n_sink: no mid region, the step is exact attention
    seq_lens, n_prefill = [9, 5, 3], [8, 2, 0]
    q, k, v, sl, npf, lpq, lpk = _problem(seq_lens, n_prefill, seed=3)
    a, b, sh, lpk = _cache_and_poison(lpk, v, npf, 4, 4)
    assert float(b.abs().sum()) == 0.0 and float(a.abs().sum()) == 0.0 and float(sh.abs().sum()) == 0.0
    out = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, a, b, sh, n_sink=4, n_tail=4, top_k=2)
    torch.testing.assert_close(out, _full(q, k, v, sl), rtol=1e-10, atol=1e-10)


def test_build_cache_matches_naive_sum_and_empty():
    g = torch.Generator().manual_seed(4)
    lpk = torch.randn(3, 10, 5, generator=g, dtype=torch.float64) * 4
    v = torch.randn(3, 10, 7, generator=g, dtype=torch.float64)
    a, b, sh = build_completion_cache(lpk, v)
    assert a.dtype == b.dtype == sh.dtype == torch.float32
    phi = lpk.exp()
    torch.testing.assert_close(b.double() * sh.double().exp(), phi.sum(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.double() * sh.double().exp()[..., None], phi.transpose(1, 2) @ v, rtol=1e-5,
                               atol=1e-5)
    assert bool((b <= 10).all()) and bool((b >= 1 - 1e-6).all())  # max-shifted: the argmax token weighs 1
    a0, b0, s0 = build_completion_cache(lpk[:, :0], v[:, :0])
    assert a0.shape == (3, 5, 7) and b0.shape == s0.shape == (3, 5)
    assert not a0.any() and not b0.any() and not s0.any()
    with pytest.raises(ValueError, match="log_phi_k_mid"):
        build_completion_cache(lpk, v[:, :9])


def test_subtraction_never_negative_under_adversarial_inputs():
    g = torch.Generator().manual_seed(5)
    f, d = 6, 4
    a = torch.randn(2, f, d, generator=g, dtype=torch.float64)
    b = torch.rand(2, f, generator=g, dtype=torch.float64) * 0.5
    sh = torch.zeros(2, f, dtype=torch.float64)
    # retrieved weights larger than the cache holds (inconsistent cache / rounding): clamp at 0
    lpk_sel = torch.randn(2, 3, f, generator=g, dtype=torch.float64) + 1.0
    v_sel = torch.randn(2, 3, d, generator=g, dtype=torch.float64)
    a2, b2 = subtract_retrieved(a, b, sh, lpk_sel, v_sel)
    assert bool((b2 >= 0).all()) and bool((b2 == 0).any())
    assert not a2[b2 == 0].any()
    # the full step stays finite and equals selection-only when the whole completion cancels out
    seq_lens, n_prefill = [30, 26], [25, 25]
    q, k, v, sl, npf, lpq, lpk = _problem(seq_lens, n_prefill, seed=6)
    a, b, sh, lpk = _cache_and_poison(lpk, v, npf, 2, 3)
    tiny_b = b * 1e-3  # retrieved tokens alone outweigh the cache for every feature
    out = retrieval_completion_step(q, k, v, sl, npf, lpq + 50, lpk, a, tiny_b, sh, n_sink=2, n_tail=3, top_k=8)
    assert torch.isfinite(out).all()
    sel = selection_only_step(q, k, v, sl, npf, n_sink=2, n_tail=3, top_k=8)
    torch.testing.assert_close(out, sel, rtol=1e-10, atol=1e-10)


def test_batched_equals_per_row_and_output_dtype():
    seq_lens, n_prefill = [50, 21, 37], [44, 21, 30]
    q, k, v, sl, npf, lpq, lpk = _problem(seq_lens, n_prefill, hq=8, hkv=2, seed=7)
    a, b, sh, lpk = _cache_and_poison(lpk, v, npf, 2, 3)
    out = retrieval_completion_step(q.float(), k.float(), v.float(), sl, npf, lpq.float(), lpk.float(), a.float(),
                                    b.float(), sh.float(), n_sink=2, n_tail=3, top_k=4)
    assert out.dtype == torch.float32 and out.shape == q.shape and torch.isfinite(out).all()
    for i in range(3):
        L = seq_lens[i]
        solo = retrieval_completion_step(q[i:i + 1].float(), k[i:i + 1, :, :L].float(), v[i:i + 1, :, :L].float(),
                                         sl[i:i + 1], npf[i:i + 1], lpq[i:i + 1].float(), lpk[i:i + 1, :, :L].float(),
                                         a[i:i + 1].float(), b[i:i + 1].float(), sh[i:i + 1].float(),
                                         n_sink=2, n_tail=3, top_k=4)
        torch.testing.assert_close(out[i:i + 1], solo, rtol=0, atol=0)


def test_per_query_head_topk_and_single_normalisation_by_hand():
    # one row, 1 KV head, 2 query heads: check against a direct hand evaluation of the formula
    seq_lens, n_prefill = [20], [18]
    q, k, v, sl, npf, lpq, lpk = _problem(seq_lens, n_prefill, hq=2, hkv=1, seed=8)
    a, b, sh, lpk_p = _cache_and_poison(lpk, v, npf, 2, 3)
    out = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk_p, a, b, sh, n_sink=2, n_tail=3, top_k=3)
    s = 1 / math.sqrt(q.shape[-1])
    for h in range(2):
        l = s * k[0, 0, :20] @ q[0, h]
        mid = torch.arange(2, 15)
        r = mid[l[mid].topk(3).indices]
        exact = [t for t in range(20) if t not in set(mid.tolist()) or t in set(r.tolist())]
        rem = [t for t in mid.tolist() if t not in set(r.tolist())]
        phi_q = lpq[0, h].exp()
        kern = lambda t: float((phi_q * lpk[0, 0, t].exp()).sum())  # noqa: E731
        num = sum(math.exp(l[t]) * v[0, 0, t] for t in exact) + sum(kern(t) * v[0, 0, t] for t in rem)
        den = sum(math.exp(l[t]) for t in exact) + sum(kern(t) for t in rem)
        torch.testing.assert_close(out[0, h], num / den, rtol=1e-6, atol=1e-8)


def test_sink_tail_baseline_and_page_selector():
    seq_lens, n_prefill = [70, 64], [64, 64]
    q, k, v, sl, npf, *_ = _problem(seq_lens, n_prefill, seed=9)
    st = sink_tail_step(q, k, v, sl, npf, n_sink=4, n_tail=4)
    hand = _full(q[:, :, :], torch.cat([k[:, :, :4], k[:, :, 60:]], 2), torch.cat([v[:, :, :4], v[:, :, 60:]], 2),
                 sl - 56)
    torch.testing.assert_close(st, hand, rtol=1e-10, atol=1e-10)
    # page selector keeping every page is exactly the exhaustive Top-k
    g = torch.Generator().manual_seed(10)
    qh, km = torch.randn(3, 8, generator=g), torch.randn(37, 8, generator=g)
    ex = ExhaustiveTopK().select(qh, km, 5, 0.3)
    pg = PageSummaryTopK(page_size=4, overfetch=10).select(qh, km, 5, 0.3)
    assert torch.equal(ex.sort(-1).values, pg.sort(-1).values)
    # with few pages it returns k distinct in-range indices, and the page bound really bounds q·k
    pg2 = PageSummaryTopK(page_size=4, overfetch=1).select(qh, km, 6, 0.3)
    assert pg2.shape == (3, 6) and int(pg2.max()) < 37
    assert all(len(set(r.tolist())) == 6 for r in pg2)
    lo, hi = PageSummaryTopK.page_bounds(km, 4)
    bound = torch.maximum(qh.double()[:, None] * lo, qh.double()[:, None] * hi).sum(-1)
    dots = qh.double() @ km.double().T
    for p in range(lo.shape[0]):
        assert bool((dots[:, 4 * p:4 * p + 4].amax(-1) <= bound[:, p] + 1e-9).all())
    out = hybrid_decode_step(q, k, v, sl, npf, n_sink=2, n_tail=2, top_k=100,
                             selector=PageSummaryTopK(4, 1))
    torch.testing.assert_close(out, _full(q, k, v, sl), rtol=1e-10, atol=1e-10)


def test_bad_inputs_raise():
    q, k, v, sl, npf, lpq, lpk = _problem([10], [8], seed=11)
    a, b, sh, lpk = _cache_and_poison(lpk, v, npf, 1, 1)
    with pytest.raises(ValueError, match="seq_lens"):
        retrieval_completion_step(q, k, v, torch.tensor([11]), npf, lpq, lpk, a, b, sh, n_sink=1, n_tail=1, top_k=1)
    with pytest.raises(ValueError, match="n_prefill"):
        retrieval_completion_step(q, k, v, sl, torch.tensor([11]), lpq, lpk, a, b, sh, n_sink=1, n_tail=1, top_k=1)
    with pytest.raises(TypeError, match="seq_lens"):
        retrieval_completion_step(q, k, v, sl.float(), npf, lpq, lpk, a, b, sh, n_sink=1, n_tail=1, top_k=1)
    with pytest.raises(ValueError, match="top_k"):
        retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, a, b, sh, n_sink=1, n_tail=1, top_k=-1)
    with pytest.raises(ValueError, match="comp_A"):
        retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, a[..., :3], b, sh, n_sink=1, n_tail=1, top_k=1)
    with pytest.raises(ValueError, match="Hq"):
        retrieval_completion_step(q[:, :3], k, v, sl, npf, lpq[:, :3], lpk, a, b, sh, n_sink=1, n_tail=1, top_k=1)
    with pytest.raises(ValueError, match="budget"):
        CompletionConfig(top_k=None, budget=1.5)
    with pytest.raises(ValueError, match="exactly one"):
        CompletionConfig(top_k=4, budget=0.1)
    with pytest.raises(ValueError, match="selector"):
        CompletionConfig(selector="nearest")


def test_config_and_budget_accounting():
    cfg = CompletionConfig(top_k=None, budget=0.05)
    assert cfg.k_for(1000) == 50 and cfg.k_for(0) == 0 and cfg.k_for(3) == 1
    assert CompletionConfig(top_k=8).k_for(5) == 5
    te = token_equivalents(exact_tokens=100, feature_dim=64, head_dim=128, gen_len=1, retrieved=20)
    assert te["cache_once"] == (64 * 128 + 2 * 64) / 256 and te["feature_reads"] == 20 * 64 / 256
    assert te["total"] == 100 + te["cache_once"] + te["feature_reads"]
    te64 = token_equivalents(exact_tokens=100, feature_dim=64, head_dim=128, gen_len=64, retrieved=20)
    assert te64["cache_amortised"] == te["cache_once"] / 64
    assert token_equivalents(exact_tokens=7, feature_dim=4, head_dim=8, completion=False)["total"] == 7
    # budget -> k: selection-only spends one token-equivalent per retrieved token
    assert budget_top_k(50, anchors=20, feature_dim=64, head_dim=128, completion=False, mid_len=1000) == 30
    kc = budget_top_k(80, anchors=20, feature_dim=64, head_dim=128, completion=True, mid_len=1000)
    spent = token_equivalents(exact_tokens=20 + kc, feature_dim=64, head_dim=128, retrieved=kc)["total"]
    spent1 = token_equivalents(exact_tokens=21 + kc, feature_dim=64, head_dim=128, retrieved=kc + 1)["total"]
    assert spent <= 80 < spent1
    assert budget_top_k(30, anchors=20, feature_dim=64, head_dim=128, completion=True, mid_len=1000) is None
