"""Device-side work plan of the MAC attention (``@triton.jit`` helpers, no kernels).

``plan_step`` runs in one program: the match kernel's last program (fused step) or the
stand-alone plan kernel (``macattn::mac_attend`` op, given ``match_pos``). Per KV-head group
``g = b*Hkv + kvh`` it takes part A of the union range of the group's heads,
``[lo_g, m - r]`` (``lo_g`` = min over heads of ``p - r + 1`` on a hit, ``0`` on a miss),
picks a chunk ``c`` from the total part-A span so that about ``g_target`` work items result
(one wave; at most ``NMAX`` per group: bounds the merge), evens the items out within each
group, and
writes per group its first item (exclusive prefix sum; entry ``NG`` = total), ``lo_g``,
item count and chunk.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .match_reduce import reduce_match_partials

__all__ = ["plan_step", "NMAX_A", "chunk_for", "size_items"]

NMAX_A = 512          # most part-A items of one group (bounds the merge's loop)


@triton.jit
def chunk_for(w, g_target, MIN_CHUNK: tl.constexpr):
    """Part-A chunk for a total span ``w`` (int64) over about ``g_target`` items: at least ``MIN_CHUNK``."""
    return tl.maximum((w + g_target - 1) // g_target, MIN_CHUNK)


@triton.jit
def size_items(la, c, NMAX: tl.constexpr):
    """Items per group for spans ``la`` (int64, any shape) and chunk ``c``: ``(na, chunk)``.

    Nearest (not ceil) to ``la / c``, at least one for a non-empty span, at most ``NMAX``, so the
    total stays within ``g_target + NG`` and fills about one wave; then equal items within the group."""
    na = tl.minimum(tl.maximum((la + c // 2) // c, (la > 0).to(tl.int64)), NMAX)
    cg = (la + tl.maximum(na, 1) - 1) // tl.maximum(na, 1)
    na = (la + tl.maximum(cg, 1) - 1) // tl.maximum(cg, 1)
    return na, cg


@triton.jit
def plan_step(part_d2_ptr, part_pos_ptr, part_lse_ptr, match_pos_ptr, dist_ptr, positions_ptr,
              grp_start_ptr, grp_lo_ptr, grp_na_ptr, grp_chunk_ptr, stride_mpb, NG, Hkv, band, thr, g_target,
              HPG: tl.constexpr, HPG_P: tl.constexpr, NS: tl.constexpr, NS_P: tl.constexpr, GB: tl.constexpr,
              MIN_CHUNK: tl.constexpr, NMAX: tl.constexpr, FROM_PARTIALS: tl.constexpr):
    """``FROM_PARTIALS``: reduce the match partials and write ``match_pos``/``dist``; else read ``match_pos``.

    Two passes over blocks of ``GB`` groups (registers stay small at any batch): the first
    finds each group's part A and the total span (``la`` parked in ``grp_na``), the second
    sizes the items and writes the prefix sums.
    """
    j = tl.arange(0, HPG_P)
    w = tl.zeros([], dtype=tl.int64)
    for g0 in range(0, NG, GB):
        g = g0 + tl.arange(0, GB)
        gm = g < NG
        hm = gm[:, None] & (j < HPG)[None, :]
        b = g // Hkv
        h = (g % Hkv)[:, None] * HPG + j[None, :]             # query head
        bh = (g * HPG)[:, None] + j[None, :]                  # b * Hq + h
        m = tl.load(positions_ptr + b, mask=gm, other=0).to(tl.int64)
        if FROM_PARTIALS:
            mp, dist = reduce_match_partials(part_d2_ptr, part_pos_ptr, part_lse_ptr, bh, hm, band, thr, NS, NS_P)
            tl.store(match_pos_ptr + b[:, None].to(tl.int64) * stride_mpb + h, mp, mask=hm)
            tl.store(dist_ptr + bh, dist, mask=hm)
        else:
            mp = tl.load(match_pos_ptr + b[:, None].to(tl.int64) * stride_mpb + h, mask=hm, other=-1).to(tl.int64)
        lo_h = tl.where(mp >= 0, mp - band + 1, 0)
        lo_h = tl.where(hm, lo_h, 1 << 62)
        lo_g = tl.min(lo_h, axis=1)
        la = tl.where(gm, tl.maximum(m - band - lo_g + 1, 0), 0)     # part A: [lo_g, m - r]
        tl.store(grp_lo_ptr + g, tl.where(gm, lo_g, 0).to(tl.int32), mask=gm)
        tl.store(grp_na_ptr + g, la.to(tl.int32), mask=gm)
        w += tl.sum(la, axis=0)
    tl.debug_barrier()                     # pass 2 reads what pass 1's threads wrote
    c = chunk_for(w, g_target, MIN_CHUNK)
    carry = tl.zeros([], dtype=tl.int64)
    for g0 in range(0, NG, GB):
        g = g0 + tl.arange(0, GB)
        gm = g < NG
        la = tl.load(grp_na_ptr + g, mask=gm, other=0, cache_modifier=".cg").to(tl.int64)
        na, cg = size_items(la, c, NMAX)
        incl = tl.cumsum(na, axis=0) + carry
        tl.debug_barrier()                 # every thread has read `la` before grp_na is overwritten
        tl.store(grp_start_ptr + g, (incl - na).to(tl.int32), mask=gm)
        tl.store(grp_na_ptr + g, na.to(tl.int32), mask=gm)
        tl.store(grp_chunk_ptr + g, cg.to(tl.int32), mask=gm)
        carry += tl.sum(na, axis=0)
    tl.store(grp_start_ptr + NG, carry.to(tl.int32))
