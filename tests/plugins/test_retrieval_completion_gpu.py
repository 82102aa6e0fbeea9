"""Triton ``macattn::retrieval_completion`` / ``macattn::completion_cache`` against the fp64 reference
(``macattn.methods.completion.reference``).

``@pytest.mark.gpu``, skipped without CUDA or triton; ``MACATTN_TRITON_INTERPRET=1`` runs the same
tests through Triton's interpreter on CPU tensors. Inputs are fresh random draws per case; every
allocation of the launchers (outputs and scratch) is NaN-poisoned. Rows mix lengths and hit the
edges: empty mid (``N <= n_sink + n_tail``), ``N = 0``, mid shorter than ``top_k`` (exact step),
``top_k = 0`` (sink + tail + completion), GQA groups 1 to 8, long generated regions.

The Top-k is taken over fp32 logits, the reference's over fp64: two keys whose logits differ by
~1e-6 may be ranked differently. So the selection is tested on its own (every pick within a
tolerance of the true k-th logit), and the step is compared with the reference replaying the
kernel's selection.
"""
from __future__ import annotations

import math

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET, poison_allocations  # noqa: E402  (first: sets the interpreter switch)
from macattn.methods.completion.reference import build_completion_cache_batched, hybrid_decode_step, partition  # noqa: E402

pytestmark = GPU_MARKS

# (Hq, Hkv, d, F, T, n_sink, n_tail, rows [(n_prefill, seq_len)])
CASES = [
    (4, 2, 16, 8, 80, 4, 8, [(70, 75), (20, 20), (5, 9)]),          # mid 58 / 8 / empty (N <= sink + tail)
    (8, 1, 32, 16, 130, 0, 16, [(128, 130), (0, 3)]),                # no sink; N = 0 (all generated)
    (2, 2, 24, 12, 40, 8, 0, [(40, 40)]),                            # no tail, non-pow2 d and F
    (6, 3, 16, 20, 200, 2, 3, [(150, 199), (199, 200), (60, 61)]),  # long generated region
]
if not INTERPRET:
    CASES += [
        (32, 8, 128, 64, 4096, 16, 64, [(4000, 4096), (1000, 1010), (70, 80), (2500, 2500)]),
        (28, 4, 128, 64, 9000, 16, 64, [(8990, 9000), (300, 301)]),
        (32, 8, 128, 64, 32768, 16, 64, [(32700, 32768)]),
        (64, 8, 64, 32, 1500, 4, 32, [(1400, 1500), (900, 1450), (36, 40)]),
    ]
TOP_KS = [0, 7, 64, 1 << 20]      # 1 << 20 >= every mid: the step is exact attention


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    from macattn.plugins.retrieval_completion import op

    poison_allocations(monkeypatch, op)


def _cuda_op(name: str):
    """``torch.ops.macattn.<name>`` with the Triton launchers registered as its CUDA kernel."""
    from macattn.methods.kernels import register_kernels
    assert f"macattn::{name}" in register_kernels()
    return getattr(torch.ops.macattn, name)


def _step(*args):
    """The decode step through the op's CUDA dispatch (the Triton launcher); the launcher itself
    under the interpreter (CPU tensors would dispatch to the reference)."""
    if INTERPRET:
        from macattn.plugins.retrieval_completion.op import retrieval_completion_triton
        return retrieval_completion_triton(*args)
    return _cuda_op("retrieval_completion")(*args)


def _cache(*args):
    if INTERPRET:
        from macattn.plugins.retrieval_completion.op import completion_cache_triton
        return completion_cache_triton(*args)
    return _cuda_op("completion_cache")(*args)


def _case(case, dtype, seed):
    Hq, Hkv, d, F, T, n_sink, n_tail, rows = case
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = r(B, Hq, d).to(dtype)
    k = (r(B, Hkv, T, d) * 1.5).to(dtype)
    v = r(B, Hkv, T, d).to(dtype)
    # log φ_k with per-feature ramps over t, so the running max of the cache build moves
    ramp = torch.linspace(-2, 2, F)[None, None, None, :] * torch.linspace(0, 1, T)[None, None, :, None]
    lpk = r(B, Hkv, T, F) * 0.7 + ramp
    lpq = r(B, Hq, F) * 0.7 - 1.0
    npf = torch.tensor([n for n, _ in rows])
    sl = torch.tensor([s for _, s in rows])
    return dict(q=q, k=k, v=v, lpk=lpk, lpq=lpq, npf=npf, sl=sl, n_sink=n_sink, n_tail=n_tail)


