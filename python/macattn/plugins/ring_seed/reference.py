"""Plain-torch reference of ``seed_rows_`` (the definition the Triton launcher is held to, and the path on
the CPU / without triton).

Shapes: ``S`` ring slots, ``Hq`` query heads, ``K`` the ring's window, ``d`` head dim; ``B`` requests, ``L``
prompt tokens, ``n = min(K, L)``.
"""
from __future__ import annotations

import torch

from .checks import check_seed_rows

__all__ = ["seed_rows_reference"]


def seed_rows_reference(qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
                        slots: torch.Tensor | int, q_pre: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Reset and seed ring rows ``slots`` after a fresh prompt of ``L`` tokens, in place.

    Rings: ``qring / oring [S, Hq, K, d]``, ``ring_lse [S, Hq, K]``, ``ring_pos [S, K]`` int64 (any float dtypes).
    ``slots``: ``[B]`` int64 (distinct) on the rings' device, or an int where ``B == 1``. ``q_pre [B, Hq, L, d]``:
    the prompt's pre-RoPE (match) queries; ``o [B, Hq, n, d]``, ``lse [B, Hq, n]``: the rectified summaries of
    positions ``L - n .. L - 1`` (an empty one, ``t - band < 0``, as given: ``o = 0, lse = -inf``). Any strides.

    Column ``c`` of row ``slots[b]`` gets the position ``t`` in ``[L - n, L - 1]`` with ``t mod K == c``:
    ``q = q_pre[b, :, t]`` in qring's dtype, ``o`` / ``lse`` of ``t`` in oring's / ring_lse's dtype, ``pos = t``;
    a column without one (only while ``L < K``) is emptied: ``q = 0, o = 0, lse = -inf, pos = -1``."""
    check_seed_rows(qring, oring, ring_lse, ring_pos, slots, q_pre, o, lse)
    B, _, L, _ = q_pre.shape
    K = qring.shape[2]
    n = min(K, L)
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor([slots], dtype=torch.int64, device=qring.device)
    col = torch.arange(K, device=qring.device)
    t = (L - K) + torch.remainder(col - L, K)               # [K]: the position column c holds (< 0: none)
    valid = t >= 0
    tq = t.clamp(min=0)
    i = (t - (L - n)).clamp(min=0)                          # its index among the last n
    qmask, vmask = valid.view(1, 1, K, 1), valid.view(1, 1, K)
    qring.index_copy_(0, slots, torch.where(qmask, q_pre.index_select(2, tq), 0.0).to(qring.dtype))
    oring.index_copy_(0, slots, torch.where(qmask, o.index_select(2, i).to(oring.dtype), 0.0))
    ring_lse.index_copy_(0, slots, torch.where(vmask, lse.index_select(2, i).to(ring_lse.dtype), float("-inf")))
    ring_pos.index_copy_(0, slots, torch.where(valid, t, -1).view(1, K).expand(B, K))
