"""Input checks of the decode-step kernels, shared by the references and the launchers
(``ValueError`` / ``TypeError`` naming the parameter)."""
from __future__ import annotations

import torch

from macattn.core.validation import check_float, check_int

__all__ = ["check_add_rms_norm", "check_silu_mul", "check_rope_append"]

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _float2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, features], got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float64/float32/float16/bfloat16, got {t.dtype}")


def check_add_rms_norm(x, residual, weight, eps) -> None:
    _float2d("x", x)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, "
                         f"{residual.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [D]=[{x.shape[1]}], got {tuple(weight.shape)}")
    check_float("eps", eps, 0.0, lo_open=True)


def check_silu_mul(gate_up) -> None:
    _float2d("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [R, 2I] (gate, then up), got an odd width {gate_up.shape[1]}")


def check_rope_append(qkv, cos, sin, k_pool, v_pool, write_rows, num_q_heads, num_kv_heads) -> None:
    check_int("num_q_heads", num_q_heads, 1)
    check_int("num_kv_heads", num_kv_heads, 1)
    _float2d("qkv", qkv)
    if k_pool.dim() != 3 or v_pool.shape != k_pool.shape or k_pool.shape[1] != num_kv_heads:
        raise ValueError(f"k_pool / v_pool must both be [P, Hkv={num_kv_heads}, d], got {tuple(k_pool.shape)} / "
                         f"{tuple(v_pool.shape)}")
    if k_pool.dtype != qkv.dtype or v_pool.dtype != qkv.dtype:
        raise TypeError(f"k_pool / v_pool must have qkv's dtype {qkv.dtype}, got {k_pool.dtype} / {v_pool.dtype}")
    B, d = qkv.shape[0], k_pool.shape[2]
    if d % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates halves), got {d}")
    if qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv must be [B, (Hq + 2 Hkv) d] = [B, {(num_q_heads + 2 * num_kv_heads) * d}], got "
                         f"{tuple(qkv.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, d):
            raise ValueError(f"{name} must be [B, d]=[{B}, {d}], got {tuple(t.shape)}")
    if write_rows.shape != (B,) or write_rows.dtype != torch.int64:
        raise ValueError(f"write_rows must be int64 [B]=[{B}], got {write_rows.dtype} {tuple(write_rows.shape)}")
