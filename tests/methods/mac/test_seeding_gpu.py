"""Ring seeding on CUDA (``tail_summaries``' fused flash-attention path with its log-sum-exp) against the
fp32 reference (``rectified_summaries_reference``): fresh random bf16 inputs, GQA, tails shorter and
longer than the band, a whole seeded ring row against the reference seeding; a continued chunk's attention split
at the band (``band_split_attention``) against plain causal attention and the reference summaries; a fresh segment's
split (``fresh_split_attention``) against the definition, and packed MAC layers with it against the unsplit path
(``_fresh_split``; the same cases run on the CPU with stand-in kernels in ``test_fresh_split.py``); packed fresh
segments seeded at once (``seed_packed_``, torch's flash varlen) against one segment at a time
(``test_packed_seeding.py`` on the CPU). Marked ``gpu``."""
from __future__ import annotations

import math

import pytest
import torch

from macattn.methods.mac.reference import rectified_summaries_reference
from macattn.core.attention import expand_kv_heads
from macattn.methods.mac import backend
from macattn.methods.mac.seeding import (band_split_applies, band_split_attention, fresh_split_attention,
                                         fused_seeding_applies, seeded_ring_rows, tail_summaries)

from _fresh_split import (MUTATIONS, POISON_POS, Seg, assert_same_rings, cases, fresh_tails, mutant, packed_call,
                          packed_cases, row_error, run_both, run_packed_and_loop)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("S,n,band", [(4096, 1024, 256), (300, 64, 256), (64, 64, 0), (1000, 1000, 5), (17, 16, 16)])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (4, 4)])
def test_fused_tail_summaries_equal_the_reference(S, n, band, Hq, Hkv):
    g = torch.Generator(device="cuda").manual_seed(S + n + band)
    d = 128
    q = torch.randn(1, Hq, n, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, Hkv, S, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, Hkv, S, d, device="cuda", generator=g).bfloat16()
    assert fused_seeding_applies(q)
    got = tail_summaries(q, k, v, band=band, scale=1 / math.sqrt(d))
    ref = rectified_summaries_reference(q.float(), k.float(), v.float(), torch.arange(S - n, S, device="cuda"),
                                        band=band, scale=1 / math.sqrt(d))
    empty = torch.isinf(ref.lse)
    assert torch.equal(torch.isinf(got.lse), empty)
    assert torch.isfinite(got.o).all()
    if (~empty).any():
        lse_err = (got.lse[~empty] - ref.lse[~empty]).abs().max()
        assert lse_err < 2e-2, lse_err
        o_err = (got.o - ref.o).norm() / ref.o.norm()
        assert o_err < 1e-2, o_err
    assert (got.o[empty.unsqueeze(-1).expand_as(got.o)] == 0).all()


def test_fused_seeded_rows_equal_the_reference_rows():
    g = torch.Generator(device="cuda").manual_seed(3)
    B, Hq, Hkv, L, d, K = 1, 8, 2, 700, 64, 256
    q = torch.randn(B, Hq, L, d, device="cuda", generator=g).bfloat16()
    qp = torch.randn(B, Hq, L, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, Hkv, L, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Hkv, L, d, device="cuda", generator=g).bfloat16()
    fused = seeded_ring_rows(q, qp, k, v, window=K, band=64, scale=0.125)
    ref = seeded_ring_rows(q.float(), qp.float(), k.float(), v.float(), window=K, band=64, scale=0.125)
    torch.testing.assert_close(fused[0].float(), ref[0])
    assert torch.equal(fused[3], ref[3])
    torch.testing.assert_close(fused[1], ref[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused[2], ref[2], rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("S,Q,band", [(33_000, 1124, 64), (2048, 1, 256), (600, 300, 300), (700, 37, 1), (4096, 2000, 16)])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (4, 4)])
