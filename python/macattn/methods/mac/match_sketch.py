"""Compressed ring entries for MAC's two-stage match (``MacConfig(match="two_stage")``).

A sketch maps a pre-RoPE query ``[..., d]`` to the vector the candidate stage compares, fp32:

* ``"fp8"``: the entry cast to E4M3 (saturating at ±448, no scale: pre-RoPE query elements of the
  models here stay far inside that range), ``d`` bytes per entry instead of ``2 d``;
* ``"proj32"`` / ``"proj16"``: ``x @ P`` with one fixed Gaussian ``P [d, D] / sqrt(D)`` (seeded by
  ``(d, D)`` alone, so every layer, run and kernel derives the same matrix; Johnson–Lindenstrauss:
  squared distances are preserved in expectation), ``2 D`` bytes in bf16;
* ``"proj32_fp8"``: the projection, then E4M3: ``D`` bytes.

A kernel keeps ``sketch(entry)`` beside the ring, written by the append; the reference recomputes it
from the ring, which is the same function.
"""
from __future__ import annotations

import functools

import torch

from macattn.core.validation import check_choice
from macattn.methods.mac.config import MATCH_SKETCHES

__all__ = ["sketch_projection", "sketch_projection_of", "sketch", "sketch_dims", "sketch_dtype", "FP8_MAX"]

FP8_MAX = 448.0       # largest finite float8_e4m3fn
_PROJ = {"fp8": None, "proj32": 32, "proj16": 16, "proj32_fp8": 32}
_FP8 = {"fp8": True, "proj32": False, "proj16": False, "proj32_fp8": True}
_SEED = 0x6D6163   # "mac"


def sketch_dims(kind: str, head_dim: int) -> int:
    """Length of a ``kind`` sketch of a ``head_dim`` vector."""
    check_choice("match_sketch", kind, MATCH_SKETCHES)
    return _PROJ[kind] or head_dim


def sketch_dtype(kind: str) -> torch.dtype:
    """The dtype a sketch ring stores ``kind`` sketches in, exactly (E4M3 or bf16)."""
    check_choice("match_sketch", kind, MATCH_SKETCHES)
    return torch.float8_e4m3fn if _FP8[kind] else torch.bfloat16


def sketch_projection(head_dim: int, dims: int, device=None) -> torch.Tensor:
    """The fixed ``[head_dim, dims]`` fp32 projection (Gaussian, scaled by ``1 / sqrt(dims)``); one
    shared read-only tensor per device, so a captured step never copies it from the host."""
    return _projection(head_dim, dims, str(torch.device(device or "cpu")))


def sketch_projection_of(kind: str, head_dim: int, device=None) -> torch.Tensor | None:
    """``kind``'s projection ``[head_dim, D]`` (``sketch_projection``), None for ``"fp8"`` (no projection)."""
    check_choice("match_sketch", kind, MATCH_SKETCHES)
    return None if _PROJ[kind] is None else sketch_projection(head_dim, _PROJ[kind], device)


@functools.lru_cache(maxsize=None)
def _projection(head_dim: int, dims: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(_SEED + 1009 * head_dim + dims)
    return (torch.randn(head_dim, dims, generator=g) / dims ** 0.5).to(device)


def sketch(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x [..., d]`` (any float dtype) -> its ``kind`` sketch ``[..., sketch_dims(kind, d)]`` fp32."""
    check_choice("match_sketch", kind, MATCH_SKETCHES)
    y = x.float()
    if _PROJ[kind] is not None:
        y = y @ sketch_projection_of(kind, x.shape[-1], x.device)
    if _FP8[kind]:
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return y.to(torch.bfloat16).float() if _PROJ[kind] is not None else y
