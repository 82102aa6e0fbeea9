"""Triton kernels of the decode step's elementwise chain (references: ``reference.py``).

Every intermediate is rounded to the activations' dtype where transformers rounds it, so the
results equal the references up to the last bit of the fp32 reductions.

* ``_add_rms_norm``: one program per row (a decode step has one row per request).
* ``_silu_mul``: grid ``(rows, cdiv(I, BLOCK))``.
* ``_rope_append``: grid ``(cdiv(B (Hq + 2 Hkv), ROWS),)`` over the token-major (token, head) pairs; a
  program takes ``ROWS`` consecutive pairs as a ``[ROWS, d / 2]`` tile per half and, row by row, rotates a
  query head into ``q_out``, rotates a key head into its pool row, or copies a value head there.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_add_rms_norm", "_silu_mul", "_rope_append"]


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, stride_x, stride_res, eps,
                  HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_RES:
        r = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * D + offs, r, mask=mask)
    else:
        r = x
    h = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * (h * inv).to(dt).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + offs, y, mask=mask)


@triton.jit
def _silu_mul(gu_ptr, out_ptr, I, stride_gu, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0.0)
    dt = g.dtype
    g32 = g.to(tl.float32)
    s = (g32 / (1.0 + tl.exp(-g32))).to(dt)
    tl.store(out_ptr + row * I + offs, (s.to(tl.float32) * u.to(tl.float32)).to(dt), mask=mask)


@triton.jit
def _rope_append(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_pool, v_pool, rows_ptr, N, stride_qkv, HQ, HKV,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    # rows p ROWS .. p ROWS + ROWS - 1 of the N = B (Hq + 2 Hkv) token-major (token, head) pairs: a tile may
    # span tokens and mix query, key and value heads, so each row picks its destination by a mask
    H = HQ + 2 * HKV
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < N
    b = r // H
    h = r % H
    is_q = live & (h < HQ)
    is_k = live & (h >= HQ) & (h < HQ + HKV)
    is_v = live & (h >= HQ + HKV)
    offs = tl.arange(0, BLOCK_H)[None, :]
    cols = offs < HALF
    src = (qkv_ptr + b * stride_qkv + h * (2 * HALF))[:, None]
    x1 = tl.load(src + offs, mask=live[:, None] & cols, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=live[:, None] & cols, other=0.0)
    dt = x1.dtype
    rot = ((is_q | is_k)[:, None]) & cols
    cs = (cos_ptr + b * (2 * HALF))[:, None]
    sn = (sin_ptr + b * (2 * HALF))[:, None]
    c1 = tl.load(cs + offs, mask=rot, other=0.0).to(tl.float32)
    c2 = tl.load(cs + HALF + offs, mask=rot, other=0.0).to(tl.float32)
    s1 = tl.load(sn + offs, mask=rot, other=0.0).to(tl.float32)
    s2 = tl.load(sn + HALF + offs, mask=rot, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded like transformers'
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    # query heads -> q_out; key heads (rotated) and value heads (as loaded) -> their pool rows
    m = is_q[:, None] & cols
    dst = (q_ptr + (b * HQ + h) * (2 * HALF))[:, None]
    tl.store(dst + offs, o1.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + offs, o2.to(q_ptr.dtype.element_ty), mask=m)
    row = tl.load(rows_ptr + b, mask=is_k | is_v, other=0)
    m = is_k[:, None] & cols
    dst = (k_pool + (row * HKV + (h - HQ)) * (2 * HALF))[:, None]
    tl.store(dst + offs, o1.to(k_pool.dtype.element_ty), mask=m)
    tl.store(dst + HALF + offs, o2.to(k_pool.dtype.element_ty), mask=m)
    m = is_v[:, None] & cols
    dst = (v_pool + (row * HKV + (h - HQ - HKV)) * (2 * HALF))[:, None]
    tl.store(dst + offs, x1.to(v_pool.dtype.element_ty), mask=m)
    tl.store(dst + HALF + offs, x2.to(v_pool.dtype.element_ty), mask=m)
