"""The page selector's launcher (``kernel.py``) with the reference's contract."""
from __future__ import annotations

import torch

from .kernel import check_select_inputs, launch_select_pages

__all__ = ["select_pages"]


def select_pages(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_pages: torch.Tensor, budget: int,
                 *, out: torch.Tensor | None = None, mid: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``macattn.methods.completion.reference.select_pages_reference`` on the GPU: ``q [B, Hq, d]``,
    ``lo / hi [B, Hkv, P, d]``, ``n_pages [B]``, ``budget`` -> ``[B, Hkv, budget]`` int64 (ascending
    page indices, ``-1`` past the valid pages). No host synchronisation (CUDA-graph capturable).
    ``mid``: see ``launch_select_pages`` (``n_pages`` then holds prefill lengths)."""
    check_select_inputs(q, lo, hi, n_pages, budget)
    B, Hkv, P = lo.shape[0], lo.shape[1], lo.shape[2]
    pages = out if out is not None else torch.empty(B, Hkv, budget, dtype=torch.int64, device=q.device)
    if pages.shape != (B, Hkv, budget) or pages.dtype != torch.int64 or not pages.is_contiguous():
        raise ValueError(f"out must be contiguous int64 [B, Hkv, budget] = {(B, Hkv, budget)}, got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    if B == 0 or budget == 0:
        return pages
    if P == 0:
        return pages.fill_(-1)
    scores = torch.empty(B, Hkv, P, dtype=torch.float32, device=q.device)
    launch_select_pages(q, lo, hi, n_pages, budget, scores=scores, pages=pages, mid=mid)
    return pages
