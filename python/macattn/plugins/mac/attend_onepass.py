"""MAC complete + amend + append as one scratch-free kernel: the AOT image of ``mac::attend``.

TensorRT's ahead-of-time plugin interface launches one kernel whose parameters are the
plugin's tensors and int32 scalars (no workspace), and Triton's AOT C tool needs a file it
can execute on its own; so this file imports only ``triton`` and the triton-only online-softmax
helpers of ``plugins/triton_softmax.py`` (by path when the C tool runs it alone). One program per
``(request, KV group)`` loads each KV row of its range once for the group's ``HPG`` query
heads (rows of one ``tl.dot``), in two loops that never straddle ``m - r``::

    A = AS_[lo, m-r]  (per-head mask t >= p_h - r + 1; lo = 0 on a miss)
    B = AS_[m-r+1, m]
    entry = cached(p mod K) ⊕ A,  out = entry ⊕ B,  append (q_pre, entry, m) at slot m mod K

The JIT path (``attend_kernel.py``) splits the ranges over many programs and merges in a second
kernel, which long contexts at small batch need; this one is what an AOT plugin can hold.

Parameter order is the plugin's: inputs, int32 scalars, outputs, then constexprs::

    q, q_pre [B, Hq, d], k, v [B, Hkv, T, d], positions [B] i64, match_pos [B, Hq] i64,
    slots [B] i64, qring [S, Hq, K, d], oring [S, Hq, K, d] fp32, ring_lse [S, Hq, K] fp32,
    ring_pos [S, K] i64, B, T, out [B, Hq, d] (q's dtype), qring_out, oring_out,
    ring_lse_out, ring_pos_out (aliases of the four ring inputs: the same buffers)

All tensors contiguous. Grid ``(B, Hkv, 1)``. Semantics: ``macattn.methods.mac.reference.mac_attend_reference``
followed by ``ring_append_reference``.
"""
import triton
import triton.language as tl

try:
    from ..triton_softmax import online_softmax_finish, online_softmax_update
except ImportError:   # run as a lone file (Triton's AOT C tool): load the triton-only helper file by its path
    import importlib.util
    import os

    _spec = importlib.util.spec_from_file_location(
        "macattn_triton_softmax", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                               "triton_softmax.py"))
    _softmax = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_softmax)
    online_softmax_finish, online_softmax_update = _softmax.online_softmax_finish, _softmax.online_softmax_update


@triton.jit
def _attend_range(q, kbase, vbase, t0, t1, lo_h, scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  HPG_M: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax of ``q [HPG_M, D]`` over rows ``[t0, t1)`` with ``t >= lo_h`` per head.
    Returns ``(lse [HPG_M] natural log, -inf if empty; o [HPG_M, D] fp32)``."""
    dd = tl.arange(0, D)
    m_i = tl.full([HPG_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HPG_M], dtype=tl.float32)
    acc = tl.zeros([HPG_M, D], dtype=tl.float32)
    for start in range(t0, t1, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tm = t < t1
        off = t.to(tl.int64)[:, None] * D + dd[None, :]
        k = tl.load(kbase + off, mask=tm[:, None], other=0.0)
        v = tl.load(vbase + off, mask=tm[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
            v = v.to(tl.float32)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        s = tl.where(tm[None, :] & (t[None, :] >= lo_h[:, None]), s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, AXIS=1, BASE2=True)
    return online_softmax_finish(m_i, l_i, acc, BASE2=True)


@triton.jit
def _merge(lse1, o1, lse2, o2):
    """``(lse, o)`` of the union of two disjoint ranges; empty (-inf) sides drop out."""
    mx = tl.maximum(lse1, lse2)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    w1 = tl.exp(lse1 - safe)
    w2 = tl.exp(lse2 - safe)
    w = w1 + w2
    ok = w > 0.0
    lse = tl.where(ok, safe + tl.log(tl.where(ok, w, 1.0)), float("-inf"))
    o = (w1[:, None] * o1 + w2[:, None] * o2) / tl.where(ok, w, 1.0)[:, None]
    return lse, o


@triton.jit
def mac_attend_onepass(
    q_ptr, q_pre_ptr, k_ptr, v_ptr, positions_ptr, match_pos_ptr, slots_ptr,
    qring_ptr, oring_ptr, ring_lse_ptr, ring_pos_ptr,
    B, T,
    out_ptr, qring_out_ptr, oring_out_ptr, ring_lse_out_ptr, ring_pos_out_ptr,
    HQ: tl.constexpr, HKV: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr,
    SCALE_LOG2: tl.constexpr, BLOCK_N: tl.constexpr, HPG_M: tl.constexpr, DOT_F32: tl.constexpr,
):
    HPG: tl.constexpr = HQ // HKV
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    if b >= B:          # the grid is at least 1 wide (TensorRT refuses an empty one): B == 0 does nothing
        return
    r = tl.arange(0, HPG_M)
    rmask = r < HPG
    h = kvh * HPG + r
    dd = tl.arange(0, D)
    m = tl.load(positions_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    mp = tl.load(match_pos_ptr + b * HQ + h, mask=rmask, other=-1).to(tl.int64)
    hit = mp >= 0
    lo_h = tl.where(hit, mp - BAND + 1, 0)
    q = tl.load(q_ptr + (b * HQ + h)[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    kv_off = (b * HKV + kvh) * T * D
    split = m - BAND                                   # last position of part A
    lo = tl.min(tl.where(rmask, lo_h, 1 << 40), axis=0)
    a_lse, a_o = _attend_range(q, k_ptr + kv_off, v_ptr + kv_off, lo.to(tl.int32), (split + 1).to(tl.int32),
                               lo_h, SCALE_LOG2, D, BLOCK_N, HPG_M, DOT_F32)
    b0 = tl.maximum(split + 1, 0)
    b_lse, b_o = _attend_range(q, k_ptr + kv_off, v_ptr + kv_off, b0.to(tl.int32), (m + 1).to(tl.int32),
                               tl.zeros([HPG_M], dtype=tl.int64), SCALE_LOG2, D, BLOCK_N, HPG_M, DOT_F32)
    col = tl.where(hit, mp % K, 0)
    ring_row = (slot * HQ + h) * K
    c_lse = tl.load(ring_lse_ptr + ring_row + col, mask=rmask & hit, other=float("-inf"))
    c_lse = tl.where(hit, c_lse, float("-inf"))
    c_o = tl.load(oring_ptr + (ring_row + col)[:, None] * D + dd[None, :], mask=(rmask & hit)[:, None],
                  other=0.0).to(tl.float32)
    e_lse, e_o = _merge(c_lse, c_o, a_lse, a_o)
    o_lse, o = _merge(e_lse, e_o, b_lse, b_o)
    tl.store(out_ptr + (b * HQ + h)[:, None] * D + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    # the cached entry (slot p mod K, which is m mod K when p = m - K) is read before any thread writes
    tl.debug_barrier()
    colm = m % K
    qp = tl.load(q_pre_ptr + (b * HQ + h)[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
    tl.store(qring_out_ptr + (ring_row + colm)[:, None] * D + dd[None, :], qp.to(qring_out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    tl.store(oring_out_ptr + (ring_row + colm)[:, None] * D + dd[None, :], e_o.to(oring_out_ptr.dtype.element_ty),
             mask=rmask[:, None])
    tl.store(ring_lse_out_ptr + ring_row + colm, e_lse, mask=rmask)
    if kvh == 0:
        tl.store(ring_pos_out_ptr + slot * K + colm, m.to(ring_pos_out_ptr.dtype.element_ty))
