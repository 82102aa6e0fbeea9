"""Triton kernels of one FastMKA decode step (``macattn::route_fused_attention``).

* ``_route_update_fuse``: one program per request row ``b``. Routing MLP over ``q`` (R rows
  of ``w1`` at a time over ``Dq`` blocks), 3-way softmax, gate; then over ``D`` blocks the L2
  state update of slot ``slots[b]`` in place and the fused memory ``f = lam1 x + lam2 L2``
  (fp32 scratch). One program owns one slot's row, so the in-place update has no race.
* ``_project``: ``out[b, n] = f[b] . w[n] + bias[n]``, grid ``(cdiv(B, BLOCK_B), cdiv(N, BLOCK_N))``.

All accumulation is fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_route_update_fuse", "_project"]


@triton.jit
def _route_update_fuse(x_ptr, q_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, mean_ptr, count_ptr, slots_ptr,
                       f_ptr, lam_ptr, D, DQ, R, beta,
                       MODE: tl.constexpr, R_P: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R_P)
    rmask = r < R
    h = tl.zeros([R_P], dtype=tl.float32)
    for d0 in range(0, DQ, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < DQ
        qv = tl.load(q_ptr + b * DQ + dd, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(w1_ptr + r[:, None] * DQ + dd[None, :], mask=rmask[:, None] & dm[None, :], other=0.0)
        h += tl.sum(w.to(tl.float32) * qv[None, :], axis=1)
    h += tl.load(b1_ptr + r, mask=rmask, other=0.0).to(tl.float32)
    h = h / (1.0 + tl.exp(-h))                                   # silu
    h = tl.where(rmask, h, 0.0)
    j = tl.arange(0, 4)
    jm = j < 3
    w2 = tl.load(w2_ptr + j[:, None] * R + r[None, :], mask=jm[:, None] & rmask[None, :], other=0.0)
    logit = tl.sum(w2.to(tl.float32) * h[None, :], axis=1) + tl.load(b2_ptr + j, mask=jm, other=0.0).to(tl.float32)
    logit = tl.where(jm, logit, float("-inf"))
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = p / tl.sum(p, axis=0)
    a = tl.minimum(tl.maximum(tl.load(gate_ptr).to(tl.float32), 0.0), 1.0)
    lam = a * p + tl.where(j == 0, 1.0 - a, 0.0)
    tl.store(lam_ptr + b * 3 + j, lam, mask=jm)
    lam1 = tl.sum(tl.where(j == 0, lam, 0.0), axis=0)
    lam2 = tl.sum(tl.where(j == 1, lam, 0.0), axis=0)

    slot = tl.load(slots_ptr + b)
    c0 = tl.load(count_ptr + slot)
    inv = 1.0 / (c0 + 1).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < D
        xv = tl.load(x_ptr + b * D + dd, mask=dm, other=0.0).to(tl.float32)
        m0 = tl.load(mean_ptr + slot * D + dd, mask=dm, other=0.0)
        if MODE == 0:
            m1 = m0 + (xv - m0) * inv
        else:
            m1 = tl.where(c0 == 0, xv, beta * m0 + (1.0 - beta) * xv)
        tl.store(mean_ptr + slot * D + dd, m1, mask=dm)
        tl.store(f_ptr + b * D + dd, lam1 * xv + lam2 * m1, mask=dm)
    tl.store(count_ptr + slot, c0 + 1)


@triton.jit
def _project(f_ptr, w_ptr, bias_ptr, out_ptr, B, D, N,
             BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program: BLOCK_B rows x BLOCK_N outputs, so each weight tile is read once per BLOCK_B rows
    bb = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bm = bb < B
    nm = n < N
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < D
        fv = tl.load(f_ptr + bb[:, None].to(tl.int64) * D + dd[None, :], mask=bm[:, None] & dm[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * D + dd[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(fv[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    acc += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + bb[:, None].to(tl.int64) * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=bm[:, None] & nm[None, :])
