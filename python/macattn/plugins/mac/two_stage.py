"""MAC's two-stage match in Triton (``MacConfig(match="two_stage")``; reference:
``macattn.methods.mac.reference.mac_match_two_stage_reference``).

Inputs beyond the exact match's: the sketch ring ``sring [S, Hq, K, DS]`` (E4M3 or bf16) that
holds ``sketch(entry)`` of every ring entry (``macattn.methods.mac.match_sketch``) and, for the
projected sketches, the fixed projection ``proj [d, DS]`` fp32. The query's sketch is computed in
the first kernel (projection summed in its own fp32 order, so an element may differ from torch's
``sketch`` by one rounding step of the sketch dtype; the rounding itself is torch's, ``_round_rne``)
and written to ``q_sketch [B, Hq, DS]``. Two kernels:

1. ``_candidates_kernel``, grid ``(B, Hq, NS)``: program ``(b, h, s)`` scans sketch slots
   ``[s*KS, (s+1)*KS)`` and keeps the ``C`` valid slots nearest to ``q_sketch`` (ties: the lower
   slot), then reads those ``C`` entries of the bf16 ring for their exact squared distances. It
   writes ``(approx d2, exact d2, slot)`` of each to ``part_a / part_e / part_k [B, Hq, NS, C]``.
   The ring is streamed at ``DS`` E4M3 / bf16 elements per entry instead of ``d`` bf16.
2. ``_select_kernel``, grid ``(B, Hq)``: the global ``C`` nearest by approximate distance among
   the ``NS * C`` partials (ties: the lower slot; the global set is inside their union), the
   nearest of those by exact distance (ties: the lower slot), then the exact match's threshold
   and validity test -> ``match_pos [B, Hq]`` int64, ``dist [B, Hq]`` fp32. In a decode step it
   also appends the query's sketch to the sketch ring (``append``), beside the entry the merge
   writes to ``qring``.

Exact distances: ``q_pre`` rounded to the ring dtype, fp32 differences and squares, as the
exact match kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_util import check_cuda_or_interp, next_pow2
from .match_kernel import check_match_inputs, match_meta

__all__ = ["TwoStageMeta", "two_stage_meta", "launch_two_stage_match", "check_two_stage_inputs"]

_BIG = tl.constexpr(1 << 30)
FP8_MAX = tl.constexpr(448.0)   # largest finite E4M3 (``match_sketch.FP8_MAX``)


@triton.jit
def _round_rne(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 ``x`` -> the nearest value with ``MANT`` mantissa bits and smallest normal exponent
    ``EMIN`` (ties to even), as fp32: E4M3 is (3, -6), bf16 (7, -126). Plain fp32 arithmetic:
    adding 2^(k+23) rounds |x| to a multiple of 2^k by the fp32 add's round-to-nearest-even, k the
    spacing exponent of |x|'s binade. (Triton's own fp8 / bf16 conversions do not round so in its
    interpreter; on the GPU they agree.)"""
    ax = tl.abs(x)
    e = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.maximum(e, EMIN) - MANT
    c = ((k + 23 + 127) << 23).to(tl.float32, bitcast=True)
    y = (ax + c) - c
    return tl.where(x < 0, -y, y)


