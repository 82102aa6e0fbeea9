"""Ring seeding on CUDA (``tail_summaries``' fused flash-attention path with its log-sum-exp) against the
fp32 reference (``rectified_summaries_reference``): fresh random bf16 inputs, GQA, tails shorter and
longer than the band, a whole seeded ring row against the reference seeding; a continued chunk's attention split
at the band (``band_split_attention``) against plain causal attention and the reference summaries. Marked
``gpu``."""
from __future__ import annotations

import math

import pytest
import torch

from macattn.methods.mac.reference import rectified_summaries_reference
from macattn.core.attention import expand_kv_heads
from macattn.methods.mac.seeding import (band_split_applies, band_split_attention, fused_seeding_applies,
                                         seeded_ring_rows, tail_summaries)

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
