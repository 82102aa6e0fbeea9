"""Input contract of ``macattn::route_fused_attention``, shared by the Triton launcher (``op.py``),
the reference op (``macattn.methods.mka.ops``) and the TensorRT plugin definition."""
from __future__ import annotations

import torch

__all__ = ["check_route_fused_inputs"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_route_fused_inputs(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta):
    """Raise ``ValueError``/``TypeError`` naming the input whose shape, dtype or value does not fit."""
    if x.dim() != 2:
        raise ValueError(f"x must be [B, D], got shape {tuple(x.shape)}")
    B, D = x.shape
    if q.dim() != 2 or q.shape[0] != B:
        raise ValueError(f"q must be [B={B}, Dq], got shape {tuple(q.shape)}")
    Dq = q.shape[1]
    if w1.dim() != 2 or w1.shape[1] != Dq:
        raise ValueError(f"w1 must be [R, Dq={Dq}], got shape {tuple(w1.shape)}")
    R = w1.shape[0]
    for name, t, shape in (("b1", b1, (R,)), ("w2", w2, (3, R)), ("b2", b2, (3,)), ("gate", gate, ()),
                           ("state_count", state_count, (state_mean.shape[0],)), ("slots", slots, (B,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if state_mean.dim() != 2 or state_mean.shape[1] != D:
        raise ValueError(f"state_mean must be [S, D={D}], got shape {tuple(state_mean.shape)}")
    for name, w, b in (("wk", wk, bk), ("wv", wv, bv)):
        if w.dim() != 2 or w.shape[1] != D:
            raise ValueError(f"{name} must be [N, D={D}], got shape {tuple(w.shape)}")
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"b{name[1]} must be [N={w.shape[0]}], got shape {tuple(b.shape)}")
    for name, t in (("x", x), ("q", q), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("gate", gate),
                    ("wk", wk), ("bk", bk), ("wv", wv), ("bv", bv)):
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")
    if state_mean.dtype != torch.float32:
        raise TypeError(f"state_mean must be float32, got {state_mean.dtype}")
    for name, t in (("state_count", state_count), ("slots", slots)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
    if mode not in (0, 1):
        raise ValueError(f"mode must be 0 (prefix mean) or 1 (EMA), got {mode}")
    if mode == 1 and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) for EMA, got {beta}")
