"""MAC match as one scratch-free kernel: the ahead-of-time image of the ``mac::match`` plugin.

TensorRT's ahead-of-time plugin interface launches exactly one kernel with the plugin's
tensors and int32 scalars as its parameters (no workspace), and Triton's AOT C tool needs a
file it can execute on its own. So this file imports only ``triton`` and holds the match as
one program per ``(request, query head)`` scanning the whole window; the JIT path
(``match_kernel.py``) splits the ring over several programs instead, which a batch of 1 needs to
fill the GPU.

Parameter order is the plugin's: inputs, int32 scalars, outputs, then constexprs::

    q_pre [B, Hq, d], qring [S, Hq, K, d], ring_lse [S, Hq, K] fp32, ring_pos [S, K] int64,
    slots [B] int64, positions [B] int64, B, match_pos [B, Hq] int64, dist [B, Hq] fp32

All tensors contiguous. Grid ``(B, Hq, 1)``. Semantics: ``macattn.methods.mac.reference.mac_match_reference``.
"""
import triton
import triton.language as tl


@triton.jit
def mac_match_onepass(
    q_pre_ptr, qring_ptr, ring_lse_ptr, ring_pos_ptr, slots_ptr, positions_ptr,
    B,
    match_pos_ptr, dist_ptr,
    HQ: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr, THR: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if b >= B:          # the grid is at least 1 wide (TensorRT refuses an empty one): B == 0 does nothing
        return
    slot = tl.load(slots_ptr + b).to(tl.int64)
    m = tl.load(positions_ptr + b).to(tl.int64)
    dd = tl.arange(0, D)
    # the reference rounds q_pre to the ring's dtype before the fp32 difference
    q = tl.load(q_pre_ptr + (b * HQ + h) * D + dd).to(qring_ptr.dtype.element_ty).to(tl.float32)
    row = qring_ptr + (slot * HQ + h) * K * D
    best = tl.full([], float("inf"), tl.float32)
    best_k = tl.full([], 0, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        inb = kk < K
        pos = tl.load(ring_pos_ptr + slot * K + kk, mask=inb, other=-1).to(tl.int64)
        cand = inb & (pos >= 0) & (pos < m) & (pos >= m - K)
        r = tl.load(row + kk[:, None].to(tl.int64) * D + dd[None, :], mask=inb[:, None], other=0.0)
        diff = q[None, :] - r.to(tl.float32)
        d2 = tl.where(cand, tl.sum(diff * diff, axis=1), float("inf"))
        blk, blk_i = tl.min(d2, axis=0, return_indices=True, return_indices_tie_break_left=True)
        upd = blk < best                       # strict: the first slot wins ties
        best = tl.where(upd, blk, best)
        best_k = tl.where(upd, k0 + blk_i, best_k)
    p = tl.load(ring_pos_ptr + slot * K + best_k).to(tl.int64)
    lse = tl.load(ring_lse_ptr + (slot * HQ + h) * K + best_k)
    dist = tl.sqrt_rn(best)
    finite = (lse > float("-inf")) & (lse < float("inf"))
    hit = (dist < THR) & (p - BAND >= 0) & finite
    tl.store(match_pos_ptr + b * HQ + h, tl.where(hit, p, -1))
    tl.store(dist_ptr + b * HQ + h, dist)
