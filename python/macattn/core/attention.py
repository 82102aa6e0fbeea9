"""Plain-torch attention math every method shares: GQA head expansion, the decode-step shape
checks, and full causal attention of one query per request (the reference all methods are
measured against)."""
from __future__ import annotations

import math

import torch

__all__ = ["expand_kv_heads", "check_step_shapes", "full_attention_reference", "check_no_padding"]


def expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[B, Hkv, T, d] -> [B, Hq, T, d]``: query head ``h`` reads KV head ``h // (Hq/Hkv)``."""
    hkv = x.shape[1]
    if num_q_heads % hkv:
        raise ValueError(f"num query heads {num_q_heads} is not a multiple of KV heads {hkv}")
    return x.repeat_interleave(num_q_heads // hkv, dim=1)


def check_step_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, d], got {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [B, Hkv, T, d], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [B]={q.shape[0]}, got {tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= k.shape[2]):
        raise ValueError(f"positions must lie in [0, T-1] = [0, {k.shape[2] - 1}], got "
                         f"[{int(positions.min())}, {int(positions.max())}]")


def full_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """Ordinary softmax attention of one query per request over keys ``0..m``: ``[B, Hq, d]``."""
    check_step_shapes(q, k, v, positions)
    B, Hq, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    logits = torch.einsum("bhd,bhtd->bht", q.to(acc), expand_kv_heads(k, Hq).to(acc)) * scale
    valid = torch.arange(k.shape[2], device=q.device) <= positions.view(B, 1, 1)
    p = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("bht,bhtd->bhd", p, expand_kv_heads(v, Hq).to(acc))


def check_no_padding(attention_mask) -> None:
    """Decode through a bound HF model without a runtime supports unpadded batches only."""
    if attention_mask is None:
        return
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if not bool(allowed.all()):
        raise NotImplementedError("MAC decode through the HF model supports unpadded batches only; "
                                  "use macattn.runtime.ModelRunner for batches of mixed lengths")
