"""Page selector kernels (reference: ``macattn.methods.completion.reference.select_pages_reference``).

1. ``_page_scores_kernel``, grid ``(B, Hkv, cdiv(P, BLOCK_P))``: for a block of pages, the largest
   over the KV head's ``G`` query heads of ``Σ_j max(q_j lo_j, q_j hi_j)`` (fp32), ``-inf`` past the
   request's ``n_pages``, into ``scores [B, Hkv, P]``.
2. ``_select_kernel``, grid ``(B, Hkv)``: a radix select instead of a sort: the ``budget``-th largest
   score is found bit by bit on order-preserving integer keys (32 counting passes over the scores),
   then every page above it and the first pages equal to it (lower index first) are written in
   ascending order by a running prefix sum; ``-1`` fills what the valid pages cannot. A row of at most
   ``ONE_BLOCK_MAX`` pages is loaded once and the passes count in registers (``ONE_BLOCK``); a longer
   one is streamed from memory in every pass.

A row's valid pages (``_row_pages``) are ``n_pages[b]``, or with ``MID_PAGE`` (the page size) the pages
overlapping its mid computed from its prefill length, and the indices written are then absolute (``+ first``):
the retrieval-completion op's selection in these two launches and nothing else.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_util import check_cuda_or_interp, next_pow2

__all__ = ["launch_select_pages", "check_select_inputs", "ONE_BLOCK_MAX"]

ONE_BLOCK_MAX = 16384          # pages per row the select kernel holds in registers (16 warps: 32 keys a thread)


@triton.jit
def _row_pages(n_ptr, b, n_sink, n_tail, first, MID_PAGE: tl.constexpr):
    """Valid pages of row ``b``: ``n_ptr[b]`` itself, or (``MID_PAGE`` = the page size) the pages
    overlapping the row's mid ``[s0, m1)`` from ``n_ptr[b]`` = its prefill length, counted from page
    ``first`` (every such page holds mid tokens; 0 for an empty mid: the rule of ``_use_completion`` in
    ``retrieval_completion/kernel.py`` and of the reference's ``mid_pages``)."""
    n = tl.load(n_ptr + b).to(tl.int32)
    if MID_PAGE > 0:
        s0 = tl.minimum(n_sink, n)
        m1 = tl.maximum(s0, n - n_tail)
        n = tl.where(m1 > s0, (m1 + MID_PAGE - 1) // MID_PAGE - first, 0)
    return n


@triton.jit
def _page_scores_kernel(q_ptr, lo_ptr, hi_ptr, n_pages_ptr, scores_ptr,
                        stride_qb, stride_qh, stride_lb, stride_lh, stride_lp, stride_sb, stride_sh,
                        P, n_sink, n_tail, first, G: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr,
                        MID_PAGE: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    dd = tl.arange(0, D)
    n = _row_pages(n_pages_ptr, b, n_sink, n_tail, first, MID_PAGE)
    inb = pp < P
    off = b.to(tl.int64) * stride_lb + kh * stride_lh + pp[:, None].to(tl.int64) * stride_lp + dd[None, :]
    lo = tl.load(lo_ptr + off, mask=inb[:, None], other=0.0).to(tl.float32)
    hi = tl.load(hi_ptr + off, mask=inb[:, None], other=0.0).to(tl.float32)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in range(G):
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (kh * G + g) * stride_qh + dd).to(tl.float32)
        s = tl.sum(tl.maximum(q[None, :] * lo, q[None, :] * hi), axis=1)
        best = tl.maximum(best, s)
    best = tl.where(pp < n, best, float("-inf"))
    tl.store(scores_ptr + b.to(tl.int64) * stride_sb + kh * stride_sh + pp, best, mask=inb)


@triton.jit
def _key(x):
    """fp32 -> int64 in [0, 2^32), ordered as the floats are (-inf lowest)."""
    u = x.to(tl.int32, bitcast=True)
    u = tl.where(u < 0, u ^ 0x7FFFFFFF, u)
    return u.to(tl.int64) + 2147483648


@triton.jit
def _select_kernel(scores_ptr, n_pages_ptr, pages_ptr, stride_sb, stride_sh, stride_pb, stride_ph,
                   P, budget, n_sink, n_tail, first, BLOCK: tl.constexpr, OUT_P: tl.constexpr,
                   ONE_BLOCK: tl.constexpr, MID_PAGE: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    row = scores_ptr + b.to(tl.int64) * stride_sb + kh * stride_sh
    n = tl.minimum(_row_pages(n_pages_ptr, b, n_sink, n_tail, first, MID_PAGE), P)
    want = tl.minimum(budget, n)
    out_row = pages_ptr + b.to(tl.int64) * stride_pb + kh * stride_ph
    if ONE_BLOCK:                                   # the whole row in registers: one load, 32 counts
        pp = tl.arange(0, BLOCK)
        valid = pp < n
        k = tl.where(valid, _key(tl.load(row + pp, mask=valid, other=float("-inf"))), -1)  # keys >= 0: -1 never counts
        t = tl.zeros([], tl.int64)
        for i in range(32):
            cand = t | (tl.full([], 1, tl.int64) << (31 - i))
            t = tl.where(tl.sum((k >= cand).to(tl.int32), axis=0) >= want, cand, t)
        ties_left = want - tl.sum((k > t).to(tl.int32), axis=0)
        tie = k == t
        take = (k > t) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_left))
        tl.store(out_row + tl.cumsum(take.to(tl.int32), axis=0) - 1, pp.to(tl.int64) + first, mask=take)
        written = tl.sum(take.to(tl.int32), axis=0)
    else:
        # the want-th largest key, bit by bit from the top
        t = tl.zeros([], tl.int64)
        for i in range(32):
            cand = t | (tl.full([], 1, tl.int64) << (31 - i))
            cnt = tl.zeros([], tl.int32)
            for p0 in range(0, P, BLOCK):
                pp = p0 + tl.arange(0, BLOCK)
                k = _key(tl.load(row + pp, mask=pp < n, other=float("-inf")))
                cnt += tl.sum(((k >= cand) & (pp < n)).to(tl.int32), axis=0)
            t = tl.where(cnt >= want, cand, t)
        # pages above t, then the first (want - above) pages equal to t, in ascending page order
        above = tl.zeros([], tl.int32)
        for p0 in range(0, P, BLOCK):
            pp = p0 + tl.arange(0, BLOCK)
            k = _key(tl.load(row + pp, mask=pp < n, other=float("-inf")))
            above += tl.sum(((k > t) & (pp < n)).to(tl.int32), axis=0)
        ties_left = want - above
        written = tl.zeros([], tl.int32)
        for p0 in range(0, P, BLOCK):
            pp = p0 + tl.arange(0, BLOCK)
            valid = pp < n
            k = _key(tl.load(row + pp, mask=valid, other=float("-inf")))
            tie = valid & (k == t)
            tie_rank = tl.cumsum(tie.to(tl.int32), axis=0)            # 1-based among this block's ties
            take = valid & ((k > t) | (tie & (tie_rank <= ties_left)))
            ties_left -= tl.sum((tie & (tie_rank <= ties_left)).to(tl.int32), axis=0)
            slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(out_row + slot, pp.to(tl.int64) + first, mask=take)
            written += tl.sum(take.to(tl.int32), axis=0)
    oo = tl.arange(0, OUT_P)
    tl.store(out_row + oo, tl.full([OUT_P], -1, tl.int64), mask=(oo >= written) & (oo < budget))


def check_select_inputs(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_pages: torch.Tensor, budget: int) -> None:
    """Shapes / dtypes (no value checks: they would sync with the host)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, d], got {tuple(q.shape)}")
    B, Hq, d = q.shape
    if lo.dim() != 4 or lo.shape[0] != B or lo.shape[3] != d or Hq % lo.shape[1]:
        raise ValueError(f"lo must be [B={B}, Hkv dividing Hq={Hq}, P, d={d}], got {tuple(lo.shape)}")
    if hi.shape != lo.shape:
        raise ValueError(f"hi must have lo's shape {tuple(lo.shape)}, got {tuple(hi.shape)}")
    if n_pages.shape != (B,) or n_pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"n_pages must be int [B]={B}, got {n_pages.dtype} {tuple(n_pages.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= 4096:
        raise ValueError(f"budget must be an int in [0, 4096], got {budget!r}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim must be a power of two >= 16 for the Triton kernels, got {d}")
    if q.stride(2) != 1 or lo.stride(3) != 1 or hi.stride() != lo.stride():
        raise ValueError("q, lo and hi need a contiguous last dimension (lo and hi the same strides)")
    for name, t in (("q", q), ("lo", lo), ("hi", hi), ("n_pages", n_pages)):
        check_cuda_or_interp(name, t)


def launch_select_pages(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_pages: torch.Tensor, budget: int, *,
                        scores: torch.Tensor, pages: torch.Tensor, block_p: int = 64, block: int = 1024,
                        mid: tuple[int, int, int, int] | None = None) -> None:
    """Both kernels: ``scores [B, Hkv, P]`` fp32 (scratch), ``pages [B, Hkv, budget]`` int64 (out).
    ``mid = (n_sink, n_tail, page_size, first)``: ``n_pages`` holds the rows' prefill lengths, the valid
    pages are those overlapping each row's mid counted from page ``first`` (``lo`` / ``hi`` start there),
    and the page indices written are absolute (``+ first``)."""
    B, Hq, d = q.shape
    Hkv, P = lo.shape[1], lo.shape[2]
    n_sink, n_tail, mid_page, first = mid if mid is not None else (0, 0, 0, 0)
    _page_scores_kernel[(B, Hkv, triton.cdiv(P, block_p))](
        q, lo, hi, n_pages, scores, q.stride(0), q.stride(1), lo.stride(0), lo.stride(1), lo.stride(2),
        scores.stride(0), scores.stride(1), P, n_sink, n_tail, first, G=Hq // Hkv, D=d, BLOCK_P=block_p,
        MID_PAGE=mid_page, num_warps=4)
    one = next_pow2(P) <= ONE_BLOCK_MAX
    blk = next_pow2(P) if one else min(block, next_pow2(P))
    _select_kernel[(B, Hkv)](scores, n_pages, pages, scores.stride(0), scores.stride(1), pages.stride(0),
                             pages.stride(1), P, budget, n_sink, n_tail, first, BLOCK=blk,
                             OUT_P=next_pow2(max(budget, 1)), ONE_BLOCK=one, MID_PAGE=mid_page,
                             num_warps=max(4, min(16, blk // 512)) if one else 4)
