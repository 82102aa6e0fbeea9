"""Input contract of the weight-only FP8 linear, shared by the reference (``reference.py``) and the
launcher (``op.py``): ``TypeError`` for a wrong dtype, ``ValueError`` for a wrong shape or device,
each naming the parameter and what it accepts."""
from __future__ import annotations

import torch

__all__ = ["check_fp8_linear", "ACTIVATION_DTYPES"]

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_fp8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``x [..., K]`` fp32/fp16/bf16; ``wq [N, K]`` torch.float8_e4m3fn with N, K >= 1; ``scale [N]`` fp32;
    ``bias [N]`` fp32/fp16/bf16 or None; all on x's device."""
    if wq.dtype != torch.float8_e4m3fn:
        raise TypeError(f"wq must be a torch.float8_e4m3fn weight [N, K], got {wq.dtype}")
    if wq.dim() != 2 or wq.numel() == 0:
        raise ValueError(f"wq must be a 2-D weight [N, K] with N, K >= 1, got shape {tuple(wq.shape)}")
    N, K = wq.shape
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K={K}] (K: wq's second dimension), got shape {tuple(x.shape)}")
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    if tuple(scale.shape) != (N,):
        raise ValueError(f"scale must be [N={N}] (one per row of wq), got shape {tuple(scale.shape)}")
    if bias is not None:
        if bias.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"bias must be float32/float16/bfloat16 or None, got {bias.dtype}")
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must be [N={N}] (one per row of wq) or None, got shape {tuple(bias.shape)}")
    for name, t in (("wq", wq), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
