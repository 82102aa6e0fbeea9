"""MAC's two-stage match in Triton (``MacConfig(match="two_stage")``; reference:
``macattn.methods.mac.reference.mac_match_two_stage_reference``).

Inputs beyond the exact match's: the query's sketch ``q_sketch [B, Hq, DS]`` fp32 and the sketch
ring ``sring [S, Hq, K, DS]`` (E4M3 or bf16) that holds ``sketch(entry)`` of every ring entry
(``macattn.methods.mac.match_sketch``). Two kernels:

1. ``_candidates_kernel``, grid ``(B, Hq, NS)``: program ``(b, h, s)`` scans sketch slots
   ``[s*KS, (s+1)*KS)`` and keeps the ``C`` valid slots nearest to ``q_sketch`` (ties: the lower
   slot), then reads those ``C`` entries of the bf16 ring for their exact squared distances. It
   writes ``(approx d2, exact d2, slot)`` of each to ``part_a / part_e / part_k [B, Hq, NS, C]``.
   The ring is streamed at ``DS`` E4M3 / bf16 elements per entry instead of ``d`` bf16.
2. ``_select_kernel``, grid ``(B, Hq)``: the global ``C`` nearest by approximate distance among
   the ``NS * C`` partials (ties: the lower slot; the global set is inside their union), the
   nearest of those by exact distance (ties: the lower slot), then the exact match's threshold
   and validity test -> ``match_pos [B, Hq]`` int64, ``dist [B, Hq]`` fp32.

Exact distances: ``q_pre`` rounded to the ring dtype, fp32 differences and squares, as the
exact match kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_util import check_cuda_or_interp, next_pow2
from .kernel import check_match_inputs, match_meta

__all__ = ["TwoStageMeta", "two_stage_meta", "launch_two_stage_match", "check_two_stage_inputs"]

_BIG = tl.constexpr(1 << 30)


@triton.jit
def _candidates_kernel(
    q_pre_ptr, qs_ptr, qring_ptr, sring_ptr, ring_pos_ptr, slots_ptr, positions_ptr,
    part_a_ptr, part_e_ptr, part_k_ptr,
    stride_qb, stride_qh, stride_sb, stride_sh,
    stride_rs, stride_rh, stride_rk, stride_xs, stride_xh, stride_xk, stride_ps,
    Hq, K,
    NS: tl.constexpr, KS: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, DS: tl.constexpr,
    C: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    m = tl.load(positions_ptr + b).to(tl.int64)
    ds = tl.arange(0, DS)
    qs = tl.load(qs_ptr + b.to(tl.int64) * stride_sb + h * stride_sh + ds)
    srow = sring_ptr + slot * stride_xs + h.to(tl.int64) * stride_xh
    cc = tl.arange(0, C)
    cand_a = tl.full([C], float("inf"), tl.float32)
    cand_k = -1 - cc                                     # distinct placeholders, all "worse" than a slot
    for i in range(KS // BLOCK_K):
        kk = s * KS + i * BLOCK_K + tl.arange(0, BLOCK_K)
        inb = kk < K
        pos = tl.load(ring_pos_ptr + slot * stride_ps + kk, mask=inb, other=-1).to(tl.int64)
        valid = inb & (pos >= 0) & (pos < m) & (pos >= m - K)
        x = tl.load(srow + kk[:, None].to(tl.int64) * stride_xk + ds[None, :], mask=inb[:, None], other=0.0)
        diff = qs[None, :] - x.to(tl.float32)
        a = tl.where(valid, tl.sum(diff * diff, axis=1), float("inf"))
        # the block's C smallest, in order (ties: the lower slot), each replacing the current worst
        # candidate if strictly nearer: earlier blocks hold lower slots, so they win ties
        for _ in tl.static_range(C):
            amin, ai = tl.min(a, axis=0, return_indices=True, return_indices_tie_break_left=True)
            worst = tl.max(cand_a, axis=0)
            worst_k = tl.max(tl.where(cand_a == worst, cand_k, -_BIG), axis=0)
            at = tl.argmax(tl.where((cand_a == worst) & (cand_k == worst_k), 1, 0), axis=0)
            put = (cc == at) & (tl.zeros([C], tl.float32) + amin < worst)
            cand_a = tl.where(put, amin, cand_a)
            cand_k = tl.where(put, s * KS + i * BLOCK_K + ai, cand_k)
            a = tl.where(tl.arange(0, BLOCK_K) == ai, float("inf"), a)
    # exact stage: the candidates' bf16 entries
    dd = tl.arange(0, D)
    q = tl.load(q_pre_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + dd)
    q = q.to(qring_ptr.dtype.element_ty).to(tl.float32)
    ok = cand_a < float("inf")
    row = qring_ptr + slot * stride_rs + h.to(tl.int64) * stride_rh
    r = tl.load(row + tl.where(ok, cand_k, 0)[:, None].to(tl.int64) * stride_rk + dd[None, :], mask=ok[:, None],
                other=0.0)
    diff = q[None, :] - r.to(tl.float32)
    e = tl.where(ok, tl.sum(diff * diff, axis=1), float("inf"))
    out = ((b * Hq + h) * NS + s) * C + cc
    tl.store(part_a_ptr + out, cand_a)
    tl.store(part_e_ptr + out, e)
    tl.store(part_k_ptr + out, cand_k)


@triton.jit
def _select_kernel(
    part_a_ptr, part_e_ptr, part_k_ptr, ring_pos_ptr, ring_lse_ptr, slots_ptr, match_pos_ptr, dist_ptr,
    stride_ps, stride_ls, stride_lh, stride_mpb, stride_db,
    Hq, K, band, thr,
    NSC: tl.constexpr, NSC_P: tl.constexpr, C: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, NSC_P)
    off = (b * Hq + h) * NSC + j
    inb = j < NSC
    a = tl.load(part_a_ptr + off, mask=inb, other=float("inf"))
    e = tl.load(part_e_ptr + off, mask=inb, other=float("inf"))
    slot_k = tl.load(part_k_ptr + off, mask=inb, other=_BIG)
    k = tl.where(a < float("inf"), slot_k, _BIG)         # placeholders sort last among equals
    chosen = j < 0
    for _ in tl.static_range(C):                          # the C nearest by (approx d2, slot)
        amin = tl.min(a, axis=0)
        kmin = tl.min(tl.where(a == amin, k, _BIG), axis=0)
        pick = (a == amin) & (k == kmin) & ~chosen
        chosen = chosen | pick
        a = tl.where(pick, float("inf"), a)
        k = tl.where(pick, _BIG + 1, k)
    e = tl.where(chosen, e, float("inf"))
    best2 = tl.min(e, axis=0)
    best_k = tl.min(tl.where(chosen & (e == best2), slot_k, _BIG), axis=0)
    best_k = tl.minimum(tl.maximum(best_k, 0), K - 1)     # no valid candidate: any slot, dist is inf
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(ring_pos_ptr + slot * stride_ps + best_k).to(tl.int64)
    lse = tl.load(ring_lse_ptr + slot * stride_ls + h.to(tl.int64) * stride_lh + best_k)
    dist = tl.sqrt_rn(best2)
    finite = (lse > float("-inf")) & (lse < float("inf"))
    hit = (dist < thr) & (p - band >= 0) & finite
    tl.store(match_pos_ptr + b.to(tl.int64) * stride_mpb + h, tl.where(hit, p, -1))
    tl.store(dist_ptr + b.to(tl.int64) * stride_db + h, dist)


class TwoStageMeta:
    """Launch parameters: ring splits ``NS`` of ``KS`` slots scanned ``BLOCK_K`` at a time, ``C``
    candidates per split and in the final set (``MacConfig.match_candidates``, a power of two)."""

    def __init__(self, NS: int, KS: int, BLOCK_K: int, C: int, num_warps: int = 4) -> None:
        self.NS, self.KS, self.BLOCK_K, self.C, self.num_warps = NS, KS, BLOCK_K, C, num_warps

    def __repr__(self) -> str:
        return f"TwoStageMeta(NS={self.NS}, KS={self.KS}, BLOCK_K={self.BLOCK_K}, C={self.C})"


def two_stage_meta(batch: int, num_heads: int, window: int, head_dim: int, candidates: int, sms: int) -> TwoStageMeta:
    """The exact match's split of the ring (``match_meta``) with ``C = candidates`` (a power of two)."""
    if candidates & (candidates - 1):
        raise ValueError(f"the Triton two-stage match takes a power-of-two candidates count, got {candidates}")
    mm = match_meta(batch, num_heads, window, head_dim, sms)
    return TwoStageMeta(NS=mm.NS, KS=mm.KS, BLOCK_K=mm.BLOCK_K, C=candidates, num_warps=mm.num_warps)


