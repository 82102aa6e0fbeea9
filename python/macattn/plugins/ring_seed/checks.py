"""Input checks of ``seed_rows_``, shared by the reference and the launcher (``ValueError`` / ``TypeError``
naming the parameter). Slot values in a tensor are not range-checked (that would read the device)."""
from __future__ import annotations

import torch

from macattn.core.validation import check_int

__all__ = ["check_seed_rows"]

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def check_seed_rows(qring, oring, ring_lse, ring_pos, slots, q_pre, o, lse) -> None:
    if qring.dim() != 4:
        raise ValueError(f"qring must be [S, Hq, K, d], got shape {tuple(qring.shape)}")
    S, Hq, K, d = qring.shape
    if oring.shape != qring.shape:
        raise ValueError(f"oring must be qring's shape {tuple(qring.shape)}, got {tuple(oring.shape)}")
    if ring_lse.shape != (S, Hq, K):
        raise ValueError(f"ring_lse must be [S, Hq, K]=[{S}, {Hq}, {K}], got {tuple(ring_lse.shape)}")
    if ring_pos.shape != (S, K) or ring_pos.dtype != torch.int64:
        raise ValueError(f"ring_pos must be int64 [S, K]=[{S}, {K}], got {ring_pos.dtype} {tuple(ring_pos.shape)}")
    if q_pre.dim() != 4 or q_pre.shape[1] != Hq or q_pre.shape[3] != d or q_pre.shape[2] < 1:
        raise ValueError(f"q_pre must be [B, Hq={Hq}, L >= 1, d={d}], got {tuple(q_pre.shape)}")
    B, _, L, _ = q_pre.shape
    n = min(K, L)
    if o.shape != (B, Hq, n, d):
        raise ValueError(f"o must be [B, Hq, min(K, L), d]=[{B}, {Hq}, {n}, {d}], got {tuple(o.shape)}")
    if lse.shape != (B, Hq, n):
        raise ValueError(f"lse must be [B, Hq, min(K, L)]=[{B}, {Hq}, {n}], got {tuple(lse.shape)}")
    for name, t in (("qring", qring), ("oring", oring), ("ring_lse", ring_lse), ("q_pre", q_pre), ("o", o),
                    ("lse", lse)):
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float64/float32/float16/bfloat16, got {t.dtype}")
        if t.device != qring.device:
            raise ValueError(f"{name} must be on qring's device {qring.device}, got {t.device}")
    if ring_pos.device != qring.device:
        raise ValueError(f"ring_pos must be on qring's device {qring.device}, got {ring_pos.device}")
    if isinstance(slots, torch.Tensor):
        if slots.shape != (B,) or slots.dtype != torch.int64 or slots.device != qring.device:
            raise ValueError(f"slots must be int64 [B]=[{B}] on {qring.device}, got {slots.dtype} "
                             f"{tuple(slots.shape)} on {slots.device}")
    else:
        check_int("slots", slots, 0, S - 1)
        if B != 1:
            raise ValueError(f"an int slot seeds one row: q_pre must be [1, ...], got B={B}")
