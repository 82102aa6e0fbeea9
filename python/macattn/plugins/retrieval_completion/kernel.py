"""Triton kernels of retrieval-completion (docs/spec.md §3); the math is ``macattn.methods.completion.reference``'s.

Per-row ranges (``N = n_prefill[b]``, ``L = seq_lens[b]``): mid ``[s0, m1)`` with
``s0 = min(n_sink, N)``, ``m1 = max(s0, N - n_tail)``; exact anchors ``[0, s0) ∪ [m1, L)``.

* ``_completion_cache``: grid ``(B, Hkv)``. One pass over the mid tokens with a running
  per-feature max (like online softmax, per feature): ``c_f`` grows, ``b_f`` / ``A_f`` are rescaled
  by ``exp(c_old - c_new)``; ``A += Wᵀ V`` by ``tl.dot`` (fp32, IEEE).
* ``_mid_logits``: grid ``(B·Hkv, cdiv(T, BLOCK_T))``. ``scale·q·k_t`` of the ``GROUP`` query
  heads of a KV head for one tile of keys (each key tile read once per group); ``-inf`` outside
  the row's mid. The launcher takes ``torch.topk`` of these per query head.
* ``_decode_partial``: grid ``(B, Hq, S)``. The anchors and then the retrieved positions form one
  item list per query head, cut into ``S`` chunks (split-K: a request's few query heads alone
  would leave most SMs idle). Per chunk: online softmax partials ``(m, l, acc)`` over its items
  (gathered rows; a retrieved position outside the row's mid is padding and skipped) and, for its
  retrieved tokens, the subtraction partials ``Σ w`` and ``Wᵀ V`` (``tl.dot``, fp32 IEEE).
  Where the rows live is the caller's (constexprs): the retrieved positions are per query head
  (``IDX_GROUP = 1``, Top-k) or per KV head (``IDX_GROUP = GROUP``, pages); anchors at their
  positions of the cache, or stored in item order (``ANCHOR_COMPACT``: sinks then tail + generated,
  the offloaded decode's device rows); retrieved tokens read from the cache at their positions, or
  from a buffer of their own at the rows ``rows_ptr`` gives (``RET_ROWS``: the offloaded decode's
  hot-page cache).
* ``decode_partial_pages``: grid ``(B, Hkv, S)``. The page selector's tail on a GPU-resident cache:
  one program takes a KV head's ``GROUP`` query heads together (each key and value row read once per
  group; ``q Kᵀ`` and ``P V`` by ``tl.dot``) over the anchors and the tokens of the KV head's selected
  pages (``pages [B, Hkv, NP]``, positions computed in the kernel), and the subtraction partials once
  per KV head (the pages, and so the subtracted tokens, are the group's).
* ``decode_merge``: grid ``(B, Hq)``. Merges the ``S`` partials (subtraction partials per query head,
  or per KV head with ``SUB_KV``; ``UNROLL`` of them loaded at a time), subtracts from the cache with the
  clamp, adds the completion weights ``exp(a_f + log b'_f - m)`` and normalises once. The
  completion term is skipped when the retrieved set covers the mid (``_use_completion``; the step
  is exact, as in the reference).

All accumulation is fp32. Positions index ``T`` with ``int64`` offsets.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_softmax import online_softmax_update

__all__ = ["_completion_cache", "_mid_logits", "_decode_partial", "decode_partial_pages", "decode_merge",
           "_use_completion"]


@triton.jit
def _mid_range(n_prefill_ptr, b, n_sink, n_tail):
    n = tl.load(n_prefill_ptr + b).to(tl.int32)
    s0 = tl.minimum(n_sink, n)
    m1 = tl.maximum(s0, n - n_tail)
    return s0, m1


@triton.jit
def _completion_cache(lpk_ptr, v_ptr, npf_ptr, a_ptr, b_ptr, shift_ptr,
                      s_lb, s_lh, s_lt, s_vb, s_vh, s_vt, H, F, D, n_sink, n_tail,
                      F_P: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s0, m1 = _mid_range(npf_ptr, b, n_sink, n_tail)
    ff = tl.arange(0, F_P)
    dd = tl.arange(0, D_P)
    fm = ff < F
    dm = dd < D
    c = tl.full([F_P], float("-inf"), tl.float32)
    bs = tl.zeros([F_P], tl.float32)
    acc = tl.zeros([F_P, D_P], tl.float32)
    lpk_base = lpk_ptr + b * s_lb + h * s_lh
    v_base = v_ptr + b * s_vb + h * s_vh
    for t0 in range(s0, m1, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        tm = tt < m1
        lp = tl.load(lpk_base + tt[:, None].to(tl.int64) * s_lt + ff[None, :], mask=tm[:, None] & fm[None, :],
                     other=float("-inf"))
        v = tl.load(v_base + tt[:, None].to(tl.int64) * s_vt + dd[None, :], mask=tm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        # per feature f: c_f running max of lp[:, f], bs_f = Σ exp(lp - c_f), A_f += exp(lp - c_f)ᵀ V (fp32, IEEE)
        c, bs, acc = online_softmax_update(c, bs, acc, lp, v, AXIS=0, BASE2=False, PRECISION="ieee")
    shift = tl.where(c == float("-inf"), 0.0, c)
    row = b * H + h
    tl.store(a_ptr + row * F * D + ff[:, None] * D + dd[None, :], acc, mask=fm[:, None] & dm[None, :])
    tl.store(b_ptr + row * F + ff, bs, mask=fm)
    tl.store(shift_ptr + row * F + ff, shift, mask=fm)


@triton.jit
def _mid_logits(q_ptr, k_ptr, npf_ptr, out_ptr, s_kb, s_kh, s_kt, HKV, T, D, n_sink, n_tail, scale,
                GROUP: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr,
                IEEE: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HKV
    g = bh % HKV
    tt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    s0, m1 = _mid_range(npf_ptr, b, n_sink, n_tail)
    gg = tl.arange(0, G_P)
    gm = gg < GROUP
    rows = (b * HKV + g) * GROUP + gg                     # query heads of KV head g: rows of [B·Hq]
    out_ptrs = out_ptr + rows[:, None] * T + tt[None, :]
    out_mask = gm[:, None] & (tt[None, :] < T)
    t_lo = tl.program_id(1) * BLOCK_T
    if (t_lo + BLOCK_T <= s0) | (t_lo >= m1):
        tl.store(out_ptrs, tl.full([G_P, BLOCK_T], float("-inf"), tl.float32), mask=out_mask)
    else:
        dd = tl.arange(0, D_P)
        dm = dd < D
        tm = (tt >= s0) & (tt < m1)
        q = tl.load(q_ptr + rows[:, None] * D + dd[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        k = tl.load(k_ptr + b * s_kb + g * s_kh + tt[:, None].to(tl.int64) * s_kt + dd[None, :],
                    mask=tm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                    # fp16/bf16 products are exact in the fp32 accumulator
        s = tl.where(tm[None, :], s * scale, float("-inf"))
        tl.store(out_ptrs, s, mask=out_mask)


@triton.jit
def _use_completion(s0, m1, top_k, PAGE: tl.constexpr):
    """Whether the retrieved set misses part of the mid ``[s0, m1)`` (else the step is exact): Top-k
    tokens (``PAGE = 0``): ``top_k < m1 - s0``; pages (``top_k`` pages of ``PAGE`` tokens on absolute
    positions, the selectable ones those overlapping the mid): ``top_k`` < their count."""
    if PAGE == 0:
        use = top_k < m1 - s0
    else:
        use = (m1 > s0) & (top_k < (m1 + PAGE - 1) // PAGE - s0 // PAGE)
    return use


@triton.jit
def _decode_partial(q_ptr, k_ptr, v_ptr, sl_ptr, npf_ptr, kr_ptr, vr_ptr, lpk_ptr, shift_ptr, idx_ptr, rows_ptr,
                    pm_ptr, pl_ptr, pacc_ptr, psb_ptr, psa_ptr,
                    s_kb, s_kh, s_kt, s_rb, s_rh, s_rt, s_lb, s_lh, s_lt, s_ib, s_ih,
                    HQ, HKV, D, F, K, n_sink, n_tail, top_k, scale,
                    GROUP: tl.constexpr, IDX_GROUP: tl.constexpr, PAGE: tl.constexpr, RET_ROWS: tl.constexpr,
                    ANCHOR_COMPACT: tl.constexpr, D_P: tl.constexpr, F_P: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    n_split = tl.num_programs(2)
    g = h // GROUP
    row = b * HQ + h
    s0, m1 = _mid_range(npf_ptr, b, n_sink, n_tail)
    L = tl.load(sl_ptr + b).to(tl.int32)
    use_comp = _use_completion(s0, m1, top_k, PAGE)
    dd = tl.arange(0, D_P)
    dm = dd < D
    ff = tl.arange(0, F_P)
    fm = ff < F
    q = tl.load(q_ptr + row * D + dd, mask=dm, other=0.0).to(tl.float32)
    k_base = k_ptr + b * s_kb + g * s_kh
    v_base = v_ptr + b * s_kb + g * s_kh
    kr_base = kr_ptr + b * s_rb + g * s_rh
    vr_base = vr_ptr + b * s_rb + g * s_rh
    lpk_base = lpk_ptr + b * s_lb + g * s_lh
    idx_base = b * s_ib + (h // IDX_GROUP) * s_ih
    shift = tl.load(shift_ptr + (b * HKV + g) * F + ff, mask=fm, other=0.0)

    # items: the anchors [0, s0) ∪ [m1, L), then the K retrieved slots; this split takes one chunk
    n_anchor = s0 + (L - m1)
    n_items = n_anchor + K
    chunk = tl.cdiv(tl.cdiv(n_items, n_split), BLOCK_K) * BLOCK_K
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, n_items)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_P], tl.float32)
    sub_b = tl.zeros([F_P], tl.float32)
    sub_a = tl.zeros([F_P, D_P], tl.float32)
    for j0 in range(lo, hi, BLOCK_K):
        jj = j0 + tl.arange(0, BLOCK_K)
        inb = jj < hi
        is_ret = inb & (jj >= n_anchor)
        pos = tl.load(idx_ptr + idx_base + (jj - n_anchor), mask=is_ret, other=-1)
        is_ret = is_ret & (pos >= s0) & (pos < m1)          # padding picks / tokens of a page outside the mid drop out
        is_anc = inb & (jj < n_anchor)
        if ANCHOR_COMPACT:                                   # anchors stored in item order: row = item
            ta = tl.where(is_anc, jj, 0).to(tl.int64)
        else:                                                # anchors at their positions
            ta = tl.where(is_anc, tl.where(jj < s0, jj, jj - s0 + m1), 0).to(tl.int64)
        if RET_ROWS:                                         # retrieved rows of their own buffer
            tr = tl.load(rows_ptr + idx_base + (jj - n_anchor), mask=is_ret, other=0).to(tl.int64)
        else:
            tr = tl.where(is_ret, pos, 0).to(tl.int64)
        valid = is_anc | is_ret
        if ANCHOR_COMPACT or RET_ROWS:                       # two buffers: one masked load from each
            ka = tl.load(k_base + ta[:, None] * s_kt + dd[None, :], mask=is_anc[:, None] & dm[None, :], other=0.0)
            va = tl.load(v_base + ta[:, None] * s_kt + dd[None, :], mask=is_anc[:, None] & dm[None, :], other=0.0)
            kr = tl.load(kr_base + tr[:, None] * s_rt + dd[None, :], mask=is_ret[:, None] & dm[None, :], other=0.0)
            vr = tl.load(vr_base + tr[:, None] * s_rt + dd[None, :], mask=is_ret[:, None] & dm[None, :], other=0.0)
            k = tl.where(is_ret[:, None], kr.to(tl.float32), ka.to(tl.float32))
            v = tl.where(is_ret[:, None], vr.to(tl.float32), va.to(tl.float32))
        else:                                                # one cache (kr is k): one gather
            tt = tl.where(is_ret, tr, ta)
            k = tl.load(k_base + tt[:, None] * s_kt + dd[None, :], mask=valid[:, None] & dm[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(v_base + tt[:, None] * s_kt + dd[None, :], mask=valid[:, None] & dm[None, :],
                        other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, AXIS=0, BASE2=False)
        if use_comp:
            lp = tl.load(lpk_base + tr[:, None] * s_lt + ff[None, :], mask=is_ret[:, None] & fm[None, :],
                         other=float("-inf"))
            w = tl.exp(lp - shift[None, :])                  # [BLOCK_K, F_P], 0 off the retrieved tokens
            sub_b += tl.sum(w, axis=0)
            sub_a += tl.dot(tl.trans(w), v, input_precision="ieee")
    part = row * n_split + sp
    tl.store(pm_ptr + part + tl.arange(0, 1), m_i)
    tl.store(pl_ptr + part + tl.arange(0, 1), l_i)
    tl.store(pacc_ptr + part * D + dd, acc, mask=dm)
    if use_comp:
        tl.store(psb_ptr + part * F + ff, sub_b, mask=fm)
        tl.store(psa_ptr + part * F * D + ff[:, None] * D + dd[None, :], sub_a, mask=fm[:, None] & dm[None, :])


@triton.jit
def decode_partial_pages(q_ptr, k_ptr, v_ptr, sl_ptr, npf_ptr, lpk_ptr, shift_ptr, pages_ptr,
                          pm_ptr, pl_ptr, pacc_ptr, psb_ptr, psa_ptr,
                          s_kb, s_kh, s_kt, s_lb, s_lh, s_lt, s_pb, s_ph,
                          HQ, HKV, D, F, NP, n_sink, n_tail, scale,
                          GROUP: tl.constexpr, G_P: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
                          D_P: tl.constexpr, F_P: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    n_split = tl.num_programs(2)
    s0, m1 = _mid_range(npf_ptr, b, n_sink, n_tail)
    L = tl.load(sl_ptr + b).to(tl.int32)
    use_comp = _use_completion(s0, m1, NP, PAGE)
    dd = tl.arange(0, D_P)
    dm = dd < D
    ff = tl.arange(0, F_P)
    fm = ff < F
    gg = tl.arange(0, G_P)
    gm = gg < GROUP
    rows = b * HQ + g * GROUP + gg                          # the group's query heads: rows of [B·Hq]
    q = tl.load(q_ptr + rows[:, None] * D + dd[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    k_base = k_ptr + b * s_kb + g * s_kh
    v_base = v_ptr + b * s_kb + g * s_kh
    lpk_base = lpk_ptr + b * s_lb + g * s_lh
    page_base = pages_ptr + b * s_pb + g * s_ph
    shift = tl.load(shift_ptr + (b * HKV + g) * F + ff, mask=fm, other=0.0)

    n_anchor = s0 + (L - m1)
    n_items = n_anchor + NP * PAGE
    chunk = tl.cdiv(tl.cdiv(n_items, n_split), BLOCK_K) * BLOCK_K
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, n_items)
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    sub_b = tl.zeros([F_P], tl.float32)
    sub_a = tl.zeros([F_P, D_P], tl.float32)
    for j0 in range(lo, hi, BLOCK_K):
        jj = j0 + tl.arange(0, BLOCK_K)
        inb = jj < hi
        is_anc = inb & (jj < n_anchor)
        r = tl.where(inb & (jj >= n_anchor), jj - n_anchor, 0)
        page = tl.load(page_base + r // PAGE, mask=inb & (jj >= n_anchor), other=-1)
        pos = page * PAGE + r % PAGE
        is_ret = inb & (jj >= n_anchor) & (page >= 0) & (pos >= s0) & (pos < m1)
        ta = tl.where(jj < s0, jj, jj - s0 + m1)
        tt = tl.where(is_ret, pos, tl.where(is_anc, ta, 0)).to(tl.int64)
        valid = is_anc | is_ret
        k = tl.load(k_base + tt[:, None] * s_kt + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        v = tl.load(v_base + tt[:, None] * s_kt + dd[None, :], mask=valid[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        if PRECISION == "ieee":                              # fp32 inputs, or the interpreter (no bf16 dot)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:                                                # bf16 / fp16 products are exact in fp32
            s = tl.dot(q.to(k.dtype), tl.trans(k))           # [G_P, BLOCK_K]
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, AXIS=1, BASE2=False, PRECISION=PRECISION)
        if use_comp:
            lp = tl.load(lpk_base + tt[:, None] * s_lt + ff[None, :], mask=is_ret[:, None] & fm[None, :],
                         other=float("-inf"))
            w = tl.exp(lp - shift[None, :])                  # [BLOCK_K, F_P], 0 off the retrieved tokens
            sub_b += tl.sum(w, axis=0)
            sub_a += tl.dot(tl.trans(w), v, input_precision=PRECISION)
    part = rows * n_split + sp
    tl.store(pm_ptr + part, m_i, mask=gm)
    tl.store(pl_ptr + part, l_i, mask=gm)
    tl.store(pacc_ptr + part[:, None] * D + dd[None, :], acc, mask=gm[:, None] & dm[None, :])
    if use_comp:
        kv_part = (b * HKV + g) * n_split + sp
        tl.store(psb_ptr + kv_part * F + ff, sub_b, mask=fm)
        tl.store(psa_ptr + kv_part * F * D + ff[:, None] * D + dd[None, :], sub_a, mask=fm[:, None] & dm[None, :])


@triton.jit
def decode_merge(npf_ptr, lpq_ptr, a_ptr, b_ptr, shift_ptr, pm_ptr, pl_ptr, pacc_ptr, psb_ptr, psa_ptr, out_ptr,
                  HQ, HKV, D, F, n_sink, n_tail, top_k, N_SPLIT,
                  GROUP: tl.constexpr, PAGE: tl.constexpr, D_P: tl.constexpr, F_P: tl.constexpr,
                  S_P: tl.constexpr, SUB_KV: tl.constexpr = False, UNROLL: tl.constexpr = 1):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = h // GROUP
    row = b * HQ + h
    s0, m1 = _mid_range(npf_ptr, b, n_sink, n_tail)
    use_comp = _use_completion(s0, m1, top_k, PAGE)
    dd = tl.arange(0, D_P)
    dm = dd < D
    ff = tl.arange(0, F_P)
    fm = ff < F
    ss = tl.arange(0, S_P)
    sm = ss < N_SPLIT
    part = row * N_SPLIT + ss
    pm = tl.load(pm_ptr + part, mask=sm, other=float("-inf"))
    pl = tl.load(pl_ptr + part, mask=sm, other=0.0)
    m_e = tl.max(pm, axis=0)
    m_es = tl.where(m_e == float("-inf"), 0.0, m_e)
    wt = tl.exp(pm - m_es)                                   # 0 for empty splits
    l_i = tl.sum(wt * pl, axis=0)
    pacc = tl.load(pacc_ptr + part[:, None] * D + dd[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    num = tl.sum(wt[:, None] * pacc, axis=0)
    den = l_i
    if use_comp:
        sub_b = tl.zeros([F_P], tl.float32)
        a2 = tl.load(a_ptr + (b * HKV + g) * F * D + ff[:, None] * D + dd[None, :], mask=fm[:, None] & dm[None, :],
                     other=0.0)
        if SUB_KV:
            sub_row = b * HKV + g
        else:
            sub_row = row
        for sp0 in range(0, N_SPLIT, UNROLL):
            for u in tl.static_range(UNROLL):                # UNROLL independent loads in flight, not a chain
                sp = sp0 + u
                pp = sub_row * N_SPLIT + sp
                fok = fm & ((ff * 0 + sp) < N_SPLIT)         # a vector mask (scalar & vector: int64 in the interpreter)
                sub_b += tl.load(psb_ptr + pp * F + ff, mask=fok, other=0.0)
                a2 -= tl.load(psa_ptr + pp * F * D + ff[:, None] * D + dd[None, :], mask=fok[:, None] & dm[None, :],
                              other=0.0)
        cb = tl.load(b_ptr + (b * HKV + g) * F + ff, mask=fm, other=0.0)
        b2 = cb - sub_b
        live = fm & (b2 > 0)                                 # the clamp: b' <= 0 drops the feature (A' = 0)
        shift = tl.load(shift_ptr + (b * HKV + g) * F + ff, mask=fm, other=0.0)
        lpq = tl.load(lpq_ptr + row * F + ff, mask=fm, other=0.0)
        la = tl.where(live, lpq + shift + tl.log(tl.where(live, b2, 1.0)), float("-inf"))
        # one more online-softmax step: the live features' completion terms, values A'_f / b'_f
        _, den, num = online_softmax_update(m_e, l_i, num, la, a2 / tl.where(live, b2, 1.0)[:, None],
                                            AXIS=0, BASE2=False)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + row * D + dd, out.to(out_ptr.dtype.element_ty), mask=dm)
