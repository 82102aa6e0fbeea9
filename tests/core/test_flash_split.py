"""``core.flash_split``: the split-over-keys bottom-right causal attention against its fp64 definition.

On the CPU the split and merge logic runs with a plain-torch stand-in for the flash kernel (same ``[B, S, H, d]``
operands, same ``(out, lse)``), so every remainder and split count is checked in fp64; on CUDA (marked ``gpu``)
the real flash kernel in bf16, fresh random inputs per case."""
from __future__ import annotations

import pytest
import torch

from macattn.core import flash_split
from macattn.core.flash_split import (flash_lower_right, flash_lower_right_reference, flash_varlen,
                                      flash_varlen_reference, kv_splits)
from macattn.core.ragged import ragged_attention_reference


def _dense_flash(q, k, v, causal, scale):
    """The flash forward's contract in plain torch: ``[B, n, Hq, d]`` over ``[B, K, Hkv, d]``, bottom-right causal."""
    B, n, Hq, _ = q.shape
    K, g = k.shape[1], Hq // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    logits = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        seen = torch.arange(K).view(1, K) <= (K - n + torch.arange(n)).view(n, 1)
        logits = logits.masked_fill(~seen, float("-inf"))
    return (torch.softmax(logits, -1) @ vh).transpose(1, 2), torch.logsumexp(logits, -1)


def _inputs(n, K, Hq, Hkv, d, dtype, device, seed, token_major=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, n, d, generator=g).to(device, dtype)
    if token_major:          # segment_kv's history buffers: [K, Hkv, d] seen as [1, Hkv, K, d]
        k, v = (torch.randn(K, Hkv, d, generator=g).to(device, dtype).transpose(0, 1).unsqueeze(0) for _ in range(2))
    else:
        k, v = (torch.randn(1, Hkv, K, d, generator=g).to(device, dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("n,K,splits", [(1, 1, 4), (1, 9, 4), (3, 3, 2), (5, 41, 1), (5, 41, 2), (5, 41, 3),
                                        (7, 64, 4), (7, 64, 8), (16, 200, 5), (2, 5, 7)])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
def test_split_and_merge_equal_the_definition(n, K, splits, Hq, Hkv, monkeypatch):
    monkeypatch.setattr(flash_split, "flash_forward", _dense_flash)
    q, k, v = _inputs(n, K, Hq, Hkv, 8, torch.float64, "cpu", seed=n * 1000 + K + splits)
    out, lse = flash_lower_right(q, k, v, 0.3, splits=splits)
    ref_out, ref_lse = flash_lower_right_reference(q, k, v, 0.3)
    assert out.shape == (1, Hq, n, 8) and lse.shape == (1, Hq, n)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-12, atol=1e-12)


def test_the_reference_is_causal_attention_aligned_bottom_right():
    q, k, v = _inputs(6, 30, 4, 2, 8, torch.float64, "cpu", seed=3)
    out, _ = flash_lower_right_reference(q, k, v, 0.25)
    ref = ragged_attention_reference(q, [k], [v], [6], 0.25)            # [1, n, Hq, d]
    torch.testing.assert_close(out.transpose(1, 2), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,heads,keys,sms,want", [
    (1028, 32, 33000, 132, 4),          # a later multi-turn turn's far part on an H100: 288 programs
    (1024, 32, 32512, 132, 5),          # MAC's window over a 32K prompt
    (8192, 32, 33000, 132, 1),          # a large chunk already fills the GPU
    (1028, 32, 5000, 132, 1),           # too few keys for a split of MIN_SPLIT_KEYS
    (100, 32, 9000, 132, 4),            # capped by the keys (4 x 2048 <= 8901)
])
def test_the_split_count(n, heads, keys, sms, want, monkeypatch):
    monkeypatch.setattr(flash_split, "_sm_count", lambda device: sms)
    assert kv_splits(n, heads, keys, torch.device("cpu")) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,K,splits", [(1, 1, None), (1, 40000, None), (1028, 33000, None), (1024, 32512, None),
                                        (300, 9001, None), (77, 5000, 3), (129, 4096, 2), (64, 64, 4)])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (8, 8)])
