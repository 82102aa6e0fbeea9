"""Triton kernel of ``seed_rows_`` (reference: ``reference.py``).

``_seed_rows``: grid ``(B Hq, cdiv(K, BLOCK_K))``; a program writes ``BLOCK_K`` columns of one head of one
request's ring row — queries and summaries as ``[BLOCK_K, BLOCK_D]`` tiles, their log-sum-exps and (head 0)
their positions — gathering each column's position from ``q_pre`` / ``o`` / ``lse`` through their strides.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_seed_rows"]


@triton.jit
def _seed_rows(q_ptr, o_ptr, lse_ptr, slots_ptr, qring, oring, ring_lse, ring_pos, slot, HQ, K, D, FIRST, SHIFT, SKIP,
               sq_b, sq_h, sq_t, sq_d, so_b, so_h, so_t, so_d, sl_b, sl_h, sl_t,
               sr_s, sr_h, sr_k, sr_d, sor_s, sor_h, sor_k, sor_d, slr_s, slr_h, slr_k, sp_s, sp_k,
               SLOT_PTR: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    # FIRST = L - K: the position of the oldest column's entry (< 0 while L < K); SHIFT = (K - L mod K) mod K;
    # SKIP = K - n: the columns, counted from the oldest, that hold no position
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HQ
    h = bh % HQ
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = c < K
    j = (c + SHIFT) % K                 # column c's age rank among the last K positions (0: oldest)
    t = (FIRST + j).to(tl.int64)        # its position
    i = (j - SKIP).to(tl.int64)         # its index among the summaries' n
    valid = live & (i >= 0)
    if SLOT_PTR:
        s = tl.load(slots_ptr + b)
    else:
        s = tl.full((), 0, tl.int64) + slot      # an int argument of 1 arrives as a constant
    dd = tl.arange(0, BLOCK_D)[None, :]
    dm = dd < D
    take = valid[:, None] & dm
    q = tl.load(q_ptr + b * sq_b + h * sq_h + t[:, None] * sq_t + dd * sq_d, mask=take, other=0.0)
    o = tl.load(o_ptr + b * so_b + h * so_h + i[:, None] * so_t + dd * so_d, mask=take, other=0.0)
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + i * sl_t, mask=valid, other=float("-inf"))
    put = live[:, None] & dm
    col = c.to(tl.int64)
    tl.store(qring + s * sr_s + h * sr_h + col[:, None] * sr_k + dd * sr_d, q.to(qring.dtype.element_ty), mask=put)
    tl.store(oring + s * sor_s + h * sor_h + col[:, None] * sor_k + dd * sor_d, o.to(oring.dtype.element_ty),
             mask=put)
    tl.store(ring_lse + s * slr_s + h * slr_h + col * slr_k, lse.to(ring_lse.dtype.element_ty), mask=live)
    # head 0 writes the positions; the head test made a block, as Triton's interpreter takes no scalar in a mask
    tl.store(ring_pos + s * sp_s + col * sp_k, tl.where(valid, t, -1), mask=live & (col * 0 + h == 0))
