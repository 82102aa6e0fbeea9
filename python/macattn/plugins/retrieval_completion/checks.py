"""Input contract of ``macattn::completion_cache`` / ``macattn::retrieval_completion``, shared by the
Triton launchers (``op.py``), the reference ops (``macattn.methods.completion.ops``) and the
TensorRT plugin definitions: each check raises ``ValueError`` / ``TypeError`` naming the input."""
from __future__ import annotations

import math

import torch

from macattn.core.validation import check_int

__all__ = ["KERNEL_FLOATS", "REFERENCE_FLOATS", "check_completion_cache_inputs", "check_retrieval_completion_inputs",
           "resolve_scale"]

KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_FLOATS = KERNEL_FLOATS + (torch.float64,)
_INTS = (torch.int32, torch.int64)


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def resolve_scale(scale: float, head_dim: int) -> float:
    """``scale`` if positive, else ``1/sqrt(head_dim)``."""
    return float(scale) if scale > 0 else 1.0 / math.sqrt(head_dim)


def _names(floats) -> str:
    return "/".join(str(f).removeprefix("torch.") for f in floats)


def check_completion_cache_inputs(log_phi_k, v_cache, n_prefill, n_sink, n_tail, floats=KERNEL_FLOATS) -> None:
    """Raise ``ValueError``/``TypeError`` naming the input of ``completion_cache`` that does not fit."""
    if log_phi_k.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"log_phi_k must be [B, Hkv, T, F] and v_cache [B, Hkv, T, d], got "
                         f"{list(log_phi_k.shape)} and {list(v_cache.shape)}")
    if log_phi_k.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"log_phi_k and v_cache must agree on [B, Hkv, T], got {list(log_phi_k.shape)} "
                         f"and {list(v_cache.shape)}")
    _check_shape("n_prefill", n_prefill, (v_cache.shape[0],))
    if log_phi_k.dtype != torch.float32:
        raise TypeError(f"log_phi_k must be float32, got {log_phi_k.dtype}")
    if v_cache.dtype not in floats:
        raise TypeError(f"v_cache must be {_names(floats)}, got {v_cache.dtype}")
    if n_prefill.dtype not in _INTS:
        raise TypeError(f"n_prefill must be int32/int64, got {n_prefill.dtype}")
    check_int("n_sink", n_sink, 0)
    check_int("n_tail", n_tail, 0)


def check_retrieval_completion_inputs(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b,
                                      comp_shift, n_sink, n_tail, top_k, scale, floats=KERNEL_FLOATS) -> None:
    """Raise ``ValueError``/``TypeError`` naming the input of ``retrieval_completion`` that does not fit."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, d], got {list(q.shape)}")
    B, Hq, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != d:
        raise ValueError(f"k_cache must be [B={B}, Hkv, T, d={d}], got {list(k_cache.shape)}")
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a positive multiple of Hkv={Hkv} (k_cache dim 1)")
    if log_phi_q.dim() != 3:
        raise ValueError(f"log_phi_q must be [B, Hq, F], got {list(log_phi_q.shape)}")
    F = log_phi_q.shape[2]
    for name, t, shape in (("v_cache", v_cache, (B, Hkv, T, d)), ("seq_lens", seq_lens, (B,)),
                           ("n_prefill", n_prefill, (B,)), ("log_phi_q", log_phi_q, (B, Hq, F)),
                           ("log_phi_k", log_phi_k, (B, Hkv, T, F)), ("comp_A", comp_A, (B, Hkv, F, d)),
                           ("comp_b", comp_b, (B, Hkv, F)), ("comp_shift", comp_shift, (B, Hkv, F))):
        _check_shape(name, t, shape)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in floats:
            raise TypeError(f"{name} must be {_names(floats)}, got {t.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    for name, t in (("log_phi_q", log_phi_q), ("log_phi_k", log_phi_k), ("comp_A", comp_A), ("comp_b", comp_b),
                    ("comp_shift", comp_shift)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    for name, t in (("seq_lens", seq_lens), ("n_prefill", n_prefill)):
        if t.dtype not in _INTS:
            raise TypeError(f"{name} must be int32/int64, got {t.dtype}")
    check_int("n_sink", n_sink, 0)
    check_int("n_tail", n_tail, 0)
    check_int("top_k", top_k, 0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (<= 0 for 1/sqrt(d)), got {scale!r}")