@pytest.mark.parametrize("token_major", [False, True])
def test_flash_lower_right_on_cuda_equals_the_definition(n, K, splits, Hq, Hkv, token_major):
    q, k, v = _inputs(n, K, Hq, Hkv, 128, torch.bfloat16, "cuda", seed=n + K, token_major=token_major)
    out, lse = flash_lower_right(q, k, v, 128 ** -0.5, splits=splits)
    ref_out, ref_lse = flash_lower_right_reference(q.float(), k.float(), v.float(), 128 ** -0.5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = (out.double() - ref_out).norm() / ref_out.norm()
    assert err < 1e-2, err
    assert (lse.double() - ref_lse).abs().max() < 1e-2


def _varlen_inputs(lengths, used, Hq, Hkv, d, dtype, device, seed):
    """Packed queries (``lengths``) and keys (each sequence's keys ``lengths[b]`` rows, of which ``used[b]`` count)."""
    g = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    q, k, v = (torch.randn(N, h, d, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)
    seq = None if used is None else torch.tensor(used, dtype=torch.int32, device=device)
    return q, k, v, cu, seq


VARLEN_CASES = [([7], None), ([5, 1, 12], None), ([9, 4, 6], [5, 0, 6]), ([3, 8], [1, 8])]


@pytest.mark.parametrize("lengths,used", VARLEN_CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (3, 3)])
def test_the_varlen_reference_is_each_sequence_bottom_right_causal(lengths, used, Hq, Hkv):
    """Sequence by sequence the reference is ``flash_lower_right_reference`` over its first ``used`` keys; the
    queries of a sequence whose keys end before them (``n > used``) see none: out 0, lse -inf."""
    q, k, v, cu, seq = _varlen_inputs(lengths, used, Hq, Hkv, 8, torch.float64, "cpu", seed=sum(lengths))
    out, lse = flash_varlen_reference(q, k, v, cu, cu, max(lengths), max(lengths), scale=0.3, seqused_k=seq)
    assert out.shape == q.shape and lse.shape == (Hq, q.shape[0]) and lse.dtype == torch.float32
    bare, none = flash_varlen_reference(q, k, v, cu, cu, 0, 0, scale=0.3, seqused_k=seq, lse=False)
    assert none is None and torch.equal(bare, out)
    off = 0
    for b, n in enumerate(lengths):
        m = n if used is None else used[b]
        qs, o, l = q[off: off + n], out[off: off + n], lse[:, off: off + n]
        seen = m - n + torch.arange(n) >= 0                     # queries with at least one key
        if m > 0 and seen.any():
            ro, rl = flash_lower_right_reference(qs[seen].transpose(0, 1).unsqueeze(0),
                                                 k[off: off + m].transpose(0, 1).unsqueeze(0),
                                                 v[off: off + m].transpose(0, 1).unsqueeze(0), 0.3)
            torch.testing.assert_close(o[seen], ro[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(l[:, seen], rl[0].float(), rtol=1e-6, atol=1e-6)
        assert (o[~seen] == 0).all() and (l[:, ~seen] == float("-inf")).all()
        off += n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths,used", VARLEN_CASES + [([1024] * 4, [768] * 4), ([1000, 1, 300, 2048], None)])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (4, 4)])
def test_flash_varlen_on_cuda_equals_the_reference(lengths, used, Hq, Hkv):
    """torch's flash varlen forward in bf16 (token-major views of a fused QKV buffer, as the packed prefill passes)
    against the fp32 reference: outputs within bf16 rounding, lse within 2e-2, empty rows exactly 0 / -inf."""
    d = 128
    q, k, v, cu, seq = _varlen_inputs(lengths, used, Hq, Hkv, d, torch.bfloat16, "cuda", seed=len(lengths))
    fused = torch.cat([q, k, v], 1)                          # [N, Hq + 2 Hkv, d]: strided head views
    q, k, v = fused[:, :Hq], fused[:, Hq: Hq + Hkv], fused[:, Hq + Hkv:]
    out, lse = flash_varlen(q, k, v, cu, cu, max(lengths), max(lengths), scale=d ** -0.5, seqused_k=seq)
    ro, rl = flash_varlen_reference(q, k, v, cu, cu, 0, 0, scale=d ** -0.5, seqused_k=seq)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (Hq, q.shape[0])
    empty = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all())
    assert (out.float().transpose(0, 1)[empty] == 0).all()
    assert ((out.float() - ro.float()).norm() / ro.float().norm()) < 1e-2
    assert (lse[~empty] - rl[~empty]).abs().max() < 2e-2
    bare, none = flash_varlen(q, k, v, cu, cu, max(lengths), max(lengths), scale=d ** -0.5, seqused_k=seq, lse=False)
    assert none is None and torch.equal(bare, out)