@triton.jit
def _candidates_kernel(
    q_pre_ptr, proj_ptr, qs_ptr, qring_ptr, sring_ptr, ring_pos_ptr, slots_ptr, positions_ptr,
    part_a_ptr, part_e_ptr, part_k_ptr,
    stride_qb, stride_qh,
    stride_rs, stride_rh, stride_rk, stride_xs, stride_xh, stride_xk, stride_ps,
    Hq, K,
    NS: tl.constexpr, KS: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, DS: tl.constexpr,
    C: tl.constexpr, PROJ: tl.constexpr, SFP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    m = tl.load(positions_ptr + b).to(tl.int64)
    ds = tl.arange(0, DS)
    dd = tl.arange(0, D)
    # the query rounded to the ring dtype, then its sketch (``match_sketch.sketch``): projection
    # (fp32, this kernel's summation order), then E4M3 (saturating) or bf16 rounding
    q = tl.load(q_pre_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + dd)
    q = q.to(qring_ptr.dtype.element_ty).to(tl.float32)
    if PROJ:
        pm = tl.load(proj_ptr + dd[:, None] * DS + ds[None, :])
        qs = tl.sum(q[:, None] * pm, axis=0)
    else:
        qs = q
    if SFP8:
        qs = _round_rne(tl.minimum(tl.maximum(qs, -FP8_MAX), FP8_MAX), 3, -6)
    elif PROJ:
        qs = _round_rne(qs, 7, -126)
    if s == 0:
        tl.store(qs_ptr + (b * Hq + h).to(tl.int64) * DS + ds, qs)
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
        # insert the block's entries nearest-first while one is strictly nearer than the current
        # worst candidate (ties: the lower slot; earlier blocks hold lower slots, so they win ties).
        # A random query inserts ~C ln(K / C) times over the whole scan, so most blocks cost one
        # reduction, not C.
        amin, ai = tl.min(a, axis=0, return_indices=True, return_indices_tie_break_left=True)
        worst = tl.max(cand_a, axis=0)
        while amin < worst:
            worst_k = tl.max(tl.where(cand_a == worst, cand_k, -_BIG), axis=0)
            at = tl.argmax(tl.where((cand_a == worst) & (cand_k == worst_k), 1, 0), axis=0)
            put = cc == at
            cand_a = tl.where(put, amin, cand_a)
            cand_k = tl.where(put, s * KS + i * BLOCK_K + ai, cand_k)
            a = tl.where(tl.arange(0, BLOCK_K) == ai, float("inf"), a)
            amin, ai = tl.min(a, axis=0, return_indices=True, return_indices_tie_break_left=True)
            worst = tl.max(cand_a, axis=0)
    # exact stage: the candidates' bf16 entries
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
    qs_ptr, sring_ptr, positions_ptr,
    stride_ps, stride_ls, stride_lh, stride_mpb, stride_db, stride_xs, stride_xh, stride_xk,
    Hq, K, band, thr,
    NSC: tl.constexpr, NSC_P: tl.constexpr, C: tl.constexpr, DS: tl.constexpr, APPEND: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if APPEND:   # the entry's sketch at m mod K: every candidate program has read the ring by now
        ds = tl.arange(0, DS)
        slot_a = tl.load(slots_ptr + b).to(tl.int64)
        col = tl.load(positions_ptr + b).to(tl.int64) % K
        qs = tl.load(qs_ptr + (b * Hq + h).to(tl.int64) * DS + ds)
        dst = sring_ptr + slot_a * stride_xs + h.to(tl.int64) * stride_xh + col * stride_xk + ds
        tl.store(dst, qs.to(sring_ptr.dtype.element_ty))
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


def two_stage_meta(batch: int, num_heads: int, window: int, head_dim: int, candidates: int, sms: int,
                   sketch_dims: int | None = None, sketch_itemsize: int = 2) -> TwoStageMeta:
    """The exact match's split of the ring (``match_meta``) sized for the sketch entries
    (``sketch_dims`` elements of ``sketch_itemsize`` bytes; default: a bf16 entry of ``head_dim``):
    a program still reads >= 16 KB of sketches, in blocks of <= 8K elements; ``C = candidates``
    (a power of two)."""
    if candidates & (candidates - 1):
        raise ValueError(f"the Triton two-stage match takes a power-of-two candidates count, got {candidates}")
    ds = head_dim if sketch_dims is None else sketch_dims
    mm = match_meta(batch, num_heads, window, max(8, ds * sketch_itemsize // 2), sms)
    block_k = max(mm.BLOCK_K, min(next_pow2(mm.KS), 8192 // ds))
    ks = triton.cdiv(mm.KS, block_k) * block_k
    return TwoStageMeta(NS=triton.cdiv(window, ks), KS=ks, BLOCK_K=block_k, C=candidates, num_warps=mm.num_warps)


def check_two_stage_inputs(q_pre, proj, qring, sring, ring_lse, ring_pos, slots, positions) -> None:
    """Shape/dtype checks (no value checks: they would sync with the host). ``proj``: the fixed
    projection ``[d, DS]`` fp32 of a projected sketch, None for the E4M3 sketch of the entry."""
    check_match_inputs(q_pre, qring, ring_lse, ring_pos, slots, positions)
    Hq, d = q_pre.shape[1], q_pre.shape[2]
    S, _, K, _ = qring.shape
    if sring.dim() != 4 or sring.shape[:3] != (S, Hq, K) or sring.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"sring must be E4M3 or bf16 [S, Hq, K, DS] with (S, Hq, K) = {(S, Hq, K)}, got "
                         f"{sring.dtype} {tuple(sring.shape)}")
    DS = sring.shape[3]
    if proj is None:
        if DS != d or sring.dtype != torch.float8_e4m3fn:
            raise ValueError(f"without a projection the sketch is the entry in E4M3: sring must be E4M3 with DS = d "
                             f"= {d}, got {sring.dtype} DS={DS}")
    elif proj.shape != (d, DS) or proj.dtype != torch.float32 or not proj.is_contiguous():
        raise ValueError(f"proj must be a contiguous fp32 [d={d}, DS={DS}], got {proj.dtype} {tuple(proj.shape)}")
    if DS & (DS - 1) or DS < 16:
        raise ValueError(f"sketch dims must be a power of two >= 16 for the Triton kernels, got {DS}")
    if sring.stride(3) != 1:
        raise ValueError("sring needs a contiguous last dimension")
    for name, t in (("sring", sring), ("proj", proj)):
        if t is not None:
            check_cuda_or_interp(name, t)


def launch_two_stage_match(q_pre: torch.Tensor, proj: torch.Tensor | None, qring: torch.Tensor, sring: torch.Tensor,
                           ring_pos: torch.Tensor, ring_lse: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, *, meta: TwoStageMeta, q_sketch: torch.Tensor,
                           part_a: torch.Tensor, part_e: torch.Tensor, part_k: torch.Tensor, match_pos: torch.Tensor,
                           dist: torch.Tensor, band: int, thr: float, append: bool = False) -> None:
    """Both kernels. The sketch kind follows from ``proj`` (None: E4M3 of the entry) and ``sring``'s
    dtype (E4M3 or bf16 after the projection). Scratch ``[B * Hq * NS * C]``: ``part_a`` / ``part_e``
    fp32, ``part_k`` int32; ``q_sketch`` ``[B, Hq, DS]`` fp32 (contiguous) receives the query's
    sketch. Writes ``match_pos [B, Hq]`` int64 and ``dist [B, Hq]`` fp32; with ``append`` also the
    query's sketch into ``sring`` at ``positions mod K`` (the step's ring entry; the select kernel
    runs after every candidate read)."""
    B, Hq, d = q_pre.shape
    K, DS = qring.shape[2], sring.shape[3]
    _candidates_kernel[(B, Hq, meta.NS)](
        q_pre, sring if proj is None else proj, q_sketch, qring, sring, ring_pos, slots, positions,
        part_a, part_e, part_k, q_pre.stride(0), q_pre.stride(1),
        qring.stride(0), qring.stride(1), qring.stride(2), sring.stride(0), sring.stride(1), sring.stride(2),
        ring_pos.stride(0), Hq, K,
        NS=meta.NS, KS=meta.KS, BLOCK_K=meta.BLOCK_K, D=d, DS=DS, C=meta.C, PROJ=proj is not None,
        SFP8=sring.dtype == torch.float8_e4m3fn, num_warps=meta.num_warps)
    nsc = meta.NS * meta.C
    _select_kernel[(B, Hq)](
        part_a, part_e, part_k, ring_pos, ring_lse, slots, match_pos, dist, q_sketch, sring, positions,
        ring_pos.stride(0), ring_lse.stride(0), ring_lse.stride(1), match_pos.stride(0), dist.stride(0),
        sring.stride(0), sring.stride(1), sring.stride(2),
        Hq, K, band, thr, NSC=nsc, NSC_P=next_pow2(nsc), C=meta.C, DS=DS, APPEND=bool(append), num_warps=1)
