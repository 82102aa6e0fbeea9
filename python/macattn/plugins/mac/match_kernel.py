"""MAC match (docs/spec.md §1.1) in Triton: nearest pre-RoPE query in the ring window.

One kernel, ``_match_kernel``, grid ``(B, Hq, NS)``:

1. program ``(b, h, s)`` scans ring slots ``[s*KS, (s+1)*KS)`` of request ``b``'s row
   ``slots[b]``, head ``h``, and writes the smallest squared distance among candidates
   (``m-K <= pos < m``, ``pos >= 0``) with that slot's ``pos`` and cached ``lse`` to
   ``part_d2 / part_pos / part_lse [B, Hq, NS]``. Splitting the ring over ``NS`` programs
   is what fills the GPU at small ``B``.
2. for the ``macattn::mac_match`` op (``FINISH``), the last program to finish (an atomic
   ticket, CUTLASS-semaphore style: barrier, then a release/acquire atomic by one thread)
   reduces the partials of every head (``match_reduce.reduce_match_partials``: best split, first
   slot on ties as ``mac_match_reference``, threshold and validity). The fused decode step
   reduces them in its plan kernel instead (``attend_kernel``), which also plans
   the attention's work split.

Distances: bf16 reads, differences and squares in fp32 (the reference's diff form).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..triton_util import check_cuda_or_interp, next_pow2
from .match_reduce import reduce_all_heads

__all__ = ["MatchMeta", "match_meta", "launch_match", "check_match_inputs", "match_split"]


@triton.jit
def match_split(q_pre_ptr, qring_ptr, ring_pos_ptr, ring_lse_ptr, slots_ptr, positions_ptr,
                part_d2_ptr, part_pos_ptr, part_lse_ptr, b, h, s, stride_qb, stride_qh, stride_rs, stride_rh,
                stride_rk, stride_ps, stride_ls, stride_lh, Hq, K,
                NS: tl.constexpr, KS: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr):
    """Split ``s`` of head ``h`` of request ``b``: the nearest candidate among ring slots
    ``[s*KS, (s+1)*KS)`` -> partial ``(b*Hq + h)*NS + s`` (squared distance, that slot's pos and lse)."""
    slot = tl.load(slots_ptr + b).to(tl.int64)
    m = tl.load(positions_ptr + b).to(tl.int64)
    dd = tl.arange(0, D)
    # the reference rounds q_pre to the ring's dtype before the fp32 difference
    q = tl.load(q_pre_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + dd)
    q = q.to(qring_ptr.dtype.element_ty).to(tl.float32)
    row = qring_ptr + slot * stride_rs + h.to(tl.int64) * stride_rh
    best = tl.full([], float("inf"), tl.float32)
    best_k = tl.full([], 0, tl.int32)
    for i in range(KS // BLOCK_K):
        kk = s * KS + i * BLOCK_K + tl.arange(0, BLOCK_K)
        inb = kk < K
        pos = tl.load(ring_pos_ptr + slot * stride_ps + kk, mask=inb, other=-1).to(tl.int64)
        cand = inb & (pos >= 0) & (pos < m) & (pos >= m - K)
        # not masked by `cand`: the ring row load need not wait for ring_pos
        r = tl.load(row + kk[:, None].to(tl.int64) * stride_rk + dd[None, :], mask=inb[:, None], other=0.0)
        diff = q[None, :] - r.to(tl.float32)
        d2 = tl.sum(diff * diff, axis=1)
        d2 = tl.where(cand, d2, float("inf"))
        blk, blk_i = tl.min(d2, axis=0, return_indices=True, return_indices_tie_break_left=True)
        upd = blk < best                       # strict: an earlier slot wins ties
        best = tl.where(upd, blk, best)
        best_k = tl.where(upd, s * KS + i * BLOCK_K + blk_i, best_k)
    # the best slot's pos and cached lse travel with the partial: the reduction needs no gather
    best_pos = tl.load(ring_pos_ptr + slot * stride_ps + best_k).to(tl.int64)
    best_lse = tl.load(ring_lse_ptr + slot * stride_ls + h.to(tl.int64) * stride_lh + best_k)
    out = (b * Hq + h) * NS + s
    tl.store(part_d2_ptr + out, best)
    tl.store(part_pos_ptr + out, best_pos)
    tl.store(part_lse_ptr + out, best_lse)


@triton.jit
def _match_kernel(
    q_pre_ptr, qring_ptr, ring_pos_ptr, ring_lse_ptr, slots_ptr, positions_ptr,
    part_d2_ptr, part_pos_ptr, part_lse_ptr, counter_ptr, match_pos_ptr, dist_ptr,
    stride_qb, stride_qh,
    stride_rs, stride_rh, stride_rk,
    stride_ps, stride_ls, stride_lh, stride_mpb, stride_db,
    Hq, K, band, thr,
    NS: tl.constexpr, KS: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, FINISH: tl.constexpr,
    NS_P: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    if USE_PDL:   # programmatic dependent launch: wait for the previous kernel, then let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    match_split(q_pre_ptr, qring_ptr, ring_pos_ptr, ring_lse_ptr, slots_ptr, positions_ptr,
                part_d2_ptr, part_pos_ptr, part_lse_ptr, b, h, s, stride_qb, stride_qh, stride_rs, stride_rh,
                stride_rk, stride_ps, stride_ls, stride_lh, Hq, K, NS, KS, BLOCK_K, D)
    if FINISH:
        # the last program to finish reduces every head
        tl.debug_barrier()                 # every thread's stores precede the release below
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1:
            tl.store(counter_ptr, 0)       # reset for the next launch
            reduce_all_heads(part_d2_ptr, part_pos_ptr, part_lse_ptr, match_pos_ptr, dist_ptr, stride_mpb,
                             stride_db, tl.num_programs(0) * Hq, Hq, band, thr, NS, NS_P, BLOCK_H)


class MatchMeta:
    """Launch parameters of the partial-match kernel for one shape bucket."""

    def __init__(self, NS: int, KS: int, BLOCK_K: int, num_warps: int) -> None:
        self.NS, self.KS, self.BLOCK_K, self.num_warps = NS, KS, BLOCK_K, num_warps

    @property
    def NS_P(self) -> int:
        return next_pow2(self.NS)

    def __repr__(self) -> str:
        return f"MatchMeta(NS={self.NS}, KS={self.KS}, BLOCK_K={self.BLOCK_K}, num_warps={self.num_warps})"


def match_meta(batch: int, num_heads: int, window: int, head_dim: int, sms: int,
               programs_per_sm: int = 8, max_splits: int | None = None) -> MatchMeta:
    """Split the ring so that ``batch * num_heads * NS`` is about ``programs_per_sm`` per SM (8
    fit at once: one wave), each program reading at least 16 KB of ring (64 slots at d=128).

    ``max_splits`` caps ``NS`` (the last program's reduction holds all partials in registers).
    """
    heads = max(1, batch * num_heads)
    want = max(1, (sms * programs_per_sm) // heads)
    ns = 1 << (want.bit_length() - 1)                       # power of two <= want
    min_slots = max(16, 16384 // (2 * head_dim))
    ns = max(1, min(ns, window // min_slots))
    if max_splits is not None:
        ns = max(1, min(ns, max_splits))
    block_k = min(64 if head_dim <= 128 else 32, next_pow2(triton.cdiv(window, ns)))
    ks = triton.cdiv(triton.cdiv(window, ns), block_k) * block_k
    ns = triton.cdiv(window, ks)
    return MatchMeta(NS=ns, KS=ks, BLOCK_K=block_k, num_warps=4)


def check_match_inputs(q_pre: torch.Tensor, qring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
                       slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Shape/dtype checks only (no value checks: they would sync with the host)."""
    if q_pre.dim() != 3:
        raise ValueError(f"q_pre must be [B, Hq, d], got {tuple(q_pre.shape)}")
    B, Hq, d = q_pre.shape
    if qring.dim() != 4 or qring.shape[1] != Hq or qring.shape[3] != d:
        raise ValueError(f"qring must be [S, Hq={Hq}, K, d={d}], got {tuple(qring.shape)}")
    S, _, K, _ = qring.shape
    if ring_lse.shape != (S, Hq, K) or ring_lse.dtype != torch.float32:
        raise ValueError(f"ring_lse must be fp32 [S, Hq, K] = {(S, Hq, K)}, got {ring_lse.dtype} {tuple(ring_lse.shape)}")
    if ring_pos.shape != (S, K) or ring_pos.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ring_pos must be int64 [S, K] = {(S, K)}, got {ring_pos.dtype} {tuple(ring_pos.shape)}")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.shape != (B,) or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be int64 [B]={B}, got {t.dtype} {tuple(t.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim must be a power of two >= 16 for the Triton kernels, got {d}")
    if q_pre.stride(2) != 1 or qring.stride(3) != 1 or ring_lse.stride(2) != 1 or ring_pos.stride(1) != 1:
        raise ValueError("q_pre, qring, ring_lse and ring_pos need a contiguous last dimension")
    for name, t in (("q_pre", q_pre), ("qring", qring), ("ring_lse", ring_lse), ("ring_pos", ring_pos),
                    ("slots", slots), ("positions", positions)):
        check_cuda_or_interp(name, t)


def launch_match(q_pre: torch.Tensor, qring: torch.Tensor, ring_pos: torch.Tensor, ring_lse: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor, *, meta: MatchMeta, part_d2: torch.Tensor,
                 part_pos: torch.Tensor, part_lse: torch.Tensor, counter: torch.Tensor | None = None,
                 match_pos: torch.Tensor | None = None, dist: torch.Tensor | None = None, band: int = 0,
                 thr: float = 0.0, finish: bool = True, pdl: bool = False) -> None:
    """Grid ``(B, Hq, NS)``, one launch. Scratch ``[B * Hq * NS]``: ``part_d2`` fp32, ``part_pos`` int64,
    ``part_lse`` fp32.

    ``finish``: the last program reduces the partials into ``match_pos [B, Hq]`` int64 and
    ``dist [B, Hq]`` fp32 (the ``macattn::mac_match`` op); needs ``counter`` int32 ``[1]``,
    zero before the first launch (every launch leaves it zero). Without it only the partials
    are written (the fused step reduces them in its plan kernel).
    """
    B, Hq, d = q_pre.shape
    K = qring.shape[2]
    if not finish:
        counter = match_pos = dist = part_pos
    _match_kernel[(B, Hq, meta.NS)](
        q_pre, qring, ring_pos, ring_lse, slots, positions, part_d2, part_pos, part_lse, counter, match_pos, dist,
        q_pre.stride(0), q_pre.stride(1),
        qring.stride(0), qring.stride(1), qring.stride(2),
        ring_pos.stride(0), ring_lse.stride(0), ring_lse.stride(1), match_pos.stride(0), dist.stride(0),
        Hq, K, band, thr,
        NS=meta.NS, KS=meta.KS, BLOCK_K=meta.BLOCK_K, D=d, FINISH=finish, NS_P=meta.NS_P, BLOCK_H=64,
        USE_PDL=pdl, num_warps=meta.num_warps, num_stages=3, launch_pdl=pdl,
        # <= 64 registers (no spills, checked with ptxas): 8 programs per SM instead of 7
        maxnreg=64,
    )