def test_band_split_attention_equals_causal_attention_and_the_summaries(S, Q, band, Hq, Hkv):
    """The chunk's output = causal attention over all ``S`` keys (fp32 math), its far part = the reference
    rectified summaries, for every query (none empty: ``S - Q >= band``)."""
    g = torch.Generator(device="cuda").manual_seed(S + Q + band)
    d, scale = 128, 1 / math.sqrt(128)
    q = torch.randn(1, Hq, Q, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, Hkv, S, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, Hkv, S, d, device="cuda", generator=g).bfloat16()
    assert band_split_applies(q, k, band)
    got = band_split_attention(q, k, v, band=band, scale=scale)
    assert got is not None, "this torch's flash took no window"
    out, far = got
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    kf, vf = expand_kv_heads(k.float(), Hq), expand_kv_heads(v.float(), Hq)
    logits = torch.einsum("bhqd,bhkd->bhqk", q.float(), kf) * scale
    pos = torch.arange(S - Q, S, device="cuda")
    logits = logits.masked_fill(torch.arange(S, device="cuda").view(1, -1) > pos.view(-1, 1), float("-inf"))
    ref_out = torch.einsum("bhqk,bhkd->bhqd", logits.softmax(-1), vf)
    err = (out.float() - ref_out).norm() / ref_out.norm()
    assert err < 1e-2, err
    ref_far = rectified_summaries_reference(q.float(), k.float(), v.float(), pos, band=band, scale=scale)
    assert (far.lse - ref_far.lse).abs().max() < 2e-2
    assert (far.o - ref_far.o).norm() / ref_far.o.norm() < 1e-2


