"""Triton kernels of one FastMKA decode step (``macattn::route_fused_attention``), two launches.

v1 (one program per request for the routing MLP, then one ``[8 x 128]``-tile GEMV per projection) ran
every weight read as a chain of ~32 dependent loads in one program: latency-bound, 86 µs at B = 1 where
the bytes (the K/V weights, 16 MiB at 8B shapes) floor at ~5.5 µs (``benchmarks/notes/mka_decode.md``).
Now every input is read once per launch by many programs, in one or a few wide tiles each:

* ``mka_route_partial_update``: grid ``(n_split,)``; program ``s`` owns columns ``[s*SPLIT, (s+1)*SPLIT)``
  of ``q`` and of ``x``. Routing MLP, first layer, split over ``Dq``: ``part[s, b, :] = q[b, cols] .
  w1[:, cols]^T`` for every row ``b`` (fp32 ``[n_split, B, R_P]`` scratch, padded columns 0). Memory
  summary: the L2 rows ``slots[b]`` of ``state_mean`` updated in place on its ``x`` columns (prefix mean
  or EMA, with the count *before* this step; no other program of the launch touches those elements).
* ``mka_fuse_project``: grid ``(cdiv(Nk, BLOCK_N) + cdiv(Nv, BLOCK_N), cdiv(B, BLOCK_B))``. Prologue: the
  routing finished for its rows (``sum_s part`` in a fixed order, so every program gets the same bits;
  silu, ``w2``, softmax over 3, gate) -> ``lam``; the programs of the first output block store ``lam``
  and ``state_count[slot] += 1``. Main loop over ``D``: ``f = lam1 x + lam2 L2`` formed in registers from
  ``x`` and the updated state row (never written to memory), ``out[b, n] = f . w[n] + bias[n]`` on the
  tensor cores (``f`` rounded to the weight dtype, as the model's own ``k_proj(f)`` does; fp32 weights take
  the exact fp32 path, ``DOT_F32``, which keeps the rounding of ``f``). Blocks ``< cdiv(Nk, BLOCK_N)`` project with ``wk`` into ``k``, the rest with ``wv``
  into ``v``: one launch reads both weights once.

All accumulation is fp32. ``DOT_F32`` (fp32 or mixed half operands, or Triton's interpreter, whose
bf16 ``tl.dot`` is wrong: ``triton_util.interpreting``) multiplies in IEEE fp32 (products of halves are
exact in fp32 either way). Programs never wait on one another (no atomics, no grid barrier), so the
kernels run unchanged under Triton's interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mka_route_partial_update", "mka_fuse_project"]


@triton.jit
def mka_route_partial_update(x_ptr, q_ptr, w1_ptr, mean_ptr, count_ptr, slots_ptr, part_ptr, B, D, DQ, R, beta,
                          MODE: tl.constexpr, R_P: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr,
                          DOT_F32: tl.constexpr):
    s = tl.program_id(0)
    cols = s * SPLIT + tl.arange(0, SPLIT)
    r = tl.arange(0, R_P)
    qm = cols < DQ
    w1 = tl.load(w1_ptr + r[:, None].to(tl.int64) * DQ + cols[None, :], mask=(r < R)[:, None] & qm[None, :], other=0.0)
    if DOT_F32:
        w1 = w1.to(tl.float32)
    xm = cols < D
    for b0 in range(0, B, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        bm = rows < B
        # routing MLP, first layer, this program's Dq columns
        qv = tl.load(q_ptr + rows[:, None].to(tl.int64) * DQ + cols[None, :], mask=bm[:, None] & qm[None, :], other=0.0)
        if DOT_F32:
            h = tl.dot(qv.to(tl.float32), tl.trans(w1), input_precision="ieee")
        else:
            h = tl.dot(qv.to(w1.dtype), tl.trans(w1))
        tl.store(part_ptr + (s * B + rows[:, None]).to(tl.int64) * R_P + r[None, :], h, mask=bm[:, None])
        # memory summary (L2) of these rows, this program's D columns, in place
        slot = tl.load(slots_ptr + rows, mask=bm, other=0)
        c0 = tl.load(count_ptr + slot, mask=bm, other=0)
        m = bm[:, None] & xm[None, :]
        xv = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        at = mean_ptr + slot[:, None] * D + cols[None, :]
        m0 = tl.load(at, mask=m, other=0.0)
        if MODE == 0:
            m1 = m0 + (xv - m0) * (1.0 / (c0 + 1).to(tl.float32))[:, None]
        else:
            m1 = tl.where((c0 == 0)[:, None], xv, beta * m0 + (1.0 - beta) * xv)
        tl.store(at, m1, mask=m)


@triton.jit
def mka_project_block(x_ptr, mean_ptr, slot, rows, bm, lam1, lam2, w_ptr, bias_ptr, out_ptr, n0, N, D,
                   BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr):
    """``out[rows, n0:n0+BLOCK_N] = (lam1 x + lam2 L2)[rows] . w[n]^T + bias[n]`` (fp32 accumulation)."""
    n = n0 + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < D
        m = bm[:, None] & dm[None, :]
        xv = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + dd[None, :], mask=m, other=0.0).to(tl.float32)
        mv = tl.load(mean_ptr + slot[:, None] * D + dd[None, :], mask=m, other=0.0)
        f = lam1[:, None] * xv + lam2[:, None] * mv
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * D + dd[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(f.to(w.dtype).to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(f.to(w.dtype), tl.trans(w))
    acc += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=bm[:, None] & nm[None, :])


@triton.jit
def mka_fuse_project(x_ptr, mean_ptr, count_ptr, slots_ptr, part_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr,
                  wk_ptr, bk_ptr, wv_ptr, bv_ptr, k_ptr, v_ptr, lam_ptr, B, D, R, NK, NV, NSPLIT,
                  R_P: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr):
    pn = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    bm = rows < B
    slot = tl.load(slots_ptr + rows, mask=bm, other=0)
    # routing, finished for these rows: h = sum_s part[s] (fixed order), silu, w2, softmax, gate
    r = tl.arange(0, R_P)
    rm = r < R
    h = tl.zeros([BLOCK_B, R_P], dtype=tl.float32)
    for s0 in range(0, NSPLIT, S_BLOCK):
        ss = s0 + tl.arange(0, S_BLOCK)
        at = part_ptr + ((ss[:, None, None] * B + rows[None, :, None]).to(tl.int64) * R_P + r[None, None, :])
        h += tl.sum(tl.load(at, mask=(ss < NSPLIT)[:, None, None] & bm[None, :, None], other=0.0), axis=0)
    h += tl.load(b1_ptr + r, mask=rm, other=0.0).to(tl.float32)[None, :]
    h = h / (1.0 + tl.exp(-h))                                   # silu
    h = tl.where(rm[None, :], h, 0.0)
    j = tl.arange(0, 4)
    jm = j < 3
    w2 = tl.load(w2_ptr + j[:, None] * R + r[None, :], mask=jm[:, None] & rm[None, :], other=0.0).to(tl.float32)
    logit = tl.sum(h[:, None, :] * w2[None, :, :], axis=2)
    logit += tl.load(b2_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    logit = tl.where(jm[None, :], logit, float("-inf"))
    p = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    a = tl.minimum(tl.maximum(tl.load(gate_ptr).to(tl.float32), 0.0), 1.0)
    lam = a * p + tl.where(j == 0, 1.0 - a, 0.0)[None, :]
    lam1 = tl.sum(tl.where(j[None, :] == 0, lam, 0.0), axis=1)
    lam2 = tl.sum(tl.where(j[None, :] == 1, lam, 0.0), axis=1)
    first = bm & ((tl.zeros([BLOCK_B], dtype=tl.int32) + pn) == 0)    # the rows' programs of the first block
    tl.store(lam_ptr + rows[:, None].to(tl.int64) * 3 + j[None, :], lam, mask=first[:, None] & jm[None, :])
    c0 = tl.load(count_ptr + slot, mask=first, other=0)
    tl.store(count_ptr + slot, c0 + 1, mask=first)
    # fused K/V: blocks of wk first, then of wv
    nkb = tl.cdiv(NK, BLOCK_N)
    if pn < nkb:
        mka_project_block(x_ptr, mean_ptr, slot, rows, bm, lam1, lam2, wk_ptr, bk_ptr, k_ptr, pn * BLOCK_N, NK, D,
                       BLOCK_B, BLOCK_N, BLOCK_D, DOT_F32)
    else:
        mka_project_block(x_ptr, mean_ptr, slot, rows, bm, lam1, lam2, wv_ptr, bv_ptr, v_ptr, (pn - nkb) * BLOCK_N, NV,
                       D, BLOCK_B, BLOCK_N, BLOCK_D, DOT_F32)
