"""Triton kernels of retrieval-completion (SPEC §3); the math is ``macattn.completion``'s.

Per-row ranges (``N = n_prefill[b]``, ``L = seq_lens[b]``): mid ``[s0, m1)`` with
``s0 = min(n_sink, N)``, ``m1 = max(s0, N - n_tail)``; exact anchors ``[0, s0) ∪ [m1, L)``.

* ``_completion_cache``: grid ``(B, Hkv)``. One pass over the mid tokens with a running
  per-feature max (like online softmax, per feature): ``c_f`` grows, ``b_f`` / ``A_f`` are rescaled
  by ``exp(c_old - c_new)``; ``A += Wᵀ V`` by ``tl.dot`` (fp32, IEEE).
* ``_mid_logits``: grid ``(B·Hkv, cdiv(T, BLOCK_T))``. ``scale·q·k_t`` of the ``GROUP`` query
  heads of a KV head for one tile of keys (each key tile read once per group); ``-inf`` outside
  the row's mid. The launcher takes ``torch.topk`` of these per query head.
* ``_decode_step``: grid ``(B, Hq)``. Online softmax over the anchors (contiguous tiles) and the
  retrieved positions (gathered tiles; a position outside the row's mid is padding and skipped),
  accumulating for the same retrieved tokens ``Σ w`` and ``Wᵀ V`` of the subtraction; then the
  clamped subtraction, the completion weights ``exp(a_f + log b'_f - m)`` and one normalisation.
  The completion term is skipped when ``top_k >= |M|`` (the step is exact, as in the reference).

All accumulation is fp32. Positions index ``T`` with ``int64`` offsets.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_completion_cache", "_mid_logits", "_decode_step"]


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
        c_new = tl.maximum(c, tl.max(lp, axis=0))
        c_safe = tl.where(c_new == float("-inf"), 0.0, c_new)
        alpha = tl.exp(c - c_safe)                       # 0 while c was -inf
        w = tl.exp(lp - c_safe[None, :])                 # [BLOCK_T, F_P], 0 on padding
        bs = bs * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[:, None] + tl.dot(tl.trans(w), v, input_precision="ieee")
        c = c_new
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
def _decode_step(q_ptr, k_ptr, v_ptr, sl_ptr, npf_ptr, lpq_ptr, lpk_ptr, a_ptr, b_ptr, shift_ptr, idx_ptr, out_ptr,
                 s_kb, s_kh, s_kt, s_lb, s_lh, s_lt, HQ, HKV, D, F, K, n_sink, n_tail, top_k, scale,
                 GROUP: tl.constexpr, D_P: tl.constexpr, F_P: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = h // GROUP
    row = b * HQ + h
    s0, m1 = _mid_range(npf_ptr, b, n_sink, n_tail)
    L = tl.load(sl_ptr + b).to(tl.int32)
    mid = m1 - s0
    use_comp = tl.minimum(top_k, mid) < mid
    dd = tl.arange(0, D_P)
    dm = dd < D
    ff = tl.arange(0, F_P)
    fm = ff < F
    q = tl.load(q_ptr + row * D + dd, mask=dm, other=0.0).to(tl.float32)
    k_base = k_ptr + b * s_kb + g * s_kh
    v_base = v_ptr + b * s_kb + g * s_kh
    lpk_base = lpk_ptr + b * s_lb + g * s_lh

    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_P], tl.float32)
    # anchors: sink [0, s0) then tail + generated [m1, L), as one loop over a virtual range
    n_anchor = s0 + (L - m1)
    for j0 in range(0, n_anchor, BLOCK_T):
        jj = j0 + tl.arange(0, BLOCK_T)
        jm = jj < n_anchor
        tt = tl.where(jj < s0, jj, jj - s0 + m1).to(tl.int64)
        k = tl.load(k_base + tt[:, None] * s_kt + dd[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        v = tl.load(v_base + tt[:, None] * s_kt + dd[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        s = tl.where(jm, tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    # retrieved tokens: exact attention + what the subtraction removes from the cache
    sub_b = tl.zeros([F_P], tl.float32)
    sub_a = tl.zeros([F_P, D_P], tl.float32)
    shift = tl.load(shift_ptr + (b * HKV + g) * F + ff, mask=fm, other=0.0)
    for j0 in range(0, K, BLOCK_K):
        jj = j0 + tl.arange(0, BLOCK_K)
        pos = tl.load(idx_ptr + row * K + jj, mask=jj < K, other=-1)
        jm = (jj < K) & (pos >= s0) & (pos < m1)
        tt = tl.where(jm, pos, 0).to(tl.int64)
        k = tl.load(k_base + tt[:, None] * s_kt + dd[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        v = tl.load(v_base + tt[:, None] * s_kt + dd[None, :], mask=jm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        s = tl.where(jm, tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        if use_comp:
            lp = tl.load(lpk_base + tt[:, None] * s_lt + ff[None, :], mask=jm[:, None] & fm[None, :],
                         other=float("-inf"))
            w = tl.exp(lp - shift[None, :])                  # [BLOCK_K, F_P], 0 on padding
            sub_b += tl.sum(w, axis=0)
            sub_a += tl.dot(tl.trans(w), v, input_precision="ieee")

    num = acc
    den = l_i
    if use_comp:
        cb = tl.load(b_ptr + (b * HKV + g) * F + ff, mask=fm, other=0.0)
        b2 = tl.maximum(cb - sub_b, 0.0)
        live = fm & (b2 > 0)
        ca = tl.load(a_ptr + (b * HKV + g) * F * D + ff[:, None] * D + dd[None, :], mask=fm[:, None] & dm[None, :],
                     other=0.0)
        a2 = ca - sub_a
        lpq = tl.load(lpq_ptr + row * F + ff, mask=fm, other=0.0)
        la = tl.where(live, lpq + shift + tl.log(tl.where(live, b2, 1.0)), float("-inf"))
        m_c = tl.max(la, axis=0)
        m_new = tl.maximum(m_i, m_c)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        wc = tl.exp(la - m_safe)                              # 0 where b'_f = 0
        mean_v = a2 / tl.where(live, b2, 1.0)[:, None]
        num = acc * alpha + tl.sum(wc[:, None] * mean_v, axis=0)
        den = l_i * alpha + tl.sum(wc, axis=0)
    den_s = tl.sum(den, axis=0)
    out = tl.where(den_s > 0, num / tl.where(den_s > 0, den_s, 1.0), 0.0)
    tl.store(out_ptr + row * D + dd, out.to(out_ptr.dtype.element_ty), mask=dm)