def _to(dev, **t):
    return {name: (x.to(dev) if torch.is_tensor(x) else x) for name, x in t.items()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


class _Replay:
    """A ``Selector`` that hands the reference the kernel's picks, in the reference's call order
    (batch row, then KV head, only where something is retrieved), as mid-relative indices."""

    def __init__(self, idx, npf, sl, n_sink, n_tail, group):
        self.calls = []
        for i in range(idx.shape[0]):
            p = partition(int(npf[i]), int(sl[i]), n_sink=n_sink, n_tail=n_tail)
            for g in range(idx.shape[1] // group):
                rows = []
                for h in range(g * group, (g + 1) * group):
                    pos = idx[i, h]
                    pos = pos[(pos >= p.mid_start) & (pos < p.mid_end)]
                    rows.append(pos - p.mid_start)
                if rows[0].numel():
                    self.calls.append(torch.stack(rows))

    def select(self, q, k_mid, k, scale):
        out = self.calls.pop(0)
        assert out.shape == (q.shape[0], k), (out.shape, q.shape[0], k)
        return out.to(q.device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}x{c[1]}-d{c[2]}-F{c[3]}-T{c[4]}" if isinstance(c, tuple) else None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_completion_cache_matches_reference(case, dtype):
    t = _case(case, dtype, seed=11)
    a, b, c = _cache(t["lpk"].to(DEVICE), t["v"].to(DEVICE), t["npf"].to(DEVICE),
                                                 t["n_sink"], t["n_tail"])
    ra, rb, rc = build_completion_cache_batched(t["lpk"], t["v"], t["npf"], n_sink=t["n_sink"], n_tail=t["n_tail"])
    tol = 2e-6 if case[4] <= 10_000 else 1e-5     # fp32 sums over up to 32K tokens
    for got, want in ((a, ra), (b, rb), (c, rc)):
        assert not got.isnan().any()
        assert _rel(got.cpu(), want) < tol
    torch.testing.assert_close(c.cpu(), rc, rtol=0, atol=0)      # the shift is an exact max
    empty = [i for i, (n, _) in enumerate(case[7]) if n <= case[5] + case[6]]
    for i in empty:
        assert float(a[i].abs().max()) == 0 and float(b[i].abs().max()) == 0 and float(c[i].abs().max()) == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}x{c[1]}-T{c[4]}" if isinstance(c, tuple) else None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [7, 64, 1 << 20])
def test_mid_topk_is_a_topk(case, dtype, top_k):
    from macattn.plugins.retrieval_completion.op import mid_topk_triton

    t = _case(case, dtype, seed=top_k % 97 + 3)
    Hq, Hkv, d = case[0], case[1], case[2]
    scale = 1 / math.sqrt(d)
    idx = mid_topk_triton(t["q"].to(DEVICE), t["k"].to(DEVICE), t["npf"].to(DEVICE), t["n_sink"], t["n_tail"], top_k,
                          scale).cpu()
    assert idx.shape == (len(case[7]), Hq, min(top_k, case[4]))
    grp = Hq // Hkv
    for i, (n, _) in enumerate(case[7]):
        p = partition(n, n, n_sink=t["n_sink"], n_tail=t["n_tail"])
        k_eff = min(top_k, p.mid_len)
        for h in range(Hq):
            pos = idx[i, h]
            pos = pos[(pos >= p.mid_start) & (pos < p.mid_end)]
            assert pos.numel() == k_eff and pos.unique().numel() == k_eff
            if not k_eff:
                continue
            logits = scale * (t["k"][i, h // grp, p.mid_start:p.mid_end].double() @ t["q"][i, h].double())
            kth = logits.topk(k_eff).values[-1]
            assert float(logits[pos - p.mid_start].min()) >= float(kth) - 1e-4 * max(1.0, abs(float(kth)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}x{c[1]}-T{c[4]}" if isinstance(c, tuple) else None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("splits", ["auto", "many"])
def test_step_matches_reference(case, dtype, top_k, splits, monkeypatch):
    """``many``: split-K down to 4 items per split (empty trailing splits included)."""
    from macattn.plugins.retrieval_completion import op
    from macattn.plugins.retrieval_completion.op import mid_topk_triton

    if splits == "many":
        monkeypatch.setattr(op, "DECODE_LAUNCH", dict(BLOCK_K=16, num_warps=4, WAVES=4096, MIN_ITEMS=4))

    t = _case(case, dtype, seed=top_k % 89 + 5)
    Hq, Hkv, d = case[0], case[1], case[2]
    comp = build_completion_cache_batched(t["lpk"], t["v"], t["npf"], n_sink=t["n_sink"], n_tail=t["n_tail"])
    g = _to(DEVICE, **t)
    cg = [x.to(DEVICE) for x in comp]
    out = _step(g["q"], g["k"], g["v"], g["sl"], g["npf"], g["lpq"], g["lpk"], *cg,
                                                 t["n_sink"], t["n_tail"], top_k, 0.0)
    assert out.dtype == dtype and out.shape == t["q"].shape and not out.isnan().any()
    idx = mid_topk_triton(g["q"], g["k"], g["npf"], t["n_sink"], t["n_tail"], top_k, 1 / math.sqrt(d)).cpu()
    sel = _Replay(idx, t["npf"], t["sl"], t["n_sink"], t["n_tail"], Hq // Hkv)
    ref = hybrid_decode_step(t["q"], t["k"], t["v"], t["sl"], t["npf"], n_sink=t["n_sink"], n_tail=t["n_tail"],
                             top_k=top_k, selector=sel, completion=(t["lpq"], t["lpk"], *comp))
    assert not sel.calls
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    if splits == "many":
        assert op.num_splits(out.shape[0] * Hq, 4 * 64, DEVICE) == 64
    for i in range(len(case[7])):
        assert _rel(out[i].cpu(), ref[i]) < tol, (i, case[7][i])


def test_noncontiguous_cache_views_and_int32_lengths():
    case = CASES[0]
    t = _case(case, torch.float32, seed=5)
    B, Hkv, T, d = t["k"].shape
    F = t["lpk"].shape[3]
    big_k = torch.randn(B, Hkv, T + 17, d)
    big_v = torch.randn(B, Hkv, T + 17, d)
    big_l = torch.randn(B, Hkv, T + 17, F)
    big_k[:, :, :T], big_v[:, :, :T], big_l[:, :, :T] = t["k"], t["v"], t["lpk"]
    views = [x.to(DEVICE)[:, :, :T] for x in (big_k, big_v, big_l)]
    assert not views[0].is_contiguous()
    comp = [x.to(DEVICE) for x in build_completion_cache_batched(t["lpk"], t["v"], t["npf"], n_sink=t["n_sink"],
                                                                 n_tail=t["n_tail"])]
    args = (t["q"].to(DEVICE),)
    got = _step(*args, views[0], views[1], t["sl"].int().to(DEVICE),
                                                 t["npf"].int().to(DEVICE), t["lpq"].to(DEVICE), views[2], *comp,
                                                 t["n_sink"], t["n_tail"], 7, 0.0)
    want = _step(*args, t["k"].to(DEVICE), t["v"].to(DEVICE), t["sl"].to(DEVICE),
                                                  t["npf"].to(DEVICE), t["lpq"].to(DEVICE), t["lpk"].to(DEVICE), *comp,
                                                  t["n_sink"], t["n_tail"], 7, 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cache_view = _cache(views[2], views[1], t["npf"].int().to(DEVICE), t["n_sink"],
                                                    t["n_tail"])
    for a, b in zip(cache_view, comp):
        assert _rel(a.cpu(), b.cpu()) < 2e-6


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_eager():
    case = CASES[4]
    t = _to(DEVICE, **_case(case, torch.bfloat16, seed=3))
    comp = _cache(t["lpk"], t["v"], t["npf"], t["n_sink"], t["n_tail"])
    args = (t["q"], t["k"], t["v"], t["sl"], t["npf"], t["lpq"], t["lpk"], *comp, t["n_sink"], t["n_tail"], 64, 0.0)
    eager = _step(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _step(*args)      # warm-up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(*args)
    t["q"].copy_(torch.randn_like(t["q"]))
    graph.replay()
    fresh = _step(*args)
    torch.testing.assert_close(static_out, fresh, rtol=0, atol=0)
    assert not torch.equal(fresh, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subtraction_clamps_at_zero(dtype):
    """A cache whose ``b`` is smaller than what the retrieved tokens remove (here: scaled down
    1000x) must drop those features (``b' = 0``, ``A' = 0``), never take log of a negative."""
    from macattn.plugins.retrieval_completion.op import mid_topk_triton

    case = CASES[0]
    t = _case(case, dtype, seed=21)
    a, b, c = build_completion_cache_batched(t["lpk"], t["v"], t["npf"], n_sink=t["n_sink"], n_tail=t["n_tail"])
    b = b * 1e-3
    b[0, 0, :2] *= 1e6          # a few features keep a positive remainder
    g = _to(DEVICE, **t)
    out = _step(g["q"], g["k"], g["v"], g["sl"], g["npf"], g["lpq"], g["lpk"], a.to(DEVICE), b.to(DEVICE),
                c.to(DEVICE), t["n_sink"], t["n_tail"], 7, 0.0)
    assert not out.isnan().any()
    idx = mid_topk_triton(g["q"], g["k"], g["npf"], t["n_sink"], t["n_tail"], 7, 1 / math.sqrt(case[2])).cpu()
    sel = _Replay(idx, t["npf"], t["sl"], t["n_sink"], t["n_tail"], case[0] // case[1])
    ref = hybrid_decode_step(t["q"], t["k"], t["v"], t["sl"], t["npf"], n_sink=t["n_sink"], n_tail=t["n_tail"],
                             top_k=7, selector=sel, completion=(t["lpq"], t["lpk"], a, b, c))
    assert _rel(out.cpu(), ref) < (2e-5 if dtype == torch.float32 else 8e-3)
