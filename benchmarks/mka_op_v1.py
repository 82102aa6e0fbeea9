"""The FastMKA op as it was before issue 38 (v1: three launches), kept only so that
``bench_mka_decode.py --profile`` measures v1 and the current op (``macattn.plugins.route_fused``) in one
run on one device. Not used by the package; delete once the issue's numbers are in the notes.

* ``route_update_fuse_v1``: one program per request row: routing MLP over all of ``Dq`` (``R`` rows of
  ``w1`` per step, ~32 dependent loads at 8B shapes), the summary update, ``f`` fp32 written to scratch.
* ``project_v1``: ``out[b, n] = f[b] . w[n] + bias[n]``, ``[8 x 128]`` tiles, one launch for k, one for v.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["RouteFusedV1"]

@triton.jit
def route_update_fuse_v1(x_ptr, q_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, gate_ptr, mean_ptr, count_ptr, slots_ptr,
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
def project_v1(f_ptr, w_ptr, bias_ptr, out_ptr, B, D, N,
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


class RouteFusedV1:
    """One call of the v1 op (same inputs and outputs as ``route_fused_attention_triton``, no checks):
    ``route()`` (launch 1) then ``project()`` (launches 2 and 3)."""

    def __init__(self, x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta):
        B, D = x.shape
        dev = x.device
        self.args = (x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots)
        self.B, self.D, self.Dq, self.R, self.mode, self.beta = B, D, q.shape[1], w1.shape[0], int(mode), float(beta)
        self.k = torch.empty(B, wk.shape[0], dtype=x.dtype, device=dev)
        self.v = torch.empty(B, wv.shape[0], dtype=x.dtype, device=dev)
        self.lam = torch.empty(B, 3, dtype=torch.float32, device=dev)
        self.f = torch.empty(B, D, dtype=torch.float32, device=dev)
        self.proj = ((wk, bk, self.k), (wv, bv, self.v))

    def route(self) -> None:
        r_p = max(triton.next_power_of_2(self.R), 2)
        block_d = max(16, min(triton.next_power_of_2(max(self.D, self.Dq)), max(16, 8192 // r_p), 256))
        route_update_fuse_v1[(self.B,)](*self.args, self.f, self.lam, self.D, self.Dq, self.R, self.beta,
                                        MODE=self.mode, R_P=r_p, BLOCK_D=block_d)

    def project(self) -> None:
        block_b = min(triton.next_power_of_2(self.B), 8)
        for w, bias, dst in self.proj:
            N = w.shape[0]
            project_v1[(triton.cdiv(self.B, block_b), triton.cdiv(N, 8))](self.f, w, bias, dst, self.B, self.D, N,
                                                                        BLOCK_B=block_b, BLOCK_N=8, BLOCK_D=128)

    def run(self):
        self.route()
        self.project()
        return self.k, self.v, self.lam
