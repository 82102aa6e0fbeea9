"""The MAC step in one launch for small batches: match, plan, attention and merge in one persistent kernel.

At B=1 the four-kernel step (match -> plan -> attention -> merge, ``attend_kernel.py``) is a chain of
four dependent phases, each paying a kernel boundary and its own latency chain (17.3 µs per
layer on the H100 against a 3.7 µs byte floor, ``benchmarks/NOTES.md``). Here ``P`` programs,
all resident at once (a cooperative launch sized from the compiled kernel's occupancy), run the
phases separated by two grid-wide barriers:

1. the part-B attention items (``NG * b_n``: need nothing from the match) and the match splits
   (``B * Hq * NS``), spread over the programs;
   -- barrier --
2. every program reduces the match partials and plans the part-A split itself, in registers
   (same inputs, same code: the same plan everywhere — no plan kernel, no plan round trip);
   program 0 writes ``match_pos`` / ``dist``; the programs take the part-A items, sized so that
   a missed head's long span is cut into about ``P`` items (the whole GPU streams it);
   -- barrier --
3. merge + ring append, one head at a time per program.

The device functions are the four-kernel step's own (``match_split``, ``attend_range``,
``merge_head``, ``reduce_match_partials``, ``chunk_for`` / ``size_items``): one definition of
each rule. A barrier is an arrival counter (a CTA barrier, then one release add; acquire polls);
the last program to leave resets the counters, so every launch (and CUDA-graph replay) starts
from zero. ``PHASE`` 1/2/3 launches one phase alone (no barrier): Triton's interpreter runs
programs one after another, so a grid barrier would never open there.

Measured (H100, B=1 x 128K, ``benchmarks/NOTES.md``, "MAC kernels v6"): correct (the device tests)
but slower than the four kernels — 31.7-35 µs all-hit against 17.4 — and not because of the
barriers (the phases as three separate launches cost the same): each phase alone is slower than its
kernel (match phase 15.5 µs vs 5.6). Opt-in (``MacDecodePlan(persistent=True)``), off by default.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attend_kernel import attend_range, kv_strides, merge_head
from .attend_plan import NMAX_A, chunk_for, size_items
from .match_kernel import match_split
from .match_reduce import reduce_match_partials

__all__ = ["launch_persistent_step", "PERSISTENT_PLAN_LIMIT"]

# register plan: [NG_P, HPG_P, NS_P] partials reduced at once by every program
PERSISTENT_PLAN_LIMIT = 2048


@triton.jit
def _grid_barrier(sync_ptr, target):
    """Wait until ``target`` programs have arrived at ``sync_ptr`` (this one included). Polling with an
    ``ld.acquire`` instead of an atomic measured the same (H100, B=1 x 128K)."""
    tl.debug_barrier()                         # every thread's stores precede the release below
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _plan_registers(part_d2_ptr, part_pos_ptr, part_mlse_ptr, positions_ptr, NG, Hkv, band, thr, g_target,
                    HPG: tl.constexpr, HPG_P: tl.constexpr, NS: tl.constexpr, NS_P: tl.constexpr,
                    NG_P: tl.constexpr, MIN_CHUNK: tl.constexpr, NMAX: tl.constexpr):
    """The part-A plan of every group, in registers (``attend_plan.plan_step``'s rule): returns
    ``mp, dist [NG_P, HPG_P]`` and per group ``[NG_P]``: ``m``, ``lo_g``, items ``na``, chunk ``cg``,
    first item ``start`` (``1 << 30`` past ``NG``)."""
    gi = tl.arange(0, NG_P)
    j = tl.arange(0, HPG_P)
    gm = gi < NG
    hm = gm[:, None] & (j < HPG)[None, :]
    bh = (gi * HPG)[:, None] + j[None, :]
    m = tl.load(positions_ptr + gi // Hkv, mask=gm, other=0).to(tl.int64)
    mp, dist = reduce_match_partials(part_d2_ptr, part_pos_ptr, part_mlse_ptr, bh, hm, band, thr, NS, NS_P)
    lo_h = tl.where(hm, tl.where(mp >= 0, mp - band + 1, 0), 1 << 62)
    lo_g = tl.where(gm, tl.min(lo_h, axis=1), 0)
    la = tl.where(gm, tl.maximum(m - band - lo_g + 1, 0), 0)
    c = chunk_for(tl.sum(la, axis=0), g_target, MIN_CHUNK)
    na, cg = size_items(la, c, NMAX)
    start = tl.where(gm, tl.cumsum(na, axis=0) - na, 1 << 30)
    return mp, dist, m, lo_g, na, cg, start


@triton.jit
def _pick(vec, sel):
    """``vec[g]`` for the one-hot mask ``sel`` (a register vector has no indexed read)."""
    return tl.sum(tl.where(sel, vec, 0), axis=0)


@triton.jit
def _persistent_step_kernel(
    q_ptr, q_pre_ptr, k_ptr, v_ptr, page_table_ptr, positions_ptr, slots_ptr,
    qring_ptr, oring_ptr, ring_lse_ptr, ring_pos_ptr,
    part_d2_ptr, part_pos_ptr, part_mlse_ptr, match_pos_ptr, dist_ptr, part_o_ptr, part_lse_ptr, out_ptr, sync_ptr,
    stride_qb, stride_qh, stride_qpb, stride_qph,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ptb,
    stride_rs, stride_rh, stride_rk, stride_ors, stride_orh, stride_ork, stride_ps, stride_ls, stride_lh,
    stride_mpb, stride_ob, stride_oh,
    Hq, K, NG, Hkv, band, thr, scale_log2, n_match, n_static, static_n, static_chunk, P,
    NS: tl.constexpr, KS: tl.constexpr, BLOCK_K: tl.constexpr, NS_P: tl.constexpr,
    HPG: tl.constexpr, HPG_P: tl.constexpr, HPG_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    NG_P: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MIN_CHUNK: tl.constexpr,
    NMAX: tl.constexpr, MB: tl.constexpr, DOT_F32: tl.constexpr, PHASE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)           # of P (an argument: the interpreter's num_programs is a 1-vector)
    r = tl.arange(0, HPG_M)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()          # q, KV and rings come from the previous kernels; sync is ours after it
    # -- phase 1: part-B items, then match splits ------------------------------------------------
    if PHASE == 0 or PHASE == 1:
        for k in range(0, tl.cdiv(n_static + n_match - pid, P)):
            it = pid + k * P
            if it < n_static:
                g = it // static_n
                b = g // Hkv
                m = tl.load(positions_ptr + b).to(tl.int64)
                t0 = tl.maximum(m - band + 1, 0) + (it % static_n) * static_chunk
                t1 = tl.minimum(t0 + static_chunk, m + 1)
                attend_range(q_ptr, k_ptr, v_ptr, page_table_ptr, part_o_ptr, part_lse_ptr, it, b, g % Hkv, t0, t1,
                             tl.zeros([HPG_M], dtype=tl.int64), stride_qb, stride_qh, stride_kb, stride_kh,
                             stride_kt, stride_vb, stride_vh, stride_vt, stride_ptb, scale_log2, HPG, HPG_M, D,
                             BLOCK_N, PAGED, PAGE_SIZE, DOT_F32)
            else:
                j = it - n_static
                bh = j // NS
                match_split(q_pre_ptr, qring_ptr, ring_pos_ptr, ring_lse_ptr, slots_ptr, positions_ptr,
                            part_d2_ptr, part_pos_ptr, part_mlse_ptr, bh // Hq, bh % Hq, j % NS, stride_qpb,
                            stride_qph, stride_rs, stride_rh, stride_rk, stride_ps, stride_ls, stride_lh, Hq, K,
                            NS, KS, BLOCK_K, D)
    if PHASE == 0:
        _grid_barrier(sync_ptr, P)
    # -- phase 2: the plan (every program), part-A items -------------------------------------------
    gi = tl.arange(0, NG_P)
    mp, dist, ms, lo_g, na, cg, start = _plan_registers(
        part_d2_ptr, part_pos_ptr, part_mlse_ptr, positions_ptr, NG, Hkv, band, thr, P,
        HPG, HPG_P, NS, NS_P, NG_P, MIN_CHUNK, NMAX)
    if PHASE == 0 or PHASE == 2:
        if pid == 0:
            j = tl.arange(0, HPG_P)
            hm = (gi < NG)[:, None] & (j < HPG)[None, :]
            b2 = (gi // Hkv).to(tl.int64)[:, None]
            h2 = ((gi % Hkv) * HPG)[:, None] + j[None, :]
            tl.store(match_pos_ptr + b2 * stride_mpb + h2, mp, mask=hm)
            tl.store(dist_ptr + (gi * HPG)[:, None] + j[None, :], dist, mask=hm)
        total = tl.sum(na, axis=0).to(tl.int32)
        for k in range(0, tl.cdiv(total - pid, P)):
            ia = pid + k * P
            g = tl.sum((start <= ia).to(tl.int32), axis=0) - 1
            sel = gi == g
            c = _pick(cg, sel)
            m = _pick(ms, sel)
            b = g // Hkv
            t0 = _pick(lo_g, sel) + (ia - _pick(start, sel)) * c
            t1 = tl.minimum(t0 + c, m - band + 1)
            # this item's heads' decisions, re-reduced from the partials in the item's row layout
            mph, _ = reduce_match_partials(part_d2_ptr, part_pos_ptr, part_mlse_ptr, (g * HPG + r)[None, :],
                                           (r < HPG)[None, :], band, thr, NS, NS_P)
            mph = tl.sum(mph, axis=0)
            lo_h = tl.where(mph >= 0, mph - band + 1, 0)
            attend_range(q_ptr, k_ptr, v_ptr, page_table_ptr, part_o_ptr, part_lse_ptr, n_static + ia, b, g % Hkv,
                         t0, t1, lo_h, stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                         stride_vt, stride_ptb, scale_log2, HPG, HPG_M, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_F32)
    if PHASE == 0:
        _grid_barrier(sync_ptr, 2 * P)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()   # every program is resident: the next kernel may start
    # -- phase 3: merge + append, one head at a time ------------------------------------------------
    if PHASE == 0 or PHASE == 3:
        dd = tl.arange(0, D)
        for k in range(0, tl.cdiv(NG * HPG - pid, P)):
            bh = pid + k * P
            b = bh // Hq
            h = bh % Hq
            g = bh // HPG
            sel = gi == g
            b64 = b.to(tl.int64)
            h64 = h.to(tl.int64)
            m = tl.load(positions_ptr + b).to(tl.int64)
            slot = tl.load(slots_ptr + b).to(tl.int64)
            qp = tl.load(q_pre_ptr + b64 * stride_qpb + h64 * stride_qph + dd)
            mph = tl.load(match_pos_ptr + b64 * stride_mpb + h, cache_modifier=".cg").to(tl.int64)
            merge_head(part_o_ptr, part_lse_ptr, qring_ptr, oring_ptr, ring_lse_ptr, ring_pos_ptr, out_ptr,
                       b64, h64, h % HPG, m, slot, qp, mph, n_static + _pick(start, sel), _pick(na, sel),
                       g * static_n, g * static_n + static_n,
                       stride_ob, stride_oh, stride_rs, stride_rh, stride_rk, stride_ors, stride_orh, stride_ork,
                       stride_ls, stride_lh, stride_ps, K, HPG, D, MB, True)
    if PHASE == 0:
        # the last program out resets both counters for the next launch (all have passed the barriers)
        left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == P - 1:
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)


def launch_persistent_step(plan, q, q_pre, k, v, positions, slots, qring, oring, ring_lse, ring_pos, page_table, *,
                           programs: int, phases: tuple[int, ...] = (0,), cooperative: bool = True,
                           warmup: bool = False):
    """Launch the one-launch step for ``plan`` (a ``MacDecodePlan``; its scratch, outputs and
    ``sync [2]`` int32 counters, zero before the first launch and left zero by each).

    ``programs``: the grid ``P`` (must all be resident at once: at most SMs x resident programs per
    SM of the compiled kernel). ``phases``: ``(0,)`` = all phases with grid barriers (GPU);
    ``(1, 2, 3)`` = one launch per phase (the interpreter). ``warmup``: compile only, return the
    compiled kernel (for its occupancy).
    """
    mt, at = plan.match, plan.attend
    paged = page_table is not None
    (skb, skh, skt, svb, svh, svt, sptb), page_table = kv_strides(k, v, page_table, positions)
    B, Hq, d = q.shape
    args = (q, q_pre, k, v, page_table, positions, slots, qring, oring, ring_lse, ring_pos,
            plan.part_d2, plan.part_pos, plan.part_mlse, plan.match_pos, plan.dist, plan.part_o, plan.part_lse,
            plan.out, plan.sync,
            q.stride(0), q.stride(1), q_pre.stride(0), q_pre.stride(1), skb, skh, skt, svb, svh, svt, sptb,
            qring.stride(0), qring.stride(1), qring.stride(2), oring.stride(0), oring.stride(1), oring.stride(2),
            ring_pos.stride(0), ring_lse.stride(0), ring_lse.stride(1),
            plan.match_pos.stride(0), plan.out.stride(0), plan.out.stride(1),
            Hq, qring.shape[2], at.NG, plan.Hkv, plan.band, plan.thr, plan.scale * 1.4426950408889634,
            B * Hq * mt.NS, at.NG * at.b_n, at.b_n, at.b_chunk, programs)
    kw = dict(NS=mt.NS, KS=mt.KS, BLOCK_K=mt.BLOCK_K, NS_P=mt.NS_P, HPG=at.HPG, HPG_P=at.HPG_P, HPG_M=at.HPG_M,
              D=d, BLOCK_N=at.BLOCK_N, NG_P=at.NG_P, PAGED=paged, PAGE_SIZE=plan.page_size or 1,
              MIN_CHUNK=at.BLOCK_N, NMAX=NMAX_A, MB=at.MB, DOT_F32=plan.dot_f32, USE_PDL=plan.pdl,
              num_warps=at.num_warps, num_stages=at.num_stages, launch_pdl=plan.pdl)
    if warmup:
        return _persistent_step_kernel.warmup(*args, PHASE=0, grid=(programs,), **kw)
    for phase in phases:
        _persistent_step_kernel[(programs,)](*args, PHASE=phase, launch_cooperative_grid=cooperative and phase == 0,
                                             **kw)
    return None
