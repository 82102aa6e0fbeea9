"""``macattn::retrieval_completion`` / ``macattn::completion_cache`` as torch ops on the CPU (the
reference path): same results as ``macattn.methods.completion.reference``, errors that name the input, fake
tensors for export."""
import math

import pytest
import torch

from macattn.methods.completion.reference import build_completion_cache_batched, retrieval_completion_step
from macattn.methods.completion.ops import completion_cache, retrieval_completion


def _problem(seed, B=3, Hq=4, Hkv=2, T=50, d=8, F=6):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(B, Hq, d), r(B, Hkv, T, d), r(B, Hkv, T, d)
    lpq, lpk = r(B, Hq, F) * 0.5, r(B, Hkv, T, F) * 0.5
    npf = torch.tensor([44, 10, 0][:B])
    sl = torch.tensor([50, 12, 5][:B])
    return q, k, v, sl, npf, lpq, lpk


def test_ops_equal_the_reference_and_default_scale():
    q, k, v, sl, npf, lpq, lpk = _problem(0)
    comp = completion_cache(lpk, v, npf, 3, 5)
    want = build_completion_cache_batched(lpk, v, npf, n_sink=3, n_tail=5)
    for a, b in zip(comp, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    out = torch.ops.macattn.retrieval_completion(q, k, v, sl, npf, lpq, lpk, *comp, 3, 5, 4, 0.0)
    ref = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, *comp, n_sink=3, n_tail=5, top_k=4)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    scaled = retrieval_completion(q, k, v, sl, npf, lpq, lpk, *comp, 3, 5, 4, 0.5)
    ref_s = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, *comp, n_sink=3, n_tail=5, top_k=4, scale=0.5)
    torch.testing.assert_close(scaled, ref_s, rtol=0, atol=0)
    assert not torch.allclose(scaled, out)


def test_exact_when_top_k_covers_the_mid():
    q, k, v, sl, npf, lpq, lpk = _problem(1)
    comp = completion_cache(lpk, v, npf, 3, 5)
    out = retrieval_completion(q, k, v, sl, npf, lpq, lpk, *comp, 3, 5, 1000, 0.0)
    for i in range(q.shape[0]):
        L = int(sl[i])
        kk = k[i, :, :L].double().repeat_interleave(2, 0)
        vv = v[i, :, :L].double().repeat_interleave(2, 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[i].double(), kk) / math.sqrt(q.shape[2]), -1)
        torch.testing.assert_close(out[i].double(), torch.einsum("ht,htd->hd", p, vv), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arg,bad,match", [
    (0, torch.randn(3, 3, 8), "Hq=3 must be a positive multiple of Hkv=2"),
    (3, torch.tensor([50.0, 12.0, 5.0]), "seq_lens must be int32/int64"),
    (5, torch.randn(3, 4, 6, dtype=torch.float64), "log_phi_q must be float32"),
    (6, torch.randn(3, 2, 49, 6), r"log_phi_k must have shape \[3, 2, 50, 6\]"),
    (9, torch.randn(3, 2, 7), r"comp_shift must have shape \[3, 2, 6\]"),
])
def test_bad_inputs_name_the_parameter(arg, bad, match):
    args = list(_problem(2))
    args += list(completion_cache(args[6], args[2], args[4], 3, 5))
    args[arg] = bad
    with pytest.raises((ValueError, TypeError), match=match):
        retrieval_completion(*args, 3, 5, 4, 0.0)


def test_bad_attributes_and_lengths():
    args = list(_problem(3))
    comp = list(completion_cache(args[6], args[2], args[4], 3, 5))
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        retrieval_completion(*args, *comp, 3, 5, -1, 0.0)
    with pytest.raises(ValueError, match="scale must be a finite float"):
        retrieval_completion(*args, *comp, 3, 5, 4, float("nan"))
    args[3] = torch.tensor([50, 12, 51])
    with pytest.raises(ValueError, match=r"seq_lens\[2\] must be in \[1, T=50\]"):
        retrieval_completion(*args, *comp, 3, 5, 4, 0.0)
    with pytest.raises(ValueError, match=r"n_prefill must be in \[0, T=50\]"):
        completion_cache(args[6], args[2], torch.tensor([44, 10, 60]), 3, 5)
    with pytest.raises(ValueError, match="n_sink must be an int >= 0"):
        completion_cache(args[6], args[2], args[4], -2, 5)


def test_fake_tensors_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v, sl, npf, lpq, lpk = (mode.from_tensor(t) for t in _problem(4))
        a, b, c = torch.ops.macattn.completion_cache(lpk, v, npf, 3, 5)
        out = torch.ops.macattn.retrieval_completion(q, k, v, sl, npf, lpq, lpk, a, b, c, 3, 5, 4, 0.0)
    assert tuple(a.shape) == (3, 2, 6, 8) and a.dtype == torch.float32 and tuple(c.shape) == (3, 2, 6)
    assert tuple(out.shape) == (3, 4, 8) and out.dtype == q.dtype