def test_band_split_is_not_taken_where_it_does_not_pay_or_apply():
    q = torch.zeros(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
    assert not band_split_applies(q, k, 64)          # S - Q < band: the first queries' far part is empty
    assert not band_split_applies(q.float(), k.float(), 16)       # fp32: the reference path
    big_q = torch.zeros(1, 1, 8192, 64, device="cuda", dtype=torch.bfloat16)
    big_k = torch.zeros(1, 1, 32768, 64, device="cuda", dtype=torch.bfloat16)
    assert not band_split_applies(big_q, big_k, 64)  # cuDNN's split is faster there


@pytest.mark.parametrize("L,K,band", [(1280, 1024, 256), (4096, 1024, 64), (700, 256, 64), (65, 32, 33)])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (4, 4)])
def test_fresh_split_attention_equals_causal_attention_and_the_seeding(L, K, band, Hq, Hkv):
    """A fresh segment's split: head and tail = causal attention over the prompt (fp32 math), the far part = the
    ``tail_summaries`` that the seeding makes (bit for bit: the same call) and so the same ring rows; a far part one
    key short (the band one wider, so the output misses key ``t - band``) would fail the output check."""
    g = torch.Generator(device="cuda").manual_seed(L + K + band)
    d, scale = 128, 1 / math.sqrt(128)
    q, qp = (torch.randn(1, Hq, L, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, Hkv, L, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    got = fresh_split_attention(q, k, v, window=K, band=band, scale=scale)
    assert got is not None, "this torch's flash took no window"
    (head, tail), far = got
    assert head.shape == (1, Hq, L - K, d) and tail.shape == (1, Hq, K, d) and head.dtype == tail.dtype == q.dtype
    out = torch.cat([head, tail], 2).transpose(1, 2)                     # [1, L, Hq, d]
    kf, vf = expand_kv_heads(k.float(), Hq), expand_kv_heads(v.float(), Hq)
    logits = torch.einsum("bhqd,bhkd->bhqk", q.float(), kf) * scale
    pos = torch.arange(L, device="cuda")
    future = pos.view(1, -1) > pos.view(-1, 1)
    ref = torch.einsum("bhqk,bhkd->bqhd", logits.masked_fill(future, float("-inf")).softmax(-1), vf)
    assert row_error(out, ref) < 2e-2
    if L <= 1280:          # one key of t moves a row by ~1 / sqrt(t): > 2 % for the earliest tail rows here
        missed = future | ((pos.view(1, -1) == pos.view(-1, 1) - band) & (pos.view(-1, 1) >= L - K))
        missed_out = torch.einsum("bhqk,bhkd->bqhd", logits.masked_fill(missed, float("-inf")).softmax(-1), vf)
        assert row_error(missed_out, ref) > 2e-2
    want = tail_summaries(q[:, :, L - K:], k, v, band=band, scale=scale)
    assert torch.equal(far.o, want.o) and torch.equal(far.lse, want.lse)
    for a, b in zip(seeded_ring_rows(q, qp, k, v, window=K, band=band, scale=scale, summary=far),
                    seeded_ring_rows(q, qp, k, v, window=K, band=band, scale=scale)):
        assert torch.equal(a, b)


def test_fresh_split_falls_back_where_it_does_not_apply():
    q = torch.zeros(1, 4, 1279, 64, device="cuda", dtype=torch.bfloat16)
    assert fresh_split_attention(q, q, q, window=1024, band=256, scale=0.125) is None    # L - n = band - 1
    assert fresh_split_attention(q, q, q, window=2048, band=256, scale=0.125) is None    # window > L
    assert fresh_split_attention(q, q, q, window=1024, band=0, scale=0.125) is None      # no band
    assert fresh_split_attention(q.float(), q.float(), q.float(), window=1024, band=128, scale=0.125) is None
    assert fresh_split_attention(q, q, q, window=1024, band=255, scale=0.125) is not None


GPU_CASES = {**cases(1024, 256), "cudnn_head": ([Seg(0, 17_500)], [True])}   # head 16,476: cuDNN (uses_cudnn)


@pytest.mark.parametrize("name", GPU_CASES)
def test_a_packed_layer_with_fresh_splits_equals_the_unsplit_path(name, monkeypatch):
    """8B shapes, bf16, rings poisoned (NaN) first: each fresh segment splits where ``cases`` says, the output equals
    the unsplit path's row by row within bf16 rounding, the rings bit for bit (no poison left in a seeded row); the
    same check fails for the output with a fresh tail one row off."""
    segs, want = GPU_CASES[name]
    p = packed_call(segs, Hq=32, Hkv=8, d=128, dtype=torch.bfloat16, device="cuda", seed=len(name))
    (out, rings, taken), (old_out, old_rings) = run_both(monkeypatch, p, window=1024, band=256)
    assert taken == want
    assert torch.isfinite(out).all()
    assert row_error(out, old_out) < 2e-2
    assert_same_rings(rings, old_rings, p)
    tail = fresh_tails(p, 1024)[0]
    shifted = out.clone()
    shifted[:, tail] = out[:, tail].roll(1, dims=1)
    assert row_error(shifted, old_out) > 2e-2


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_packed_checks_catch_a_split_one_position_off(mutation, monkeypatch):
    """Each deliberate off-by-one of the split (``_fresh_split.MUTATIONS``) fails the checks above in bf16."""
    segs, _ = GPU_CASES["mixed"]
    p = packed_call(segs, Hq=32, Hkv=8, d=128, dtype=torch.bfloat16, device="cuda", seed=5)
    monkeypatch.setattr(backend, "fresh_split_attention", mutant(mutation))
    with pytest.raises(AssertionError):
        (out, rings, _), (old_out, old_rings) = run_both(monkeypatch, p, window=1024, band=256)
        assert row_error(out, old_out) < 2e-2
        assert_same_rings(rings, old_rings, p)


@pytest.mark.parametrize("name", packed_cases(1024, 256))
def test_packed_seeding_on_cuda_equals_one_segment_at_a_time(name, monkeypatch):
    """8B shapes, bf16, rings poisoned first: the call takes the packed seeding (one varlen call), its output equals
    the per-segment path's row by row within bf16 rounding, the query ring and positions exactly, the summaries
    within the two flash kernels' rounding, and poison exactly where the per-segment path left it."""
    p = packed_call(packed_cases(1024, 256)[name], Hq=32, Hkv=8, d=128, dtype=torch.bfloat16, device="cuda",
                    seed=len(name))
    (out, rings, calls), (old_out, old_rings) = run_packed_and_loop(monkeypatch, p, window=1024, band=256)
    assert calls == 1
    assert torch.isfinite(out).all() and row_error(out, old_out) < 2e-2
    (q, o, lse, pos), (q0, o0, lse0, pos0) = rings, old_rings
    assert torch.equal(pos, pos0) and torch.equal(q.isnan(), q0.isnan())
    torch.testing.assert_close(q, q0, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(lse.isnan(), lse0.isnan()) and torch.equal(torch.isinf(lse), torch.isinf(lse0))
    live = torch.isfinite(lse0)
    if live.any():                          # "no_far_keys": every entry empty (o 0, lse -inf), checked above
        assert (lse[live] - lse0[live]).abs().max() < 2e-2
        assert ((o[live] - o0[live]).norm() / o0[live].norm()) < 1e-2
    assert torch.equal(o[~live & ~lse0.isnan()], o0[~live & ~lse0.isnan()])
    assert ((pos != POISON_POS).any(-1)).sum() >= 1
