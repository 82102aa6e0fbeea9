"""The GPU-resident page-selector variant of retrieval-completion (``page_retrieval_completion_triton``:
page bounds + radix select -> whole pages -> the shared split-K exact attention + completion) against
the fp64 reference (``macattn.methods.completion.reference.page_retrieval_completion_step``).

``@pytest.mark.gpu``; ``MACATTN_TRITON_INTERPRET=1`` runs the same tests through Triton's interpreter on
CPU tensors (``test_page_completion_interp.py`` does, in CI). Fresh random inputs per case, every
launcher allocation NaN-poisoned. Rows mix an empty mid, pages straddling the sink / tail edges
(``n_sink``, ``n_tail`` not multiples of the page), generated tokens inside the last prefill page (its
bounds cover them, as the state's do), budgets of 0, below, and at or above the selectable pages (then
the step is exact attention). The selection is compared with the reference's where the ``budget``-th
and next page scores are not within 1e-4 (fp32 vs fp64 scores), and the step with the reference
replaying the kernel's pages.
"""
from __future__ import annotations

import math

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS, INTERPRET, poison_allocations  # noqa: E402  (first: sets the interpreter switch)
from macattn.methods.completion.reference import (build_completion_cache_batched, full_attention_step, mid_pages,  # noqa: E402
                                                  page_bounds, page_retrieval_completion_step, page_upper_bounds,
                                                  partition, select_mid_pages_reference)

pytestmark = GPU_MARKS

# (Hq, Hkv, d, F, T, n_sink, n_tail, page, rows [(n_prefill, seq_len)])
CASES = [
    (4, 2, 16, 8, 96, 4, 8, 8, [(70, 75), (20, 20), (9, 12)]),         # sink / tail inside pages; empty mid
    (8, 1, 32, 16, 130, 0, 16, 16, [(128, 130), (0, 3)]),              # no sink; N = 0
    (6, 3, 16, 12, 200, 8, 3, 8, [(150, 199), (61, 62)]),              # aligned sink, long generated region
]
if not INTERPRET:
    CASES += [
        (32, 8, 128, 64, 8192, 64, 64, 64, [(8000, 8192), (1000, 1010), (130, 140)]),
        (32, 8, 128, 64, 32768, 16, 64, 16, [(32700, 32768)]),
        (28, 4, 128, 64, 5000, 16, 64, 32, [(4990, 5000), (300, 301)]),
    ]
BUDGETS = [0, 1, 3, 4096]
STEP_BUDGETS = BUDGETS
DTYPES = [torch.float32, torch.bfloat16]
if INTERPRET:                 # the interpreter is slow (CI): the selection's edges, one budget for the whole step
    BUDGETS, STEP_BUDGETS, DTYPES = [0, 3, 4096], [3], [torch.bfloat16]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    from macattn.plugins.retrieval_completion import op

    poison_allocations(monkeypatch, op)


