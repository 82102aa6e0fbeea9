"""A3 KV-cache fusion: configuration and the reference math of token selection (docs/spec.md §4).

A RAG prompt is ``[system, chunk_1 … chunk_n, question]``. Each chunk's pre-RoPE keys and
values were computed alone (positions from 0); fusion re-applies RoPE at the chunk's real
positions (position recovery) and recomputes a budget of ``round(rho * N)`` document tokens
(``N`` = all chunk tokens) through the layers, chosen by one of:

* ``A3``: the question tokens' layer-0 attention probabilities to each document token, summed
  over question tokens and query heads (``question_attention_scores``);
* ``CACHEBLEND``: the largest layer-1 value deviation ``||v_fresh - v_reused||``
  (``value_deviation_scores``);
* ``SINK``: each chunk's head and tail tokens (``sink_selection``);
* ``FULL_REUSE`` (nothing recomputed) and ``FULL_RECOMPUTE`` (ordinary prefill, exact).

Everything here is plain torch on small tensors; the assembly is ``macattn.runtime.a3_assembly``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["recompute_budget", "question_attention_scores", "value_deviation_scores", "sink_selection", "top_tokens"]


def recompute_budget(rho: float, num_doc_tokens: int) -> int:
    """``round(rho * N)`` (half up), the number of document tokens recomputed."""
    return min(num_doc_tokens, int(math.floor(rho * num_doc_tokens + 0.5)))


def question_attention_scores(q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor,
                              doc_positions: torch.Tensor, *, scale: float) -> torch.Tensor:
    """A3 token scores.

    q: ``[Hq, Q, d]`` post-RoPE layer-0 queries of the question tokens at ``q_positions [Q]``.
    k: ``[Hkv, S, d]`` post-RoPE layer-0 keys of positions ``0 .. S-1`` (``Hq % Hkv == 0``).
    doc_positions: ``[N]`` positions of the document tokens.
    Returns fp32 ``[N]``: ``sum_{h, i} softmax_j(q_hi . k_j * scale)[doc_j]`` over causal ``j <= pos_i``.
    """
    Hq, Q, d = q.shape
    Hkv, S, _ = k.shape
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of key heads {Hkv}")
    kk = k.float().repeat_interleave(Hq // Hkv, dim=0)                       # [Hq, S, d]
    logits = torch.einsum("hqd,hsd->hqs", q.float(), kk) * scale
    allowed = torch.arange(S, device=q.device).view(1, S) <= q_positions.view(Q, 1)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)          # [Hq, Q, S]
    return probs.sum(dim=(0, 1))[doc_positions]


def value_deviation_scores(v_reused: torch.Tensor, v_fresh: torch.Tensor) -> torch.Tensor:
    """CacheBlend-style scores: ``||v_fresh - v_reused||_2`` per token over heads and dims.
    v_*: ``[N, Hkv, d]``; returns fp32 ``[N]``."""
    if v_reused.shape != v_fresh.shape:
        raise ValueError(f"value shapes differ: {tuple(v_reused.shape)} vs {tuple(v_fresh.shape)}")
    return (v_fresh.float() - v_reused.float()).flatten(1).norm(dim=1)


def top_tokens(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices ``[budget]`` (ascending) of the ``budget`` largest ``scores [N]``."""
    if not 0 <= budget <= scores.numel():
        raise ValueError(f"budget must be in [0, {scores.numel()}], got {budget}")
    return torch.topk(scores, budget).indices.sort().values


def sink_selection(chunk_lengths: list[int], rho: float) -> torch.Tensor:
    """Sink-style: each chunk ``c`` keeps ``round(rho * len_c)`` tokens, the first half of them
    (rounded up) from its head and the rest from its tail. Returns ascending indices into the
    concatenated chunks."""
    out, offset = [], 0
    for n in chunk_lengths:
        b = recompute_budget(rho, n)
        head = (b + 1) // 2
        idx = list(range(head)) + list(range(n - (b - head), n))
        out.extend(offset + i for i in idx)
        offset += n
    return torch.tensor(out, dtype=torch.int64)
