"""CUDA implementation of ``macattn::mac_attend`` (registered by ``macattn.plugins.registration``).

Contiguous KV ``[B, Hkv, T, d]`` as the op's reference. Plans (scratch + launch
parameters) are cached per shape bucket; each call writes a fresh output tensor.
"""
from __future__ import annotations

import torch

from ..decode_plan import MacDecodePlan

__all__ = ["mac_attend_triton", "clear_plan_cache"]

_PLANS: dict[tuple, MacDecodePlan] = {}


def clear_plan_cache() -> None:
    _PLANS.clear()


def _plan_for(q: torch.Tensor, k: torch.Tensor, qring: torch.Tensor, band: int, scale: float) -> MacDecodePlan:
    B, Hq, d = q.shape
    key = (q.device, B, Hq, k.shape[1], d, k.shape[2], qring.shape[2], band, float(scale), q.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = MacDecodePlan(batch_size=B, max_context=k.shape[2], num_q_heads=Hq, num_kv_heads=k.shape[1],
                             head_dim=d, window=qring.shape[2], band=band, tau=0.0, q_dtype=q.dtype,
                             device=q.device, scale=scale)
        _PLANS[key] = plan
    return plan


def mac_attend_triton(q: torch.Tensor, q_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, match_pos: torch.Tensor, slots: torch.Tensor,
                      qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
                      band: int, scale: float) -> torch.Tensor:
    """Same contract as the ``macattn::mac_attend`` op: returns ``out [B, Hq, d]`` in ``q``'s dtype and appends
    ``(q_pre, entry, m)`` to slot ``m mod K`` of the rings. ``positions`` must lie in ``[0, T-1]`` (not checked)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, d], got {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k must be [B, Hkv, T, d], got {tuple(k.shape)}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return out
    plan = _plan_for(q, k, qring, band, scale)
    match_pos = match_pos if match_pos.stride(-1) == 1 else match_pos.contiguous()
    return plan.run_attend(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos, out=out)