def _problem(case, dtype, seed):
    Hq, Hkv, d, F, T, n_sink, n_tail, page, rows = case
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = r(B, Hq, d).to(dtype)
    k = (r(B, Hkv, T, d) * 1.5 + r(B, Hkv, T, 1)).to(dtype)      # per-token offsets: pages differ in their bounds
    v = r(B, Hkv, T, d).to(dtype)
    lpk = r(B, Hkv, T, F) * 0.7 + torch.linspace(-2, 2, F) * torch.linspace(0, 1, T)[:, None]
    lpq = r(B, Hq, F) * 0.7 - 1.0
    npf = torch.tensor([n for n, _ in rows])
    sl = torch.tensor([s for _, s in rows])
    P = -(-T // page)
    lo = torch.full((B, Hkv, P, d), math.inf)
    hi = torch.full((B, Hkv, P, d), -math.inf)
    for i, (_, L) in enumerate(rows):               # the bounds of the cache's tokens [0, L), as the state keeps
        a, b = page_bounds(k[i, :, :L], page, torch.float32)
        lo[i, :, :a.shape[1]], hi[i, :, :b.shape[1]] = a, b
    comp = build_completion_cache_batched(lpk, v, npf, n_sink=n_sink, n_tail=n_tail)
    return dict(q=q, k=k, v=v, sl=sl, npf=npf, lpq=lpq, lpk=lpk, comp=comp, lo=lo, hi=hi, n_sink=n_sink,
                n_tail=n_tail, page=page)


def _stable(t, budget):
    """[B, Hkv] True where the budget-th and next selectable page scores are apart (fp32 ranks as fp64)."""
    B, Hq, _ = t["q"].shape
    Hkv = t["lo"].shape[1]
    first = t["n_sink"] // t["page"]
    out = torch.ones(B, Hkv, dtype=torch.bool)
    for i in range(B):
        n = int(t["npf"][i])
        _, cnt = mid_pages(partition(n, n, n_sink=t["n_sink"], n_tail=t["n_tail"]), t["page"])
        if budget >= cnt or budget == 0:
            continue
        s = page_upper_bounds(t["q"][i].view(Hkv, Hq // Hkv, -1), t["lo"][i, :, first:first + cnt],
                              t["hi"][i, :, first:first + cnt]).amax(1)
        srt = s.sort(-1, descending=True).values
        a, c = srt[:, budget - 1], srt[:, budget]
        out[i] = (a - c).abs() > 1e-4 * a.abs().clamp(min=1e-30)
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}x{c[1]}-T{c[4]}-p{c[7]}" if isinstance(c, tuple) else None)
@pytest.mark.parametrize("budget", BUDGETS)
def test_mid_page_selection_equals_the_reference(case, budget):
    from macattn.plugins.retrieval_completion.op import select_mid_pages

    t = _problem(case, torch.bfloat16, seed=budget + 17)
    got = select_mid_pages(t["q"].to(DEVICE), t["lo"].to(DEVICE), t["hi"].to(DEVICE), t["npf"].to(DEVICE),
                           t["n_sink"], t["n_tail"], t["page"], budget).cpu()
    want = select_mid_pages_reference(t["q"], t["lo"], t["hi"], t["npf"], n_sink=t["n_sink"], n_tail=t["n_tail"],
                                      page_size=t["page"], budget=budget)
    stable = _stable(t, budget)
    assert stable.float().mean() > 0.7
    assert torch.equal(got[stable], want[stable])
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))      # as many pages everywhere


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}x{c[1]}-T{c[4]}-p{c[7]}" if isinstance(c, tuple) else None)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", STEP_BUDGETS)
def test_page_step_matches_the_reference(case, dtype, budget):
    from macattn.plugins.retrieval_completion.op import page_retrieval_completion_triton, select_mid_pages

    t = _problem(case, dtype, seed=budget * 3 + 5)
    dev = {n: (x.to(DEVICE) if torch.is_tensor(x) else x) for n, x in t.items()}
    comp = [x.to(DEVICE) for x in t["comp"]]
    args = (dev["q"], dev["k"], dev["v"], dev["sl"], dev["npf"], dev["lpq"], dev["lpk"], *comp, dev["lo"], dev["hi"],
            t["n_sink"], t["n_tail"], t["page"], budget, 0.0)
    if INTERPRET:
        out = page_retrieval_completion_triton(*args)
    else:
        from macattn.methods.kernels import register_kernels
        assert "macattn::page_retrieval_completion" in register_kernels()
        out = torch.ops.macattn.page_retrieval_completion(*args)
    assert out.dtype == dtype and out.shape == t["q"].shape and not out.isnan().any()
    pages = select_mid_pages(dev["q"], dev["lo"], dev["hi"], dev["npf"], t["n_sink"], t["n_tail"], t["page"],
                             budget).cpu()
    ref = page_retrieval_completion_step(t["q"], t["k"], t["v"], t["sl"], t["npf"], t["lpq"], t["lpk"], *t["comp"],
                                         n_sink=t["n_sink"], n_tail=t["n_tail"], page_size=t["page"],
                                         budget_pages=budget, pages=pages)
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    for i in range(len(case[8])):
        assert _rel(out[i].cpu(), ref[i]) < tol, (i, case[8][i])
    if budget == 4096:          # every selectable page retrieved: exact attention
        full = full_attention_step(t["q"], t["k"], t["v"], t["sl"])
        assert _rel(out.cpu(), full) < tol
    elif budget:               # a real selection: not the full attention (the completion term is live)
        full = full_attention_step(t["q"], t["k"], t["v"], t["sl"])
        live = [i for i, (n, _) in enumerate(case[8])
                if mid_pages(partition(n, n, n_sink=t["n_sink"], n_tail=t["n_tail"]), t["page"])[1] > budget]
        assert all(_rel(out[i].cpu(), full[i]) > tol for i in live)