def check_two_stage_inputs(q_pre, q_sketch, qring, sring, ring_lse, ring_pos, slots, positions) -> None:
    """Shape/dtype checks (no value checks: they would sync with the host)."""
    check_match_inputs(q_pre, qring, ring_lse, ring_pos, slots, positions)
    B, Hq, _ = q_pre.shape
    S, _, K, _ = qring.shape
    if q_sketch.dim() != 3 or q_sketch.shape[:2] != (B, Hq) or q_sketch.dtype != torch.float32:
        raise ValueError(f"q_sketch must be fp32 [B={B}, Hq={Hq}, DS], got {q_sketch.dtype} {tuple(q_sketch.shape)}")
    DS = q_sketch.shape[2]
    if sring.shape != (S, Hq, K, DS) or sring.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"sring must be E4M3 or bf16 [S, Hq, K, DS] = {(S, Hq, K, DS)}, got {sring.dtype} "
                         f"{tuple(sring.shape)}")
    if DS & (DS - 1) or DS < 16:
        raise ValueError(f"sketch dims must be a power of two >= 16 for the Triton kernels, got {DS}")
    if q_sketch.stride(2) != 1 or sring.stride(3) != 1:
        raise ValueError("q_sketch and sring need a contiguous last dimension")
    for name, t in (("q_sketch", q_sketch), ("sring", sring)):
        check_cuda_or_interp(name, t)


