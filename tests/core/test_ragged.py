"""The packed prefill plan's attention (``macattn.core.ragged``) against its plain-torch definition:
fresh random inputs per case, segments fresh and continued, one-token segments, GQA ratios; CPU in
fp32 / fp64, CUDA in bf16 (marked ``gpu``)."""
from __future__ import annotations

import math

import pytest
import torch

from macattn.core import ragged
from macattn.core.ragged import (PrefillSegment, RaggedPrefill, continued_cudnn_shapes, prewarm_cudnn_plans,
                                 ragged_attention_reference, split_causal_attention)

# (start, length) per segment
CASES = [
    [(0, 7)],
    [(0, 1)],
    [(5, 1)],
    [(0, 9), (12, 4), (0, 1), (3, 6)],
    [(40, 17), (0, 33)],
]


def _run(case, Hq, Hkv, d, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(device, dtype)  # noqa: E731
    N = sum(n for _, n in case)
    rows_total = sum(s + n for s, n in case) + 8
    k_pool, v_pool = rand(rows_total, Hkv, d), rand(rows_total, Hkv, d)
    query, key, value = rand(1, Hq, N, d), rand(1, Hkv, N, d), rand(1, Hkv, N, d)
    perm = torch.randperm(rows_total, generator=g).to(device)        # scattered pool rows
    segments, full_k, full_v, off, r = [], [], [], 0, 0
    for start, n in case:
        hist = perm[r: r + start] if start else None
        r += start
        segments.append(PrefillSegment(off, n, start, slot=len(segments), history=hist))
        kh = k_pool[hist].transpose(0, 1).unsqueeze(0) if start else key.new_empty(1, Hkv, 0, d)
        vh = v_pool[hist].transpose(0, 1).unsqueeze(0) if start else value.new_empty(1, Hkv, 0, d)
        full_k.append(torch.cat([kh, key[:, :, off: off + n]], 2))
        full_v.append(torch.cat([vh, value[:, :, off: off + n]], 2))
        off += n
    plan = RaggedPrefill(segments, [k_pool], [v_pool])
    scale = 1 / math.sqrt(d)
    out = plan.attend(0, query, key, value, scale)
    ref = ragged_attention_reference(query, full_k, full_v, [n for _, n in case], scale)
    assert out.shape == (1, N, Hq, d) and out.dtype == dtype
    assert plan.last_token_indices() == [s.offset + s.length - 1 for s in segments]
    return out, ref


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_attention_equals_the_definition(case, Hq, Hkv, dtype):
    out, ref = _run(case, Hq, Hkv, 16, dtype, "cpu", seed=hash((str(case), Hq, Hkv)) % 1000)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.to(ref.dtype), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("pool_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float64, torch.float64)])
@pytest.mark.parametrize("start,n", [(1, 1), (37, 5), (64, 64)])
def test_segment_kv_is_the_history_then_the_new_rows(pool_dtype, dtype, start, n):
    """``segment_kv`` of a continued segment = the pool's history rows (cast to the call's dtype) followed by
    the call's rows, every position, as ``[1, Hkv, start + n, d]`` with a contiguous last dimension."""
    g = torch.Generator().manual_seed(start * 100 + n)
    Hkv, d, rows = 3, 8, start + 11
    k_pool = torch.randn(rows, Hkv, d, generator=g).to(pool_dtype)
    v_pool = torch.randn(rows, Hkv, d, generator=g).to(pool_dtype)
    key, value = (torch.randn(1, Hkv, n + 2, d, generator=g).to(dtype) for _ in range(2))
    hist = torch.randperm(rows, generator=g)[:start]
    plan = RaggedPrefill([PrefillSegment(2, n, start, slot=0, history=hist)], [k_pool], [v_pool])
    k, v = plan.segment_kv(0, 0, key, value)
    for got, pool, new in ((k, k_pool, key), (v, v_pool, value)):
        want = torch.cat([pool[hist].transpose(0, 1).unsqueeze(0).to(dtype), new[:, :, 2: 2 + n]], 2)
        assert got.shape == (1, Hkv, start + n, d) and got.dtype == dtype and got.stride(-1) == 1
        assert torch.equal(got, want)


def test_an_empty_plan_is_refused():
    with pytest.raises(ValueError, match="at least one segment"):
        RaggedPrefill([], [], [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES + [[(0, 1024), (3000, 512), (0, 77)],
                                          [(3000, 2048), (0, 100), (700, 2053)]])
@pytest.mark.parametrize("Hq,Hkv,d", [(32, 8, 128), (8, 8, 64)])
@pytest.mark.parametrize("cudnn_min_work", [ragged.CUDNN_MIN_WORK, 0])
def test_packed_attention_on_cuda_equals_the_definition(case, Hq, Hkv, d, cudnn_min_work, monkeypatch):
    """Every segment on flash (the default threshold at these sizes) and on cuDNN (threshold 0: fresh
    segments square-causal, continued ones through the split path)."""
    monkeypatch.setattr(ragged, "CUDNN_MIN_WORK", cudnn_min_work)
    monkeypatch.setattr(ragged, "_SPLIT_OK", {})
    out, ref = _run(case, Hq, Hkv, d, torch.bfloat16, "cuda", seed=7)
    assert torch.isfinite(out).all()
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    # cuDNN took the token-major history buffers (a refusal would fall back to flash silently, slower)
    assert ragged._SPLIT_OK.get(out.device, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("Q,S", [(1, 2), (64, 64 + 1), (2048, 6000), (4096, 4096 + 128)])
@pytest.mark.parametrize("kv_layout", ["head-major", "token-major"])
def test_split_continued_chunk_equals_the_definition(Q, S, kv_layout):
    """The two-call cuDNN path with the log-sum-exp merge, GQA 32/8, token-major query as the fused
    prefill hands it, keys / values head-major or token-major (``segment_kv``'s history buffers), against
    the fp32 definition."""
    g = torch.Generator(device="cpu").manual_seed(Q + S)
    q = torch.randn(Q, 32, 128, generator=g).to("cuda", torch.bfloat16).transpose(0, 1).unsqueeze(0)
    if kv_layout == "head-major":
        k, v = (torch.randn(1, 8, S, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    else:
        k, v = (torch.randn(S, 8, 128, generator=g).to("cuda", torch.bfloat16).transpose(0, 1).unsqueeze(0)
                for _ in range(2))
    out = split_causal_attention(q, k, v, 128 ** -0.5)
    ref = ragged_attention_reference(q, [k], [v], [Q], 128 ** -0.5)
    assert out.shape == (1, 32, Q, 128) and out.dtype == torch.bfloat16
    err = (out.transpose(1, 2).float() - ref).norm() / ref.norm()
    assert err < 1e-2, err


@pytest.mark.parametrize("Q,S,cudnn", [(32768, 32768, True), (1024, 1024, False), (8192, 8192, False),
                                       (8191, 8191 + 16387, True), (8191, 8191 + 8196, False),
                                       (2047, 2047 + 26628, False), (1, 40000, False)])
def test_cudnn_only_where_the_work_repays_its_plan_build(Q, S, cudnn):
    """The measured points of ``CUDNN_MIN_WORK`` (H100): cuDNN where 32 layers save more than its ~70 ms
    per-shape plan build, flash elsewhere."""
    assert ragged.uses_cudnn(Q, S) is cudnn


def test_a_segments_own_attention_replaces_the_causal_one_where_it_answers():
    """``attend(segment_attention=...)``: a segment whose callable returns a tensor takes it (here: a marker),
    one whose callable returns None gets the causal attention; the callable sees each segment's queries and its
    whole keys / values (history first) before ``each`` does."""
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, d, case = 4, 2, 8, [(6, 3), (0, 5), (2, 4)]
    N, rows_total = 12, 16
    k_pool, v_pool = torch.randn(rows_total, Hkv, d, generator=g), torch.randn(rows_total, Hkv, d, generator=g)
    query, key, value = (torch.randn(1, h, N, d, generator=g) for h in (Hq, Hkv, Hkv))
    segments, off, r = [], 0, 0
    for start, n in case:
        segments.append(PrefillSegment(off, n, start, slot=len(segments),
                                       history=torch.arange(r, r + start) if start else None))
        off, r = off + n, r + start
    plan = RaggedPrefill(segments, [k_pool], [v_pool])
    seen = []

    def own(i, q, k, v):
        seen.append(("own", i, q.shape[2], k.shape[2]))
        return torch.full_like(q, 7.0) if i == 1 else None

    out = plan.attend(0, query, key, value, 0.3, each=lambda i, k, v: seen.append(("each", i)),
                      segment_attention=own)
    plain = plan.attend(0, query, key, value, 0.3)
    assert seen == [("own", 0, 3, 9), ("each", 0), ("own", 1, 5, 5), ("each", 1), ("own", 2, 4, 6), ("each", 2)]
    assert (out[:, 3:8] == 7.0).all()
    torch.testing.assert_close(out[:, :3], plain[:, :3], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 8:], plain[:, 8:], rtol=0, atol=0)


def test_the_continued_chunk_shapes_that_take_cudnn(monkeypatch):
    """Every later part of a prompt prefilled in parts of ``Q`` tokens is ``Q`` queries over ``(j + 1) Q`` keys;
    those with ``CUDNN_PLANNED_MIN_WORK`` get plans built (8B serving: 7,936-token parts up to 32K), after which
    ``uses_cudnn`` sends them to cuDNN; an unbuilt shape of the same work stays on flash."""
    assert continued_cudnn_shapes([7936], 33856) == [(7936, 15872), (7936, 23808), (7936, 31744)]
    assert continued_cudnn_shapes([32768], 33856) == []
    assert continued_cudnn_shapes([7936, 7936, 100], 3 * 7936) == [(7936, 15872), (7936, 23808)]
    got = continued_cudnn_shapes([2048, 4096, 16384], 65536)
    assert got == sorted(got) and all(S % Q == 0 and Q * (S - Q) >= ragged.CUDNN_PLANNED_MIN_WORK for Q, S in got)
    assert (16384, 32768) in got and (4096, 8192) in got and (2048, 4096) not in got
    monkeypatch.setattr(ragged, "_PLANNED", set())
    assert not ragged.uses_cudnn(7936, 15872) and not ragged.uses_cudnn(7936, 7936 + 6912)
    ragged._PLANNED.add((7936, 15872))
    assert ragged.uses_cudnn(7936, 15872) and not ragged.uses_cudnn(7936, 7936 + 6912)
    ragged._PLANNED.add((1024, 2048))               # built, but below the work where cuDNN wins outright
    assert not ragged.uses_cudnn(1024, 2048)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prewarm_builds_the_split_plans_and_the_split_still_answers(monkeypatch):
    monkeypatch.setattr(ragged, "_SPLIT_OK", {})
    dev = torch.device("cuda")
    assert prewarm_cudnn_plans([(2048, 12288)], 32, 8, 128, torch.bfloat16, dev) == [(2048, 12288)]
    assert ragged._SPLIT_OK.get(dev, True)
    out, ref = _run([(10240, 2048)], 32, 8, 128, torch.bfloat16, "cuda", seed=11)
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


FRESH_CASES = [[(0, 7)], [(0, 1)], [(0, 9), (0, 4), (0, 1), (0, 33)]]


@pytest.mark.parametrize("case", FRESH_CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 1)])
def test_fresh_segments_as_one_varlen_call_equal_the_definition(case, Hq, Hkv, monkeypatch):
    """Every segment fresh: the plan takes one ``varlen_attention`` call (forced on the CPU, where it is
    ``flash_varlen_reference``) and still equals the definition; ``each`` still sees every segment's keys."""
    calls = []
    real = ragged.varlen_attention
    monkeypatch.setattr(ragged, "varlen_applies", lambda query: True)
    monkeypatch.setattr(ragged, "varlen_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, ref = _run(case, Hq, Hkv, 16, torch.float64, "cpu", seed=len(case) + Hkv)
    assert calls == [1] * 1
    torch.testing.assert_close(out.to(ref.dtype), ref, rtol=1e-12, atol=1e-12)


def test_a_call_with_a_continued_segment_is_not_varlen(monkeypatch):
    monkeypatch.setattr(ragged, "varlen_applies", lambda query: True)
    q = torch.zeros(1, 2, 5, 4)
    fresh = RaggedPrefill([PrefillSegment(0, 2, 0, 0), PrefillSegment(2, 3, 0, 1)], [None], [None])
    cont = RaggedPrefill([PrefillSegment(0, 2, 0, 0), PrefillSegment(2, 3, 4, 1, history=torch.arange(4))],
                         [None], [None])
    v = fresh.varlen(q)
    assert v.cu.tolist() == [0, 2, 5] and v.cu.dtype == torch.int32 and v.max_len == 3
    assert fresh.varlen(q) is v                               # made once per call
    assert cont.varlen(q) is None
    monkeypatch.setattr(ragged, "varlen_applies", lambda query: False)
    assert RaggedPrefill([PrefillSegment(0, 2, 0, 0)], [None], [None]).varlen(q) is None
