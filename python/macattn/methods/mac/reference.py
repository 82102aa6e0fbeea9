"""MAC-Attention reference decode step (docs/spec.md §1), plain torch, fp32/fp64.

This is the ground truth the Triton kernels, the ONNX nodes and the TensorRT plugins are
tested against. It computes exactly the function the kernels compute, not fast: it reads
every key and masks.

Shapes (``B`` requests in the step, ``S`` ring slots, ``Hq`` query heads, ``Hkv`` KV
heads, ``K`` ring capacity = window, ``T`` KV capacity, ``d`` head dim):

* ``q``, ``q_pre``: ``[B, Hq, d]`` post- and pre-RoPE query of the token at ``positions``.
* ``k``, ``v``: ``[B, Hkv, T, d]``; request ``b`` owns keys ``0 .. positions[b]``
  (its own K/V already appended); entries past that are ignored.
* ``positions``: ``[B]`` int64, ``m`` per request.  ``slots``: ``[B]`` int64 ring rows.
* rings: ``qring [S, Hq, K, d]``, ``oring [S, Hq, K, d]``, ``ring_lse [S, Hq, K]`` fp32,
  ``ring_pos [S, K]`` int64 (``-1`` = empty). Slot of position ``t`` is ``t mod K``.
* ``match_pos``: ``[B, Hq]`` int64, the reused position ``p`` or ``-1`` for a miss.

Decode at ``m`` with ``lo = p - r + 1`` on a hit (``0`` on a miss) and ``base`` the
cached ``AS^{(p)}_{[0, p-r]}`` on a hit (empty on a miss)::

    A     = AS_[lo, m-r]          B = AS_[m-r+1, m]      (split inside one pass)
    entry = base ⊕ A  (= AS^{(m)}_{[0, m-r]}, the ring entry; empty if m - r < 0)
    out   = entry ⊕ B

No log-domain subtraction occurs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from macattn.core.attention import check_step_shapes as _check_step_shapes, expand_kv_heads, full_attention_reference
from macattn.core.threshold import match_threshold

from macattn.core.summaries import AttentionSummary, merge_summaries, summarize
from macattn.core.validation import check_choice
from macattn.methods.mac.config import MATCH_MODES
from macattn.methods.mac.match_sketch import sketch as sketch_fn

__all__ = [
    "MacStepResult",
    "mac_match_reference",
    "mac_match_two_stage_reference",
    "mac_attend_reference",
    "ring_append_reference",
    "mac_decode_step_reference",
    "rectified_summaries_reference",
    "full_attention_reference",
    "expand_kv_heads",
]


@dataclass(frozen=True)
class MacStepResult:
    """out ``[B, Hq, d]`` (fp32/fp64), match_pos ``[B, Hq]`` int64 (-1 miss),
    dist ``[B, Hq]`` fp32 (L2 distance to the nearest candidate, inf if none)."""

    out: torch.Tensor
    match_pos: torch.Tensor
    dist: torch.Tensor

    @property
    def hit(self) -> torch.Tensor:
        return self.match_pos >= 0


def mac_match_reference(q_pre: torch.Tensor, qring: torch.Tensor, ring_lse: torch.Tensor,
                        ring_pos: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, *,
                        band: int, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Match step: nearest pre-RoPE query in the window, threshold and validity test.

    Candidates are slots with ``m - K <= pos < m``. The distance is computed from the
    stored dtype (bf16 on the GPU) with fp32 accumulation. Hit iff
    ``dist < sqrt(2d)(1 - tau)``, ``p - band >= 0`` and the cached ``lse`` is finite.
    Returns ``(match_pos [B, Hq] int64, dist [B, Hq] fp32)``.
    """
    K, d = qring.shape[2], qring.shape[3]
    ring = qring[slots].float()                                       # [B, Hq, K, d]
    diff = q_pre.to(qring.dtype).float().unsqueeze(2) - ring
    dist2 = diff.square().sum(-1)                                     # [B, Hq, K]
    rpos = ring_pos[slots]                                            # [B, K]
    m = positions.unsqueeze(1)
    cand = (rpos >= 0) & (rpos < m) & (rpos >= m - K)                 # [B, K]
    dist2 = dist2.masked_fill(~cand.unsqueeze(1), float("inf"))
    best2, best_slot = dist2.min(dim=-1)                              # first index on ties
    dist = best2.sqrt()
    p = torch.gather(rpos, 1, best_slot)                              # [B, Hq]
    lse = torch.gather(ring_lse[slots], 2, best_slot.unsqueeze(-1)).squeeze(-1)
    thr = match_threshold(d, tau)
    hit = (dist < thr) & (p - band >= 0) & torch.isfinite(lse)
    return torch.where(hit, p, torch.full_like(p, -1)), dist


