"""The page selector kernels (``macattn.plugins.page_select``) against ``select_pages_reference``:
GQA groups, budgets below / at / above the valid pages, partial requests (``n_pages < P``), exact ties
(the lower page wins), empty requests, poisoned outputs. GPU; ``MACATTN_TRITON_INTERPRET=1`` runs
them through Triton's interpreter (``test_page_select_interp.py`` does, in CI).

Selections must equal the reference's except for a KV head whose ``budget``-th and next scores lie
within 1e-4 (relative) of each other: fp32 accumulation there may pick the other page.
"""
from __future__ import annotations

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS  # noqa: E402  (first: sets the interpreter switch)
from macattn.methods.completion.reference import page_bounds, page_upper_bounds, select_pages_reference  # noqa: E402

pytestmark = GPU_MARKS


@pytest.fixture(autouse=True, params=["registers", "streamed"])
def select_path(request, monkeypatch):
    """Every test on both paths of ``_select_kernel``: the row held in registers, and streamed per pass
    (``ONE_BLOCK_MAX = 0``; its 1024-page blocks are cut to 8 so that the rows here span several)."""
    from macattn.plugins.page_select import kernel, op

    if request.param == "streamed":
        monkeypatch.setattr(kernel, "ONE_BLOCK_MAX", 0)
        monkeypatch.setattr(op, "launch_select_pages",
                            lambda *a, **kw: kernel.launch_select_pages(*a, **{**kw, "block": 8}))
    return request.param


def _problem(B, Hq, Hkv, T, d, page, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, T, d, generator=g).to(torch.bfloat16)
    lo, hi = page_bounds(k, page, torch.float32)
    q = torch.randn(B, Hq, d, generator=g).to(torch.bfloat16)
    P = lo.shape[2]
    n_pages = torch.randint(max(1, P // 2), P + 1, (B,), generator=g)
    n_pages[0] = P
    return q, lo, hi, n_pages


def _unstable(q, lo, hi, n_pages, budget):
    B, Hq, _ = q.shape
    Hkv, P = lo.shape[1], lo.shape[2]
    s = page_upper_bounds(q.view(B, Hkv, Hq // Hkv, -1), lo, hi).amax(2)
    s = s.masked_fill(torch.arange(P)[None, None] >= n_pages.view(B, 1, 1), float("-inf"))
    srt = s.sort(dim=-1, descending=True).values
    if budget >= P:
        return torch.zeros(B, Hkv, dtype=torch.bool)
    a, c = srt[..., budget - 1], srt[..., budget]
    return torch.isfinite(c) & ((a - c).abs() <= 1e-4 * a.abs().clamp(min=1e-30))


@pytest.mark.parametrize("B,Hq,Hkv,T,d,page", [(1, 4, 1, 200, 64, 16), (3, 8, 2, 1000, 128, 16),
                                               (2, 4, 4, 64, 64, 8), (2, 32, 8, 3000, 64, 32)])
@pytest.mark.parametrize("budget", [1, 5, 16, 200])
def test_page_selector_equals_the_reference(B, Hq, Hkv, T, d, page, budget):
    from macattn.plugins.page_select.op import select_pages

    host = _problem(B, Hq, Hkv, T, d, page, seed=B * 100 + budget)
    q, lo, hi, n_pages = (t.to(DEVICE) for t in host)
    out = torch.full((B, Hkv, budget), -(2 ** 40), dtype=torch.int64, device=DEVICE)
    got = select_pages(q, lo, hi, n_pages, budget, out=out).cpu()
    want = select_pages_reference(*host, budget)
    stable = ~_unstable(*host, budget)
    assert stable.float().mean() > 0.8
    assert torch.equal(got[stable], want[stable])
    assert ((got >= -1) & (got < lo.shape[2])).all()
    n_sel = (got >= 0).sum(-1)
    assert torch.equal(n_sel, torch.minimum(host[3], torch.tensor(budget)).view(B, 1).expand(B, Hkv))


def test_ties_go_to_the_lower_page_and_empty_requests_select_nothing():
    from macattn.plugins.page_select.op import select_pages

    d, P = 16, 12
    lo = torch.zeros(2, 1, P, d)
    hi = torch.zeros(2, 1, P, d)
    hi[:, :, [2, 5, 7, 9]] = 1.0                           # four equal best pages
    q = torch.ones(2, 2, d)
    n_pages = torch.tensor([P, 0])
    got = select_pages(q.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE), n_pages.to(DEVICE), 3).cpu()
    assert got[0, 0].tolist() == [2, 5, 7] and got[1, 0].tolist() == [-1, -1, -1]
    assert torch.equal(got, select_pages_reference(q, lo, hi, n_pages, 3))


def test_the_selector_refuses_bad_inputs():
    from macattn.plugins.page_select.op import select_pages

    q, lo, hi, n = (t.to(DEVICE) for t in _problem(1, 4, 2, 64, 64, 16, 0))
    with pytest.raises(ValueError, match=r"budget must be an int in \[0, 4096\]"):
        select_pages(q, lo, hi, n, -1)
    with pytest.raises(ValueError, match="lo must be"):
        select_pages(q, lo[:, :, :, :32], hi, n, 2)
    with pytest.raises(ValueError, match="n_pages must be int"):
        select_pages(q, lo, hi, n.float(), 2)
