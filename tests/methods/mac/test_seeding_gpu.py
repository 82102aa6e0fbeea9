"""Ring seeding on CUDA (``tail_summaries``' fused flash-attention path with its log-sum-exp) against the
fp32 reference (``rectified_summaries_reference``): fresh random bf16 inputs, GQA, tails shorter and
longer than the band, a whole seeded ring row against the reference seeding. Marked ``gpu``."""
from __future__ import annotations

import math

import pytest
import torch

from macattn.methods.mac.reference import rectified_summaries_reference
from macattn.methods.mac.seeding import fused_seeding_applies, seeded_ring_rows, tail_summaries

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
