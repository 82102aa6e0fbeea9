"""Ring seeding after prefill (SPEC §1.4) written with traceable tensor ops only.

``MacState.seed`` (the eager path) loops over requests in Python; this module computes
the same ring contents as whole ring rows so ``torch.export`` / ONNX see one static
graph with dynamic batch and prompt length. Prompt length ``L`` is shared by the batch
(no padding); the prompt occupies positions ``0 .. L-1``.

Shapes (``B`` requests, ``S`` ring slots, ``Hq`` query heads, ``Hkv`` KV heads, ``K``
the layer's window, ``d`` head dim):

* ``query`` ``[B, Hq, L, d]`` post-RoPE, ``q_pre`` ``[B, Hq, L, d]`` pre-RoPE,
  ``key``/``value`` ``[B, Hkv, L, d]``.
* rings ``qring [S, Hq, K, d]``, ``oring [S, Hq, K, d]``, ``ring_lse [S, Hq, K]`` fp32,
  ``ring_pos [S, K]`` int64; ``slots [B]`` int64 (distinct).

Column ``c`` of a seeded row holds the prompt position ``t`` in ``[L - n, L - 1]``
(``n = min(K, L)``) with ``t mod K == c``; columns without one are empty
(``q = 0, o = 0, lse = -inf, pos = -1``), i.e. the row is reset and seeded at once.
"""
from __future__ import annotations

import torch

from macattn.core.attention import expand_kv_heads
from macattn.core.summaries import summarize

__all__ = ["seeded_ring_rows", "seed_rings_"]


def seeded_ring_rows(query: torch.Tensor, q_pre: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                     window: int, band: int, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh ring rows of ``B`` requests after a prefill of ``L`` tokens.

    Returns ``(q_rows [B, Hq, K, d] (q_pre's dtype), o_rows [B, Hq, K, d] fp32,
    lse_rows [B, Hq, K] fp32, pos_rows [B, K] int64)``; entry ``t`` holds the rectified
    summary ``AS^{(t)}_{[0, t - band]}`` of query ``t`` (empty where ``t - band < 0``).
    """
    if query.dim() != 4 or q_pre.shape != query.shape:
        raise ValueError(f"query and q_pre must both be [B, Hq, L, d], got {tuple(query.shape)} "
                         f"and {tuple(q_pre.shape)}")
    B, Hq, L, d = query.shape
    K = int(window)
    col = torch.arange(K, device=query.device)
    first = col.new_full((), 0) + (L - K)                            # position of the oldest kept entry
    t_col = first + torch.remainder(col - first, K)                  # [K]: position held by column c
    valid = t_col >= 0                                               # False only while L < K
    idx = torch.where(valid, t_col, torch.zeros_like(t_col))
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    kf = expand_kv_heads(key, Hq).to(acc)
    vf = expand_kv_heads(value, Hq).to(acc)
    q_sel = query.index_select(2, idx).to(acc)                       # [B, Hq, K, d]
    logits = torch.einsum("bhnd,bhtd->bhnt", q_sel, kf) * scale     # [B, Hq, K, L]
    t = torch.arange(L, device=query.device)
    mask = t.view(1, -1) <= (t_col.view(-1, 1) - band)              # [K, L]
    summ = summarize(logits, vf.unsqueeze(2), mask)                 # o [B, Hq, K, d], lse [B, Hq, K]
    q_rows = torch.where(valid.view(1, 1, K, 1), q_pre.index_select(2, idx), 0.0)
    o_rows = torch.where(valid.view(1, 1, K, 1), summ.o.float(), 0.0)
    lse_rows = torch.where(valid.view(1, 1, K), summ.lse.float(), float("-inf"))
    pos_rows = torch.where(valid, t_col, -1).view(1, K).expand(B, K)
    return q_rows, o_rows, lse_rows, pos_rows


def seed_rings_(rings, slots: torch.Tensor, query: torch.Tensor, q_pre: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, *, band: int, scale: float) -> None:
    """Write fresh seeded rows into ``rings = (qring, oring, ring_lse, ring_pos)`` at ``slots``, in place."""
    qring, oring, ring_lse, ring_pos = rings
    q_rows, o_rows, lse_rows, pos_rows = seeded_ring_rows(query, q_pre, key, value, window=qring.shape[2],
                                                          band=band, scale=scale)
    qring.index_copy_(0, slots, q_rows.to(qring.dtype))
    oring.index_copy_(0, slots, o_rows.to(oring.dtype))
    ring_lse.index_copy_(0, slots, lse_rows.to(ring_lse.dtype))
    ring_pos.index_copy_(0, slots, pos_rows.to(ring_pos.dtype))
