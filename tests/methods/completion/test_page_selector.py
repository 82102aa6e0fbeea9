"""The offloaded decode's page selector reference: page bounds are each page's per-channel min / max (brute
force) and bound every key, the selection equals a brute force over the bounds (max over the KV head's
query heads, ties to the lower page)."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.completion.reference import page_bounds, page_upper_bounds, select_pages_reference


@pytest.mark.parametrize("T,page", [(1, 4), (7, 4), (8, 4), (13, 5), (16, 1)])
def test_page_bounds_equal_brute_force(T, page):
    k = torch.randn(3, T, 6, dtype=torch.float64)
    lo, hi = page_bounds(k, page, torch.float32)
    P = -(-T // page)
    assert lo.shape == hi.shape == (3, P, 6) and lo.dtype == torch.float32
    for p in range(P):
        chunk = k[:, p * page:(p + 1) * page].float()
        assert torch.equal(lo[:, p], chunk.amin(1)) and torch.equal(hi[:, p], chunk.amax(1))


def test_page_upper_bounds_bound_every_key_of_the_page():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 50, 16, generator=g, dtype=torch.float64)
    q = torch.randn(3, 4, 16, generator=g, dtype=torch.float64)
    lo, hi = page_bounds(k, 8)
    ub = page_upper_bounds(q, lo, hi)                                       # [3, 4, P]
    dots = torch.einsum("bhd,btd->bht", q, k)
    for p in range(lo.shape[1]):
        assert (dots[:, :, p * 8:(p + 1) * 8].amax(-1) <= ub[:, :, p] + 1e-12).all()


@pytest.mark.parametrize("budget", [0, 1, 3, 7, 20])
def test_selection_equals_brute_force(budget):
    g = torch.Generator().manual_seed(budget)
    B, Hq, Hkv, P, d = 3, 6, 2, 7, 8
    q = torch.randn(B, Hq, d, generator=g)
    lo = torch.randn(B, Hkv, P, d, generator=g)
    hi = lo + torch.rand(B, Hkv, P, d, generator=g)
    lo[0, 0, 4], hi[0, 0, 4] = lo[0, 0, 1], hi[0, 0, 1]                   # an exact tie: page 1 first
    n_pages = torch.tensor([7, 3, 0])
    got = select_pages_reference(q, lo, hi, n_pages, budget)
    assert got.shape == (B, Hkv, budget) and got.dtype == torch.int64
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hkv):
            score = {p: max(sum(max(float(q[b, h * G + j, c] * lo[b, h, p, c]), float(q[b, h * G + j, c] * hi[b, h, p, c]))
                                for c in range(d)) for j in range(G)) for p in range(int(n_pages[b]))}
            best = sorted(score, key=lambda p: (-round(score[p], 9), p))[:budget]
            assert got[b, h].tolist() == sorted(best) + [-1] * (budget - len(best))
    with pytest.raises(ValueError, match="budget must be an int >= 0"):
        select_pages_reference(q, lo, hi, n_pages, -1)
