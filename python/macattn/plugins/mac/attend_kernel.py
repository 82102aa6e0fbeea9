"""MAC complete + amend + append (docs/spec.md §1.2-1.3) in Triton: one split-KV decode path.

A fused MAC step is three launches with shapes fixed per batch bucket and no host sync:

1. the match kernel (``match_kernel``): per-split partials; then
   ``_plan_kernel`` (one program, ``attend_plan.plan_step``) reduces them into ``match_pos`` and plans
   the part-A work split on the device, in proportion to span length. (The
   ``macattn::mac_attend`` op, given ``match_pos``, runs only the plan.)
2. ``_attend_kernel``: programs ``[0, n_static)`` are static items, part B
   ``[max(0, m-r+1), m]`` cut into ``static_n`` chunks per KV group (or, on the
   full-attention path, ``MODE 0``, ``[0, m]`` cut into chunks sized for one wave at the
   bucket's max context); the programs after them take the planned part-A items
   ``[lo_g, m-r]`` (those past the planned count exit at once). Each item loads its KV chunk
   once for all ``HPG`` query heads of its group (rows of one ``tl.dot``), masks per head
   (``t >= p_h - r + 1`` in part A) and writes a partial summary ``(o, lse)`` per head.
   Items never straddle ``m - r``: parts A and B stay separate, so nothing is subtracted.
3. ``_merge_kernel``, grid ``(B, Hq)``: ``entry = cached ⊕ A-rows`` (cached = ring slot
   ``p mod K`` on a hit, else empty), ``out = entry ⊕ B-rows``; writes ``out`` and appends
   ``(q_pre, entry.o, entry.lse, m)`` to slot ``m mod K``. The cached entry is read before the
   append writes: they are the same slot when ``p = m - K`` (a legal candidate); a barrier
   orders the two.

Programmatic dependent launch (``USE_PDL``): each kernel may start while its predecessor
drains and waits (``griddepcontrol.wait``) before reading the predecessor's outputs. The plan
lets the attention kernel start at once: part-B items read only the step's inputs, so they
run during the plan without waiting; part-A items wait for the plan.

KV layouts: contiguous ``[B, Hkv, T, d]`` (HF / ``mac_attend_reference``) or paged NHD
``[num_pages, page_size, Hkv, d]`` with a page table ``[B, max_pages]`` int32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_softmax import online_softmax_finish, online_softmax_update
from .attend_plan import NMAX_A, plan_step

__all__ = ["AttendMeta", "attend_meta", "launch_plan", "launch_attend", "launch_merge", "NMAX_A", "attend_range",
           "merge_head", "kv_strides"]

_LOG2E = 1.4426950408889634


@triton.jit
def _plan_kernel(
    part_d2_ptr, part_pos_ptr, part_lse_ptr, match_pos_ptr, dist_ptr, positions_ptr,
    grp_start_ptr, grp_lo_ptr, grp_na_ptr, grp_chunk_ptr,
    stride_mpb, NG, Hkv, band, thr, g_target,
    HPG: tl.constexpr, HPG_P: tl.constexpr, NS: tl.constexpr, NS_P: tl.constexpr, GB: tl.constexpr,
    MIN_CHUNK: tl.constexpr, NMAX: tl.constexpr, MODE: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """One program. ``MODE 2`` (fused step): reduce the match partials into ``match_pos``/``dist``,
    then plan; ``MODE 1`` (the ``macattn::mac_attend`` op): plan for a given ``match_pos``."""
    if USE_PDL:
        if EARLY and MODE == 2:
            # let the attention kernel start now: its part-B items read only the step's inputs,
            # final since every match program passed its own wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    plan_step(part_d2_ptr, part_pos_ptr, part_lse_ptr, match_pos_ptr, dist_ptr, positions_ptr,
              grp_start_ptr, grp_lo_ptr, grp_na_ptr, grp_chunk_ptr, stride_mpb, NG, Hkv, band, thr, g_target,
              HPG, HPG_P, NS, NS_P, GB, MIN_CHUNK, NMAX, MODE == 2)


@triton.jit
def _load_rows(part_o_ptr, part_lse_ptr, s0, s1, jh, HPG: tl.constexpr, D: tl.constexpr, MB: tl.constexpr,
               CG: tl.constexpr):
    """Rows ``[s0, min(s1, s0 + MB))`` of head ``jh``: ``(lse [MB], o [MB, D])``, empty rows masked.
    ``CG``: read past L1 (``.cg``: rows written by other programs of the same launch)."""
    dd = tl.arange(0, D)
    idx = s0 + tl.arange(0, MB)
    im = idx < s1
    rowh = idx.to(tl.int64) * HPG + jh
    if CG:
        lse = tl.load(part_lse_ptr + rowh, mask=im, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_o_ptr + rowh[:, None] * D + dd[None, :], mask=im[:, None], other=0.0, cache_modifier=".cg")
    else:
        lse = tl.load(part_lse_ptr + rowh, mask=im, other=float("-inf"))
        o = tl.load(part_o_ptr + rowh[:, None] * D + dd[None, :], mask=im[:, None], other=0.0)
    return lse, o


@triton.jit
def _fold_rest(part_o_ptr, part_lse_ptr, s0, s1, jh, M, L, acc, HPG: tl.constexpr, D: tl.constexpr,
               MB: tl.constexpr, CG: tl.constexpr):
    """Fold rows ``[s0 + MB, s1)`` (the first ``MB`` rows are folded by the caller) in blocks of
    ``4 * MB`` into the running ``(M, L, acc [D])`` (online softmax over the rows' lse, base e):
    a long list (a missed head's group) takes a few wide loads, not many narrow ones."""
    for it in range(s0 + MB, s1, 4 * MB):
        lse, o = _load_rows(part_o_ptr, part_lse_ptr, it, s1, jh, HPG, D, 4 * MB, CG)
        M, L, acc = online_softmax_update(M, L, acc, lse, o, AXIS=0, BASE2=False)
    return M, L, acc


@triton.jit
def attend_range(q_ptr, k_ptr, v_ptr, page_table_ptr, part_o_ptr, part_lse_ptr, row, b, kvh, t0, t1, lo_h,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ptb,
                 scale_log2, HPG: tl.constexpr, HPG_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
    """Tokens ``[t0, t1)`` of KV head ``kvh`` of request ``b`` for the group's ``HPG`` query heads
    (token ``t`` masked for head ``j`` below ``lo_h[j]``, ``[HPG_M]`` int64) -> partial summary
    rows ``row * HPG + j``: ``part_o [.., D]`` fp32 and ``part_lse`` (natural log; -inf if empty)."""
    r = tl.arange(0, HPG_M)
    rmask = r < HPG
    dd = tl.arange(0, D)
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + (kvh * HPG + r)[:, None] * stride_qh + dd[None, :],
                mask=rmask[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    if DOT_F32:
        q = q.to(tl.float32)
    if PAGED:
        kbase = k_ptr + kvh.to(tl.int64) * stride_kh
        vbase = v_ptr + kvh.to(tl.int64) * stride_vh
    else:
        kbase = k_ptr + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
        vbase = v_ptr + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([HPG_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HPG_M], dtype=tl.float32)
    acc = tl.zeros([HPG_M, D], dtype=tl.float32)
    # i32 bounds (positions < 2**31): an i64 `t1` would widen the per-token index math
    t0 = t0.to(tl.int32)
    t1 = t1.to(tl.int32)
    for start in range(t0, t1, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tm = t < t1
        if PAGED:
            page = tl.load(page_table_ptr + b64 * stride_ptb + t // PAGE_SIZE, mask=tm, other=0).to(tl.int64)
            within = (t % PAGE_SIZE).to(tl.int64)
            koff = page * stride_kb + within * stride_kt
            voff = page * stride_vb + within * stride_vt
        else:
            koff = t.to(tl.int64) * stride_kt
            voff = t.to(tl.int64) * stride_vt
        k = tl.load(kbase + koff[:, None] + dd[None, :], mask=tm[:, None], other=0.0)
        v = tl.load(vbase + voff[:, None] + dd[None, :], mask=tm[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)))
            v = v.to(tl.float32)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        valid = tm[None, :] & (t[None, :] >= lo_h[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, AXIS=1, BASE2=True)
    lse, o = online_softmax_finish(m_i, l_i, acc, BASE2=True)
    prow = row.to(tl.int64) * HPG + r
    tl.store(part_o_ptr + prow[:, None] * D + dd[None, :], o, mask=rmask[:, None])
    tl.store(part_lse_ptr + prow, lse, mask=rmask)


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, positions_ptr, match_pos_ptr,
    grp_start_ptr, grp_lo_ptr, grp_na_ptr, grp_chunk_ptr,
    part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ptb, stride_mpb,
    NG, Hkv, band, scale_log2, n_static, static_n, static_chunk,
    HPG: tl.constexpr, HPG_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NG_P: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MODE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One work item -> partial summaries ``(o, lse)`` of the group's heads into row ``program_id``."""
    i = tl.program_id(0)
    r = tl.arange(0, HPG_M)
    rmask = r < HPG
    if USE_PDL:
        if MODE == 0:
            tl.extra.cuda.gdc_wait()       # full path: q / KV may come from the previous kernel
        tl.extra.cuda.gdc_launch_dependents()
    if i < n_static:
        # static item: MAC part B (needs nothing from the match kernel), or a chunk of [0, m]
        g = i // static_n
        b = g // Hkv
        kvh = g % Hkv
        m = tl.load(positions_ptr + b).to(tl.int64)
        if MODE == 0:
            base_t = m * 0
        else:
            base_t = tl.maximum(m - band + 1, 0)
        t0 = base_t + (i % static_n) * static_chunk
        t1 = tl.minimum(t0 + static_chunk, m + 1)
        lo_h = tl.zeros([HPG_M], dtype=tl.int64)
        if MODE == 0:
            if t0 > m:
                return
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        ia = i - n_static
        gi = tl.arange(0, NG_P)
        gmask = gi < NG
        starts = tl.load(grp_start_ptr + gi, mask=gmask, other=1 << 30)
        los = tl.load(grp_lo_ptr + gi, mask=gmask, other=0)
        cgs = tl.load(grp_chunk_ptr + gi, mask=gmask, other=0)
        ms = tl.load(positions_ptr + gi // Hkv, mask=gmask, other=0)
        total = tl.load(grp_start_ptr + NG)
        if ia >= total:
            return
        g = tl.sum((starts <= ia).to(tl.int32), axis=0) - 1
        sel = gi == g
        c = tl.sum(tl.where(sel, cgs, 0), axis=0).to(tl.int64)
        m = tl.sum(tl.where(sel, ms, 0), axis=0).to(tl.int64)
        b = g // Hkv
        kvh = g % Hkv
        t0 = tl.sum(tl.where(sel, los, 0), axis=0).to(tl.int64) + (ia - tl.sum(tl.where(sel, starts, 0), axis=0)) * c
        t1 = tl.minimum(t0 + c, m - band + 1)
        mp = tl.load(match_pos_ptr + b.to(tl.int64) * stride_mpb + kvh * HPG + r, mask=rmask, other=-1).to(tl.int64)
        lo_h = tl.where(mp >= 0, mp - band + 1, 0)

    attend_range(q_ptr, k_ptr, v_ptr, page_table_ptr, part_o_ptr, part_lse_ptr, i, b, kvh, t0, t1, lo_h,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ptb,
                 scale_log2, HPG, HPG_M, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_F32)


@triton.jit
def merge_head(part_o_ptr, part_lse_ptr, qring_ptr, oring_ptr, ring_lse_ptr, ring_pos_ptr, out_ptr,
               b64, h64, jh, m, slot, qp, mp, a_start, na, b_start, b_end,
               stride_ob, stride_oh, stride_qrs, stride_qrh, stride_qrk, stride_ors, stride_orh, stride_ork,
               stride_ls, stride_lh, stride_ps, K, HPG: tl.constexpr, D: tl.constexpr, MB: tl.constexpr,
               CG: tl.constexpr):
    """One head's MAC merge: ``entry = cached ⊕ A-rows [a_start, a_start + na)`` (cached = ring slot
    ``mp mod K`` on a hit ``mp >= 0``, else empty), ``out = entry ⊕ B-rows [b_start, b_end)``; writes
    ``out`` and appends ``(qp, entry.o, entry.lse, m)`` to ring slot ``m mod K`` of row ``slot``.
    The cached entry is read before the append writes: they are the same slot when ``p = m - K``."""
    dd = tl.arange(0, D)
    # part-B rows need nothing from the plan: in flight with the plan/match lookups
    b_lse, b_o = _load_rows(part_o_ptr, part_lse_ptr, b_start, b_end, jh, HPG, D, MB, CG)
    hit = mp >= 0
    col = tl.where(hit, mp % K, 0)
    M = tl.load(ring_lse_ptr + slot * stride_ls + h64 * stride_lh + col, mask=hit, other=float("-inf"))
    M = tl.where(hit, M, float("-inf"))
    acc = tl.load(oring_ptr + slot * stride_ors + h64 * stride_orh + col * stride_ork + dd,
                  mask=dd < tl.where(hit, D, 0), other=0.0).to(tl.float32)   # not `hit & ...`: Triton 3.9's interpreter
    L = tl.where(hit, 1.0, 0.0)
    a_lse, a_o = _load_rows(part_o_ptr, part_lse_ptr, a_start, a_start + na, jh, HPG, D, MB, CG)
    M, L, acc = online_softmax_update(M, L, acc, a_lse, a_o, AXIS=0, BASE2=False)
    M, L, acc = _fold_rest(part_o_ptr, part_lse_ptr, a_start, a_start + na, jh, M, L, acc, HPG, D, MB, CG)
    e_lse, e_o = online_softmax_finish(M, L, acc, BASE2=False)
    M, L, acc = online_softmax_update(M, L, acc, b_lse, b_o, AXIS=0, BASE2=False)
    M, L, acc = _fold_rest(part_o_ptr, part_lse_ptr, b_start, b_end, jh, M, L, acc, HPG, D, MB, CG)
    _, o = online_softmax_finish(M, L, acc, BASE2=False)
    tl.store(out_ptr + b64 * stride_ob + h64 * stride_oh + dd, o.to(out_ptr.dtype.element_ty))
    tl.debug_barrier()         # slot p mod K (read above) is slot m mod K when p = m - K: read before write
    colm = m % K
    tl.store(qring_ptr + slot * stride_qrs + h64 * stride_qrh + colm * stride_qrk + dd,
             qp.to(qring_ptr.dtype.element_ty))
    tl.store(oring_ptr + slot * stride_ors + h64 * stride_orh + colm * stride_ork + dd,
             e_o.to(oring_ptr.dtype.element_ty))
    tl.store(ring_lse_ptr + slot * stride_ls + h64 * stride_lh + colm, e_lse)
    if h64 == 0:
        tl.store(ring_pos_ptr + slot * stride_ps + colm, m.to(ring_pos_ptr.dtype.element_ty))


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, grp_start_ptr, grp_na_ptr,
    positions_ptr, match_pos_ptr, slots_ptr, q_pre_ptr,
    qring_ptr, oring_ptr, ring_lse_ptr, ring_pos_ptr, out_ptr,
    stride_mpb, stride_qpb, stride_qph, stride_ob, stride_oh,
    stride_qrs, stride_qrh, stride_qrk,
    stride_ors, stride_orh, stride_ork,
    stride_ls, stride_lh, stride_ps,
    Hq, K, n_static, static_n, static_chunk,
    HPG: tl.constexpr, D: tl.constexpr, MB: tl.constexpr, MODE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid ``(B, Hq)``. MAC: ``entry = cached ⊕ A-rows``, ``out = entry ⊕ B-rows``, append to slot ``m mod K``.
    Full path (``MODE 0``): ``out = ⊕ rows``."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = (b * Hq + h) // HPG
    jh = h % HPG
    dd = tl.arange(0, D)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    # before the wait only the step's inputs (final before the match kernel began); the plan's
    # and the attention's outputs after it
    m = tl.load(positions_ptr + b).to(tl.int64)
    if MODE != 0:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        qp = tl.load(q_pre_ptr + b64 * stride_qpb + h64 * stride_qph + dd)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 0:
        b_start = g * static_n
        b_end = b_start + ((m + static_chunk) // static_chunk).to(tl.int32)
        M = tl.full([], float("-inf"), tl.float32)
        L = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([D], dtype=tl.float32)
        b_lse, b_o = _load_rows(part_o_ptr, part_lse_ptr, b_start, b_end, jh, HPG, D, MB, False)
        M, L, acc = online_softmax_update(M, L, acc, b_lse, b_o, AXIS=0, BASE2=False)
        M, L, acc = _fold_rest(part_o_ptr, part_lse_ptr, b_start, b_end, jh, M, L, acc, HPG, D, MB, False)
        _, o = online_softmax_finish(M, L, acc, BASE2=False)
        tl.store(out_ptr + b64 * stride_ob + h64 * stride_oh + dd, o.to(out_ptr.dtype.element_ty))
    else:
        a_start = n_static + tl.load(grp_start_ptr + g)
        na = tl.load(grp_na_ptr + g)
        mp = tl.load(match_pos_ptr + b64 * stride_mpb + h).to(tl.int64)
        merge_head(part_o_ptr, part_lse_ptr, qring_ptr, oring_ptr, ring_lse_ptr, ring_pos_ptr, out_ptr,
                   b64, h64, jh, m, slot, qp, mp, a_start, na, g * static_n, g * static_n + static_n,
                   stride_ob, stride_oh, stride_qrs, stride_qrh, stride_qrk, stride_ors, stride_orh, stride_ork,
                   stride_ls, stride_lh, stride_ps, K, HPG, D, MB, False)


class AttendMeta:
    """Launch parameters of the attention kernels for one shape bucket.

    MAC path: ``b_n`` static part-B items of ``b_chunk`` tokens per group, then up to
    ``g_target + NG`` planned part-A items (``g_target`` = SMs x resident programs per SM).
    Full path: ``full_n`` items of ``full_chunk`` tokens per group over ``[0, max_context)``,
    about one wave of resident programs. ``rows``: partial-summary rows allocated (enough
    for any ``set_residency``).
    """

    MAX_PER_SM = 32

    def __init__(self, *, hpg: int, block_n: int, num_warps: int, num_stages: int, sms: int, per_sm: int, ng: int,
                 max_context: int, band: int, maxnreg: int | None = None, b_items: int | None = None) -> None:
        self.HPG = hpg
        self.HPG_P = triton.next_power_of_2(hpg)
        self.HPG_M = max(16, self.HPG_P)                    # tl.dot needs >= 16 rows
        self.BLOCK_N, self.num_warps, self.num_stages, self.maxnreg = block_n, num_warps, num_stages, maxnreg
        self.sms, self.NG, self.max_context = sms, ng, max_context
        self.NG_P = max(2, triton.next_power_of_2(ng))
        self.GB = min(self.NG_P, 32)                         # plan: groups per block
        self.MB = 16                                          # merge: rows per load (per head)
        # part B [m-r+1, m]: static split, about one program per resident slot when B is small
        b_len = max(band, 1)
        if b_items is None:       # one item per group once the groups alone cover the SMs (measured)
            b_items = 1 if ng >= sms else min(triton.cdiv(sms * per_sm, ng), triton.cdiv(b_len, block_n))
        b_n = max(1, b_items)
        self.b_chunk = triton.cdiv(triton.cdiv(b_len, b_n), block_n) * block_n
        self.b_n = triton.cdiv(b_len, self.b_chunk)
        cap = sms * self.MAX_PER_SM + ng
        self.rows = max(ng * self.b_n + cap, cap)
        self.set_residency(per_sm, per_sm)

    def set_residency(self, per_sm_mac: int, per_sm_full: int) -> None:
        """Size the work split to ``per_sm`` resident attention programs per SM (one wave)."""
        per_sm_mac = max(1, min(per_sm_mac, self.MAX_PER_SM))
        per_sm_full = max(1, min(per_sm_full, self.MAX_PER_SM))
        self.per_sm = (per_sm_mac, per_sm_full)
        self.g_target = self.sms * per_sm_mac
        self.max_a_items = self.g_target + self.NG
        n_full = max(1, (self.sms * per_sm_full) // self.NG)
        self.full_chunk = triton.cdiv(triton.cdiv(self.max_context, n_full), self.BLOCK_N) * self.BLOCK_N
        self.full_n = triton.cdiv(self.max_context, self.full_chunk)

    def __repr__(self) -> str:
        return (f"AttendMeta(HPG={self.HPG}, BLOCK_N={self.BLOCK_N}, warps={self.num_warps}, "
                f"stages={self.num_stages}, resident/SM={self.per_sm}, g_target={self.g_target}, "
                f"B-part={self.b_n}x{self.b_chunk}, full={self.full_n}x{self.full_chunk}, rows={self.rows})")


def attend_meta(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_context: int, band: int,
                sms: int, *, programs_per_sm: int = 4, block_n: int | None = None, num_warps: int = 4,
                num_stages: int = 3, maxnreg: int | None = None, b_items: int | None = None) -> AttendMeta:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    return AttendMeta(hpg=num_q_heads // num_kv_heads, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                      sms=sms, per_sm=programs_per_sm, ng=batch * num_kv_heads, max_context=max_context,
                      band=band, maxnreg=maxnreg, b_items=b_items)


def launch_plan(meta: AttendMeta, *, positions, match_pos, grp_start, grp_lo, grp_na, grp_chunk, band: int,
                num_kv_heads: int, partials=None, dist=None, thr: float = 0.0, ns: int = 1, pdl: bool = False,
                early: bool = True) -> None:
    """One program: plan the part-A work split. ``partials`` = ``(part_d2, part_pos, part_lse)`` of the
    match kernel: reduce them into ``match_pos``/``dist`` first (fused step); None: ``match_pos`` is given."""
    mode = 1 if partials is None else 2
    d2, pos, lse = partials if partials is not None else (match_pos, match_pos, match_pos)
    ns_p = triton.next_power_of_2(ns)
    gb = meta.NG_P if meta.NG_P * meta.HPG_P * ns_p <= 4096 else min(32, meta.NG_P)
    _plan_kernel[(1,)](
        d2, pos, lse, match_pos, match_pos if dist is None else dist, positions,
        grp_start, grp_lo, grp_na, grp_chunk,
        match_pos.stride(0), meta.NG, num_kv_heads, band, thr, meta.g_target,
        HPG=meta.HPG, HPG_P=meta.HPG_P, NS=ns, NS_P=ns_p, GB=gb, MIN_CHUNK=meta.BLOCK_N, NMAX=NMAX_A, MODE=mode,
        USE_PDL=pdl, EARLY=early, num_warps=8 if gb * meta.HPG_P * ns_p > 512 else 4, launch_pdl=pdl,
    )


def kv_strides(k, v, page_table, positions):
    """The attention kernels' KV strides ``(skb, skh, skt, svb, svh, svt, sptb)`` (block / head / token;
    paged NHD ``[P, ps, Hkv, d]`` or contiguous ``[B, Hkv, T, d]``) and the page-table pointer to pass
    (``positions`` stands in, unused, for contiguous KV)."""
    if page_table is not None:
        return (k.stride(0), k.stride(2), k.stride(1), v.stride(0), v.stride(2), v.stride(1),
                page_table.stride(0)), page_table
    return (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0), positions


def launch_attend(meta: AttendMeta, *, full: bool, q, k, v, page_table, page_size: int, positions, match_pos,
                  grp_start, grp_lo, grp_na, grp_chunk, part_o, part_lse, band: int, scale: float, num_kv_heads: int,
                  dot_f32: bool = False, pdl: bool = False, warmup: bool = False):
    """Split-KV partial summaries of every work item (``full``: static split of ``[0, m]``).

    ``k``/``v``: contiguous ``[B, Hkv, T, d]`` (``page_table`` None) or paged ``[P, ps, Hkv, d]``.
    ``warmup``: compile only and return the compiled kernel (for its resource usage).
    """
    paged = page_table is not None
    (skb, skh, skt, svb, svh, svt, sptb), page_table = kv_strides(k, v, page_table, positions)
    if full:
        n_static, static_n, static_chunk = meta.NG * meta.full_n, meta.full_n, meta.full_chunk
        grid = (n_static,)
        match_pos = positions
    else:
        n_static, static_n, static_chunk = meta.NG * meta.b_n, meta.b_n, meta.b_chunk
        grid = (n_static + meta.max_a_items,)
    args = (q, k, v, page_table, positions, match_pos, grp_start, grp_lo, grp_na, grp_chunk, part_o, part_lse,
            q.stride(0), q.stride(1), skb, skh, skt, svb, svh, svt, sptb, match_pos.stride(0),
            meta.NG, num_kv_heads, band, scale * _LOG2E, n_static, static_n, static_chunk)
    kw = dict(HPG=meta.HPG, HPG_M=meta.HPG_M, D=q.shape[-1], BLOCK_N=meta.BLOCK_N, NG_P=meta.NG_P, PAGED=paged,
              PAGE_SIZE=page_size if paged else 1, MODE=0 if full else 1, DOT_F32=dot_f32, USE_PDL=pdl,
              num_warps=meta.num_warps, num_stages=meta.num_stages, launch_pdl=pdl)
    if meta.maxnreg:
        kw["maxnreg"] = meta.maxnreg
    if warmup:
        return _attend_kernel.warmup(*args, grid=grid, **kw)
    _attend_kernel[grid](*args, **kw)
    return None


def launch_merge(meta: AttendMeta, *, full: bool, part_o, part_lse, grp_start, grp_na, positions, out,
                 match_pos=None, slots=None, q_pre=None, qring=None, oring=None, ring_lse=None, ring_pos=None,
                 pdl: bool = False) -> None:
    """Grid ``(B, Hq)``: merge each head's rows into ``out`` (and, unless ``full``, append to the rings)."""
    B, Hq, d = out.shape
    if full:
        n_static, static_n, static_chunk = meta.NG * meta.full_n, meta.full_n, meta.full_chunk
        match_pos = slots = positions
        q_pre = qring = oring = out
        ring_lse, ring_pos = part_lse, positions
        K, qp_s, qr_s, or_s, ls_s, ps_s = 1, (0, 0), (0, 0, 0), (0, 0, 0), (0, 0), 0
    else:
        n_static, static_n, static_chunk = meta.NG * meta.b_n, meta.b_n, meta.b_chunk
        K = qring.shape[2]
        qp_s = (q_pre.stride(0), q_pre.stride(1))
        qr_s = (qring.stride(0), qring.stride(1), qring.stride(2))
        or_s = (oring.stride(0), oring.stride(1), oring.stride(2))
        ls_s = (ring_lse.stride(0), ring_lse.stride(1))
        ps_s = ring_pos.stride(0)
    _merge_kernel[(B, Hq)](
        part_o, part_lse, grp_start, grp_na, positions, match_pos, slots, q_pre,
        qring, oring, ring_lse, ring_pos, out,
        match_pos.stride(0), qp_s[0], qp_s[1], out.stride(0), out.stride(1),
        qr_s[0], qr_s[1], qr_s[2], or_s[0], or_s[1], or_s[2], ls_s[0], ls_s[1], ps_s,
        Hq, K, n_static, static_n, static_chunk,
        HPG=meta.HPG, D=d, MB=meta.MB, MODE=0 if full else 1, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
