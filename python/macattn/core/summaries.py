"""Attention summaries ``(o, lse)`` over index sets (docs/spec.md §0).

For one query head with logits ``l_t`` over an index set ``I``::

    lse_I = log sum_{t in I} exp(l_t)
    o_I   = sum_{t in I} exp(l_t - lse_I) v_t

An empty set has ``lse = -inf`` and ``o = 0``. Every function here is batched over
arbitrary leading dimensions (requests, heads, ...), accumulates in at least fp32 and is
``-inf``-safe: empty operands never produce NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionSummary", "summarize", "merge_summaries", "remove_summary", "empty_summary"]


@dataclass(frozen=True)
class AttentionSummary:
    """o: ``[..., d]`` (fp32 or fp64), lse: ``[...]`` same dtype as ``o``."""

    o: torch.Tensor
    lse: torch.Tensor

    def __post_init__(self) -> None:
        if self.o.shape[:-1] != self.lse.shape:
            raise ValueError(f"AttentionSummary: o {tuple(self.o.shape)} and lse "
                             f"{tuple(self.lse.shape)} disagree on leading dims")

    @property
    def is_empty(self) -> torch.Tensor:
        return torch.isneginf(self.lse)

    def to(self, dtype: torch.dtype) -> "AttentionSummary":
        return AttentionSummary(self.o.to(dtype), self.lse.to(dtype))


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def empty_summary(shape: tuple[int, ...], d: int, *, dtype=torch.float32, device=None) -> AttentionSummary:
    return AttentionSummary(torch.zeros(*shape, d, dtype=dtype, device=device),
                            torch.full(shape, float("-inf"), dtype=dtype, device=device))


def summarize(logits: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> AttentionSummary:
    """Summary of the masked index set.

    logits: ``[..., T]`` already scaled; v: ``[..., T, d]`` (broadcastable to logits'
    leading dims); mask: ``[..., T]`` bool, True = in the set (None = all).
    Returns o ``[..., d]``, lse ``[...]`` in fp32 (fp64 if any input is fp64).
    """
    acc = _acc_dtype(logits, v)
    logits = logits.to(acc)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(logits - safe.unsqueeze(-1))  # 0 where masked, even when the whole row is
    if v.dim() == logits.dim() + 1 and v.shape[-3] == 1 and logits.dim() >= 2:
        # v shared by the rows of logits' last leading dim ([..., 1, T, d], e.g. ring seeding): one
        # [n, T] @ [T, d] matmul; the batched form below would materialise v once per row (100x slower)
        o = torch.matmul(w, v.to(acc).squeeze(-3))
    else:
        o = torch.matmul(w.unsqueeze(-2), v.to(acc)).squeeze(-2)
    return AttentionSummary(o, lse)


def merge_summaries(a: AttentionSummary, b: AttentionSummary) -> AttentionSummary:
    """Summary of ``I ∪ J`` from those of disjoint ``I`` and ``J`` under the same query.

    Associative and commutative; merging with an empty summary is the identity.
    """
    acc = _acc_dtype(a.o, b.o, a.lse, b.lse)
    la, lb = a.lse.to(acc), b.lse.to(acc)
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(la - safe).unsqueeze(-1)
    wb = torch.exp(lb - safe).unsqueeze(-1)
    return AttentionSummary(wa * a.o.to(acc) + wb * b.o.to(acc), lse)


def remove_summary(whole: AttentionSummary, part: AttentionSummary, *,
                   min_residual: float = 1e-3) -> tuple[AttentionSummary, torch.Tensor]:
    """Summary of ``I \\ J`` from ``I`` and its subset ``J`` (log-domain removal).

    Ill-conditioned when ``J`` holds almost all of ``I``'s mass: the residual fraction
    ``1 - exp(lse_J - lse_I)`` is then dominated by rounding. Returns the summary and a
    bool mask ``well_conditioned`` (residual fraction >= ``min_residual``); entries that
    are not well conditioned are returned as empty summaries (``lse=-inf, o=0``), never
    NaN. MAC itself never subtracts (it splits ranges); this exists for the paper's
    variant and for tests.
    """
    if not 0.0 < min_residual < 1.0:
        raise ValueError(f"min_residual must be in (0, 1), got {min_residual}")
    acc = _acc_dtype(whole.o, part.o)
    li, lj = whole.lse.to(acc), part.lse.to(acc)
    safe_i = torch.where(torch.isneginf(li), torch.zeros_like(li), li)
    frac_j = torch.exp(lj - safe_i).clamp(max=1.0)  # share of I's mass held by J
    residual = 1.0 - frac_j
    ok = (residual >= min_residual) & ~torch.isneginf(li)
    lse = li + torch.log1p(-frac_j.clamp(max=1.0 - torch.finfo(acc).eps))
    # o_{I\J} = (exp(lse_I) o_I - exp(lse_J) o_J) / exp(lse_{I\J}), rescaled by exp(-lse_I)
    o = (whole.o.to(acc) - frac_j.unsqueeze(-1) * part.o.to(acc)) / residual.clamp(min=torch.finfo(acc).tiny).unsqueeze(-1)
    o = torch.where(ok.unsqueeze(-1), o, torch.zeros_like(o))
    lse = torch.where(ok, lse, torch.full_like(lse, float("-inf")))
    return AttentionSummary(o, lse), ok