def launch_two_stage_match(q_pre: torch.Tensor, q_sketch: torch.Tensor, qring: torch.Tensor, sring: torch.Tensor,
                           ring_pos: torch.Tensor, ring_lse: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, *, meta: TwoStageMeta, part_a: torch.Tensor,
                           part_e: torch.Tensor, part_k: torch.Tensor, match_pos: torch.Tensor, dist: torch.Tensor,
                           band: int, thr: float) -> None:
    """Both kernels. Scratch ``[B * Hq * NS * C]``: ``part_a`` / ``part_e`` fp32, ``part_k`` int32.
    Writes ``match_pos [B, Hq]`` int64 and ``dist [B, Hq]`` fp32."""
    B, Hq, d = q_pre.shape
    K, DS = qring.shape[2], sring.shape[3]
    _candidates_kernel[(B, Hq, meta.NS)](
        q_pre, q_sketch, qring, sring, ring_pos, slots, positions, part_a, part_e, part_k,
        q_pre.stride(0), q_pre.stride(1), q_sketch.stride(0), q_sketch.stride(1),
        qring.stride(0), qring.stride(1), qring.stride(2), sring.stride(0), sring.stride(1), sring.stride(2),
        ring_pos.stride(0), Hq, K,
        NS=meta.NS, KS=meta.KS, BLOCK_K=meta.BLOCK_K, D=d, DS=DS, C=meta.C, num_warps=meta.num_warps)
    nsc = meta.NS * meta.C
    _select_kernel[(B, Hq)](
        part_a, part_e, part_k, ring_pos, ring_lse, slots, match_pos, dist,
        ring_pos.stride(0), ring_lse.stride(0), ring_lse.stride(1), match_pos.stride(0), dist.stride(0),
        Hq, K, band, thr, NSC=nsc, NSC_P=next_pow2(nsc), C=meta.C, num_warps=1)
