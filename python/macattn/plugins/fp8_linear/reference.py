"""Plain-torch weight-only FP8 (any device): per-output-channel E4M3 quantisation and the product it
defines.

Shapes: weight ``[N, K]`` (N output channels), activations ``[..., K]``, scale ``[N]`` fp32, with
``w[n] ~= wq[n].float() * scale[n]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_fp8_linear

__all__ = ["quantize_fp8_weight", "dequantize_fp8_weight", "fp8_linear_reference", "FP8_MAX"]

FP8_MAX = 448.0   # the largest finite E4M3 value, torch.finfo(torch.float8_e4m3fn).max

_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` fp32/fp16/bf16, finite, N, K >= 1 -> ``(wq [N, K] torch.float8_e4m3fn, scale [N] fp32)``.

    ``scale[n] = amax|w[n]| / 448`` (1 for an all-zero row, so never 0, NaN or inf); ``wq[n]`` is
    ``w[n] / scale[n]`` (in fp32, clamped to +-448) rounded to the nearest E4M3 value. Error bound
    per element, from E4M3's 3 mantissa bits (spacing ``2^(e-3)`` on ``[2^e, 2^(e+1))``, ``e >= -6``;
    subnormal spacing ``2^-9``): ``|w - wq*scale| <= max(2^-4 |w|, 2^-10 scale)`` (up to fp32
    rounding), hence at most ``2^-4`` of the row's amax; the row's amax itself maps to 448 exactly.
    Load-time work: one fp32 temporary of w's size (a host sync for the finiteness check).
    """
    if w.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"w must be float32/float16/bfloat16, got {w.dtype}")
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"w must be a 2-D weight [N, K] with N, K >= 1, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w must be finite (it holds NaN or inf)")
    scale = w.abs().amax(dim=1).float() / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    wq = torch.div(w, scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return wq, scale


def dequantize_fp8_weight(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``wq [N, K]`` float8_e4m3fn, ``scale [N]`` fp32 -> ``(wq.float() * scale[:, None]).to(dtype)`` ``[N, K]``."""
    return (wq.float() * scale[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` fp32/fp16/bf16 -> ``[..., N]`` in x's dtype:
    ``(x.float() @ (wq.float() * scale[:, None]).T (+ bias.float())).to(x.dtype)``, all in fp32."""
    check_fp8_linear(x, wq, scale, bias)
    y = F.linear(x.float(), dequantize_fp8_weight(wq, scale, torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype)
