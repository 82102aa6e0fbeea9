"""Launchers of the decode-step kernels (same signatures and results as ``reference.py``; no host
synchronisation, CUDA-graph capturable). Values of ``write_rows`` are not range-checked."""
from __future__ import annotations

import torch
import triton

from .checks import check_add_rms_norm, check_rope_append, check_silu_mul
from .kernel import _add_rms_norm, _rope_append, _silu_mul

__all__ = ["add_rms_norm", "silu_mul", "rope_append"]

_SILU_BLOCK = 1024
# (token, head) pairs per rope_append program at most: 16 heads of d = 128 in bf16 move 4 KB in and 4 KB out
# per program (one pair per one-warp program, 512 B, left a 32K-token prefill at ~4x its bandwidth floor).
# Fewer for a decode step of B < 16 tokens, so it keeps at least Hq + 2 Hkv programs.
_ROPE_ROWS = 16
_alloc = torch.empty   # the tests swap in a NaN-filling allocator to check every output element is written


def _unit_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference.add_rms_norm_reference``: ``(normed [R, D], r [R, D])``, one launch."""
    check_add_rms_norm(x, residual, weight, eps)
    R, D = x.shape
    _unit_stride("x", x)
    out = _alloc(R, D, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res_out = x
    else:
        _unit_stride("residual", residual)
        res_out = _alloc(R, D, dtype=x.dtype, device=x.device)
    if R:
        _add_rms_norm[(R,)](x, residual if residual is not None else x, weight.contiguous(), out, res_out, D,
                            x.stride(0), residual.stride(0) if residual is not None else 0, float(eps),
                            HAS_RES=residual is not None, BLOCK_D=triton.next_power_of_2(D), num_warps=8)
    return out, res_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``reference.silu_mul_reference``: ``[R, I]``, one launch."""
    check_silu_mul(gate_up)
    _unit_stride("gate_up", gate_up)
    R, I2 = gate_up.shape
    out = _alloc(R, I2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    if R and I2:
        _silu_mul[(R, triton.cdiv(I2 // 2, _SILU_BLOCK))](gate_up, out, I2 // 2, gate_up.stride(0),
                                                          BLOCK=_SILU_BLOCK, num_warps=4)
    return out


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, write_rows: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """See ``reference.rope_append_reference``: the rotated queries ``[B, Hq, d]``, one launch."""
    check_rope_append(qkv, cos, sin, k_pool, v_pool, write_rows, num_q_heads, num_kv_heads)
    B = qkv.shape[0]
    d = k_pool.shape[2]
    _unit_stride("qkv", qkv)
    for name, t in (("cos", cos), ("sin", sin), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    q = _alloc(B, num_q_heads, d, dtype=qkv.dtype, device=qkv.device)
    if B:
        half, block_h = d // 2, triton.next_power_of_2(d // 2)
        n = B * (num_q_heads + 2 * num_kv_heads)
        rows = min(_ROPE_ROWS, 1 << (B.bit_length() - 1))       # a power of two <= B
        _rope_append[(triton.cdiv(n, rows),)](
            qkv, cos, sin, q, k_pool, v_pool, write_rows, n, qkv.stride(0), num_q_heads, num_kv_heads,
            HALF=half, BLOCK_H=block_h, ROWS=rows, num_warps=min(8, max(1, rows * block_h // 256)))
    return q