def mac_match_two_stage_reference(q_pre: torch.Tensor, qring: torch.Tensor, ring_lse: torch.Tensor,
                                  ring_pos: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, *,
                                  band: int, tau: float, sketch: str = "fp8", candidates: int = 4,
                                  q_sketch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-stage match (``MacConfig(match="two_stage")``), same inputs and outputs as ``mac_match_reference``.

    Candidate stage: the ``candidates`` valid window entries nearest to ``sketch(q_pre)`` among the
    ring's sketches (``macattn.methods.mac.match_sketch``; ties: lower ring index); ``q_sketch``
    ``[B, Hq, DS]`` replaces ``sketch(q_pre)`` when given (the kernels compute their own, whose
    projection sums in another order). Exact stage: their
    distances from the stored ring (fp32 accumulation), the nearest of them (ties: lower ring index),
    then ``mac_match_reference``'s threshold and validity test. ``dist`` is that candidate's exact
    distance (``inf`` with no valid entry), so an accepted match always passes the exact test.
    """
    K, d = qring.shape[2], qring.shape[3]
    ring = qring[slots]                                               # [B, Hq, K, d]
    q = q_pre.to(qring.dtype)
    rpos = ring_pos[slots]                                            # [B, K]
    m = positions.unsqueeze(1)
    cand = ((rpos >= 0) & (rpos < m) & (rpos >= m - K)).unsqueeze(1)  # [B, 1, K]
    qs = sketch_fn(q, sketch) if q_sketch is None else q_sketch.float()
    approx = (qs.unsqueeze(2) - sketch_fn(ring, sketch)).square().sum(-1)
    approx = approx.masked_fill(~cand, float("inf"))                  # [B, Hq, K]
    c = min(candidates, K)
    # stable sort: equal sketch distances keep ring order, so ties go to the lower index
    top = torch.sort(approx, dim=-1, stable=True).indices[..., :c]   # [B, Hq, c]
    valid = torch.gather(approx, 2, top) < float("inf")
    picked = torch.gather(ring, 2, top.unsqueeze(-1).expand(*top.shape, d)).float()
    exact2 = (q.float().unsqueeze(2) - picked).square().sum(-1).masked_fill(~valid, float("inf"))
    best2 = exact2.min(dim=-1, keepdim=True).values                   # [B, Hq, 1]
    # the nearest candidate; on equal exact distances the lower ring index (as the exact match)
    best_slot = torch.where(exact2 == best2, top, torch.full_like(top, K)).min(dim=-1).values
    dist = best2.squeeze(-1).sqrt()
    p = torch.gather(rpos, 1, best_slot)
    lse = torch.gather(ring_lse[slots], 2, best_slot.unsqueeze(-1)).squeeze(-1)
    hit = (dist < match_threshold(d, tau)) & (p - band >= 0) & torch.isfinite(lse)
    return torch.where(hit, p, torch.full_like(p, -1)), dist


def mac_attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         match_pos: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor,
                         slots: torch.Tensor, *, band: int, scale: float | None = None
                         ) -> tuple[torch.Tensor, AttentionSummary]:
    """Complete + amend: returns ``(out [B, Hq, d], entry)`` where ``entry`` is the new
    rectified summary ``AS^{(m)}_{[0, m-r]}`` (o ``[B, Hq, d]``, lse ``[B, Hq]``).

    Accumulates in fp64 if ``q`` is fp64, else fp32. Reads the cached summary of slot
    ``p mod K`` for hits.
    """
    _check_step_shapes(q, k, v, positions)
    B, Hq, d = q.shape
    T = k.shape[2]
    K = oring.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = expand_kv_heads(k, Hq).to(acc)
    vf = expand_kv_heads(v, Hq).to(acc)
    logits = torch.einsum("bhd,bhtd->bht", q.to(acc), kf) * scale   # [B, Hq, T]

    t = torch.arange(T, device=q.device)
    m = positions.view(B, 1, 1)
    hit = match_pos >= 0
    lo = torch.where(hit, match_pos - band + 1, torch.zeros_like(match_pos)).unsqueeze(-1)
    split = m - band                                                   # last index of A
    mask_a = (t >= lo) & (t <= split)
    mask_b = (t > split) & (t <= m)
    part_a = summarize(logits, vf, mask_a)
    part_b = summarize(logits, vf, mask_b)

    safe_slot = torch.where(hit, match_pos, torch.zeros_like(match_pos)) % K
    idx = safe_slot.unsqueeze(-1)
    cached_lse = torch.gather(ring_lse[slots].to(acc), 2, idx).squeeze(-1)
    cached_o = torch.gather(oring[slots].to(acc), 2, idx.unsqueeze(-1).expand(B, Hq, 1, d)).squeeze(2)
    base = AttentionSummary(torch.where(hit.unsqueeze(-1), cached_o, torch.zeros_like(cached_o)),
                            torch.where(hit, cached_lse, torch.full_like(cached_lse, float("-inf"))))
    entry = merge_summaries(base, part_a)
    out = merge_summaries(entry, part_b)
    return out.o, entry


def ring_append_reference(qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor,
                          ring_pos: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                          q_pre: torch.Tensor, entry: AttentionSummary) -> None:
    """Write ``(q_pre, entry.o, entry.lse, m)`` into slot ``m mod K`` of each request's rings, in place."""
    K = qring.shape[2]
    col = positions % K
    qring[slots, :, col] = q_pre.to(qring.dtype)
    oring[slots, :, col] = entry.o.to(oring.dtype)
    ring_lse[slots, :, col] = entry.lse.to(ring_lse.dtype)
    ring_pos[slots, col] = positions


def mac_decode_step_reference(q: torch.Tensor, q_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              positions: torch.Tensor, slots: torch.Tensor, qring: torch.Tensor,
                              oring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor, *,
                              band: int, tau: float, enabled: bool = True,
                              scale: float | None = None, miss_policy: str = "full",
                              completion=None, match: str = "exact", match_sketch: str = "fp8",
                              match_candidates: int = 4) -> MacStepResult:
    """One MAC decode step for one layer: match, complete, rectify-append (rings mutated).

    match ``"two_stage"``: ``mac_match_two_stage_reference`` with ``match_sketch`` / ``match_candidates``.

    miss_policy ``"completion"``: heads that miss take their output and ring entry from
    ``completion.amend_misses`` (a ``macattn.methods.completion.completion_on_miss.CompletionOnMiss`` built at
    prefill) instead of full attention; hits are unchanged.
    """
    if miss_policy not in ("full", "completion"):
        raise ValueError(f"miss_policy must be 'full' or 'completion', got {miss_policy!r}")
    if miss_policy == "completion" and completion is None:
        raise ValueError("miss_policy='completion' needs completion= (a CompletionOnMiss built at prefill)")
    check_choice("match", match, MATCH_MODES)
    if enabled and match == "two_stage":
        match_pos, dist = mac_match_two_stage_reference(q_pre, qring, ring_lse, ring_pos, slots, positions,
                                                        band=band, tau=tau, sketch=match_sketch,
                                                        candidates=match_candidates)
    elif enabled:
        match_pos, dist = mac_match_reference(q_pre, qring, ring_lse, ring_pos, slots, positions,
                                              band=band, tau=tau)
    else:
        match_pos = torch.full(q.shape[:2], -1, dtype=torch.int64, device=q.device)
        dist = torch.full(q.shape[:2], float("inf"), dtype=torch.float32, device=q.device)
    out, entry = mac_attend_reference(q, k, v, positions, match_pos, oring, ring_lse, slots,
                                      band=band, scale=scale)
    if miss_policy == "completion":
        out, entry = completion.amend_misses(q, k, v, positions, match_pos, out, entry, band=band, scale=scale)
    ring_append_reference(qring, oring, ring_lse, ring_pos, slots, positions, q_pre, entry)
    return MacStepResult(out, match_pos, dist)


def rectified_summaries_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  query_positions: torch.Tensor, *, band: int,
                                  scale: float | None = None, chunk: int = 256) -> AttentionSummary:
    """Ring seeding (docs/spec.md §1.4): the prefill attention with the causal limit moved back by ``band``.

    q: ``[B, Hq, n, d]`` post-RoPE queries at ``query_positions`` ``[n]`` (shared by the
    batch); k, v: ``[B, Hkv, L, d]``. Returns ``AS^{(t)}_{[0, t - band]}`` per query:
    o ``[B, Hq, n, d]``, lse ``[B, Hq, n]`` (empty where ``t - band < 0``).
    """
    B, Hq, n, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = expand_kv_heads(k, Hq).to(acc)
    vf = expand_kv_heads(v, Hq).to(acc)
    t = torch.arange(k.shape[2], device=q.device)
    outs, lses = [], []
    for s in range(0, n, chunk):
        qc = q[:, :, s:s + chunk].to(acc)
        logits = torch.einsum("bhnd,bhtd->bhnt", qc, kf) * scale
        mask = t.view(1, -1) <= (query_positions[s:s + chunk].view(-1, 1) - band)
        part = summarize(logits, vf.unsqueeze(2), mask)
        outs.append(part.o)
        lses.append(part.lse)
    return AttentionSummary(torch.cat(outs, dim=2), torch.cat(lses, dim=2))
