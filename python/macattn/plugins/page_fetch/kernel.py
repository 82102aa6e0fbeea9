"""``_gather_pages``, grid ``(S·Hkv, K)``: for miss ``j`` of ``(slot, KV head)`` copy page ``pages[j]`` of the
host tiers (``[S, Hkv, P, page, W]`` of one layer: keys / values / log φ_k rows, any strides) into row block
``slots[j]`` of the device cache (``[S, Hkv, C·page, W]``); nothing for hits and unselected entries
(``miss[j] == 0``). The host tensors are pinned CPU memory read by the SMs over the interconnect (unified
virtual addressing: a pinned allocation's host address is valid on the device), so the gather is one
launch whatever the number of pages, and capturable in a CUDA graph."""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_gather_pages"]


@triton.jit
def _gather_pages(src_ptr, dst_ptr, pages_ptr, slots_ptr, miss_ptr, HKV, K,
                  s_sb, s_sh, s_sp, s_st, s_db, s_dh, s_dt, W,
                  PAGE: tl.constexpr, W_P: tl.constexpr, BLOCK_T: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    e = bh * K + j
    if tl.load(miss_ptr + e) != 0:
        page = tl.load(pages_ptr + e).to(tl.int64)
        slot = tl.load(slots_ptr + e).to(tl.int64)
        ww = tl.arange(0, W_P)
        wm = ww < W
        src = src_ptr + b * s_sb + h * s_sh + page * s_sp
        dst = dst_ptr + b * s_db + h * s_dh + slot * PAGE * s_dt
        for t0 in range(0, PAGE, BLOCK_T):
            tt = t0 + tl.arange(0, BLOCK_T)
            m = (tt[:, None] < PAGE) & wm[None, :]
            x = tl.load(src + tt[:, None].to(tl.int64) * s_st + ww[None, :], mask=m)
            tl.store(dst + tt[:, None].to(tl.int64) * s_dt + ww[None, :], x, mask=m)
