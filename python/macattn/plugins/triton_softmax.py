"""Online softmax as ``@triton.jit`` helpers shared by the kernels (Triton inlines them).

A running summary ``(m, l, acc)`` of scores ``s`` and values ``v``: ``m`` the running max score,
``l = Σ exp(s - m)``, ``acc = Σ exp(s - m) v``; ``-inf`` scores are masked entries. Each update
rescales by ``exp(m_old - m_new)``; a row whose scores are all ``-inf`` so far keeps
``m = -inf, l = 0, acc = 0`` (the max is replaced by 0 in the exponents, so no ``-inf - -inf``).
``BASE2``: scores in log2 units (scaled by ``log2 e``), ``tl.exp2``; else natural, ``tl.exp``.

Shapes (``AXIS``: the axis of ``s`` along which its entries are summed):

* 2-D ``s [R, N]``, ``AXIS=1`` (attention: ``R`` query rows, ``N`` keys): ``m, l [R]``,
  ``v [N, D]``, ``acc [R, D] += p @ v`` (``tl.dot``);
* 2-D ``s [N, R]``, ``AXIS=0`` (``R`` per-feature rows over ``N`` tokens): ``m, l [R]``,
  ``v [N, D]``, ``acc [R, D] += pᵀ @ v`` (``tl.dot``);
* 1-D ``s [N]``, ``AXIS=0`` (one row): ``m, l`` scalar or ``[1]``, ``v [N, D]``,
  ``acc [D] += Σ_n p_n v_n`` (a broadcast sum, no ``tl.dot``).

``tl.dot`` takes ``p`` in ``v``'s dtype (bf16 ``v``: bf16 ``p``; pass fp32 ``v`` for an fp32
dot) with ``PRECISION`` as its ``input_precision`` (None: Triton's default).

This file imports only ``triton``: the AOT kernel files (``mac/attend_onepass.py``) use it.
"""
import triton
import triton.language as tl

__all__ = ["online_softmax_update", "online_softmax_finish"]


@triton.jit
def _exp(x, BASE2: tl.constexpr):
    if BASE2:
        y = tl.exp2(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v, AXIS: tl.constexpr, BASE2: tl.constexpr,
                          PRECISION: tl.constexpr = None):
    """Fold scores ``s`` (``-inf``: masked) with values ``v`` into ``(m_i, l_i, acc)``; returns the
    new ``(m_i, l_i, acc)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # all -inf so far: exponents of -inf, not NaN
    alpha = _exp(m_i - m_safe, BASE2)                       # 0 while m_i was -inf
    if len(s.shape) == 2:
        p = _exp(s - tl.expand_dims(m_safe, AXIS), BASE2)   # 0 on masked entries
    else:
        p = _exp(s - m_safe, BASE2)
    l_i = l_i * alpha + tl.sum(p, axis=AXIS)
    # the order of the operations below is the kernels' own: it steers Triton's schedule (and so
    # register use: the AXIS=0 order keeps _completion_cache at 72 registers, the other 255)
    if len(s.shape) == 2:
        if AXIS == 1:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
        else:
            acc = acc * alpha[:, None] + tl.dot(tl.trans(p).to(v.dtype), v, input_precision=PRECISION)
    else:
        tl.static_assert(AXIS == 0, "1-D scores are summed along axis 0")
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    return m_new, l_i, acc


@triton.jit
def online_softmax_finish(m_i, l_i, acc, BASE2: tl.constexpr):
    """``(lse, o)`` of a summary: ``lse`` in natural log (``-inf`` for an empty row), ``o = acc / l``
    (``acc`` itself, zeros, for an empty row). ``acc [R, D]`` with ``l [R]``, or ``acc [D]`` with scalar ``l``."""
    ok = l_i > 0.0
    l_safe = tl.where(ok, l_i, 1.0)
    if BASE2:
        lse = tl.where(ok, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    else:
        lse = tl.where(ok, m_i + tl.log(l_safe), float("-inf"))
    if len(acc.shape) == 2:
        o = acc / l_safe[:, None]
    else:
        o = acc / l_safe
    return lse, o
