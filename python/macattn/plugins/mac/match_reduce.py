"""Final match decision from the per-split partials (``@triton.jit`` helpers, no kernels).

Used by the match kernel's last program (``match_kernel``), directly
(``reduce_all_heads``) or through the attention plan (``attend_plan``).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["reduce_match_partials", "reduce_all_heads"]


@triton.jit
def reduce_match_partials(part_d2_ptr, part_pos_ptr, part_lse_ptr, bh, hmask, band, thr,
                          NS: tl.constexpr, NS_P: tl.constexpr):
    """Final match for a 2-D block of heads ``bh`` ``[G, J]`` (flat ``b*Hq + h``; ``hmask`` valid).

    Each split left its smallest squared distance and that slot's ``pos`` and cached ``lse``.
    Picks the best split (the first on ties; splits are in slot order, so this is the first
    slot, as ``mac_match_reference``) and applies the threshold and validity test
    (``p - band >= 0``, finite ``lse``). Returns ``(match_pos int64, dist fp32)`` ``[G, J]``
    (-1 = miss; dist inf if no candidate). Partials come from other programs of the same
    launch: read past L1 (``.cg``).
    """
    s = tl.arange(0, NS_P)
    off = bh[:, :, None] * NS + s[None, None, :]
    msk = hmask[:, :, None] & (s < NS)[None, None, :]
    d2 = tl.load(part_d2_ptr + off, mask=msk, other=float("inf"), cache_modifier=".cg")
    pos = tl.load(part_pos_ptr + off, mask=msk, other=-1, cache_modifier=".cg")
    lse = tl.load(part_lse_ptr + off, mask=msk, other=float("-inf"), cache_modifier=".cg")
    best2, bs = tl.min(d2, axis=2, return_indices=True, return_indices_tie_break_left=True)
    sel = s[None, None, :] == bs[:, :, None]
    p = tl.sum(tl.where(sel, pos, 0), axis=2).to(tl.int64)
    lse = tl.sum(tl.where(sel, lse, 0.0), axis=2)
    dist = tl.sqrt_rn(best2)
    finite = (lse > float("-inf")) & (lse < float("inf"))   # NaN fails both
    hit = (dist < thr) & (p - band >= 0) & finite & hmask
    return tl.where(hit, p, -1), dist


@triton.jit
def reduce_all_heads(part_d2_ptr, part_pos_ptr, part_lse_ptr, match_pos_ptr, dist_ptr, stride_mpb, stride_db,
                     BH, Hq, band, thr, NS: tl.constexpr, NS_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """Every head ``[0, BH)`` in blocks of ``BLOCK_H``: write ``match_pos`` and ``dist``."""
    for h0 in range(0, BH, BLOCK_H):
        bh = h0 + tl.arange(0, BLOCK_H)[:, None]                      # [BLOCK_H, 1]
        hm = bh < BH
        b = bh // Hq
        h = bh % Hq
        mp, dist = reduce_match_partials(part_d2_ptr, part_pos_ptr, part_lse_ptr, bh, hm, band, thr, NS, NS_P)
        tl.store(match_pos_ptr + b.to(tl.int64) * stride_mpb + h, mp, mask=hm)
        tl.store(dist_ptr + b.to(tl.int64) * stride_db + h, dist, mask=hm)
