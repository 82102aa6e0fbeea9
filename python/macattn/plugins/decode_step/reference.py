"""Plain-torch references of the decode-step kernels, with transformers' LLaMA numerics: every
elementwise result rounded to the activations' dtype where transformers rounds it.

Shapes: rows ``R`` (tokens of the step), hidden ``D``, intermediate ``I``, heads ``Hq`` / ``Hkv``
of size ``d``; pool rows ``P``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_add_rms_norm, check_rope_append, check_silu_mul

__all__ = ["add_rms_norm_reference", "silu_mul_reference", "rope_append_reference", "rotate_half"]


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[R, D]``, residual ``[R, D]`` or None, weight ``[D]``: ``r = x + residual`` (``x`` when None)
    in x's dtype; returns ``(weight * rms_norm(r), r)`` (fp32 statistics, the normalised value
    rounded to x's dtype before the weight, as transformers' ``LlamaRMSNorm``)."""
    check_add_rms_norm(x, residual, weight, eps)
    r = x if residual is None else x + residual
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(r.dtype), r


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up ``[R, 2I]`` (gate first) -> ``silu(gate) * up`` ``[R, I]`` in its dtype."""
    check_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_append_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor, write_rows: torch.Tensor, num_q_heads: int,
                          num_kv_heads: int) -> torch.Tensor:
    """qkv ``[B, (Hq + 2 Hkv) d]`` (Q, K, V heads in order), cos/sin ``[B, d]`` in qkv's dtype,
    pools ``[P, Hkv, d]``, write_rows ``[B]`` int64. Writes the rotated keys and the values to
    ``k_pool[write_rows[b]]`` / ``v_pool[write_rows[b]]``; returns the rotated queries ``[B, Hq, d]``."""
    check_rope_append(qkv, cos, sin, k_pool, v_pool, write_rows, num_q_heads, num_kv_heads)
    B = qkv.shape[0]
    d = k_pool.shape[-1]
    heads = qkv.view(B, num_q_heads + 2 * num_kv_heads, d)
    q, k, v = heads.split((num_q_heads, num_kv_heads, num_kv_heads), dim=1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    k_pool.index_copy_(0, write_rows, k.to(k_pool.dtype))
    v_pool.index_copy_(0, write_rows, v.to(v_pool.dtype))
    return q
