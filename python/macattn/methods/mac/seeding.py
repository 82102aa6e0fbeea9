"""Ring seeding after prefill (docs/spec.md §1.4) written with traceable tensor ops only.

``MacState.seed`` (the eager path) loops over requests in Python; this module computes
the same ring contents as whole ring rows so ``torch.export`` / ONNX see one static
graph with dynamic batch and prompt length. Prompt length ``L`` is shared by the batch
(no padding); the prompt occupies positions ``0 .. L-1``.

Shapes (``B`` requests, ``S`` ring slots, ``Hq`` query heads, ``Hkv`` KV heads, ``K``
the layer's window, ``d`` head dim):

* ``query`` ``[B, Hq, L, d]`` post-RoPE, ``q_pre`` ``[B, Hq, L, d]`` pre-RoPE,
  ``key``/``value`` ``[B, Hkv, L, d]``.
* rings ``qring [S, Hq, K, d]``, ``oring [S, Hq, K, d]``, ``ring_lse [S, Hq, K]`` fp32,
  ``ring_pos [S, K]`` int64; ``slots [B]`` int64 (distinct).

Column ``c`` of a seeded row holds the prompt position ``t`` in ``[L - n, L - 1]``
(``n = min(K, L)``) with ``t mod K == c``; columns without one are empty
(``q = 0, o = 0, lse = -inf, pos = -1``), i.e. the row is reset and seeded at once.

``seed_packed_`` seeds every fresh segment of a packed prefill at once (``packed_seeding_applies``): the ring
positions' summaries as one ``flash_varlen`` call, the entries as one indexed store per ring
(``MacState.write_columns``), where one segment at a time costs ~15 launches per segment and layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from macattn.core.attention import expand_kv_heads
from macattn.core.flash_split import flash_forward, flash_lower_right
from macattn.core.ragged import PrefillSegment, causal_attention, uses_cudnn, varlen_attention
from macattn.core.summaries import AttentionSummary, summarize
from macattn.methods.mac.reference import rectified_summaries_reference

__all__ = ["seeded_ring_rows", "seed_rings_", "tail_summaries", "fused_seeding_applies", "band_split_applies",
           "band_split_attention", "fresh_split_attention", "PackedSeeds", "packed_seeding_applies", "packed_seeds",
           "seed_packed_", "ring_positions"]


def ring_positions(segment: PrefillSegment, window: int, min_context: int = 0) -> int:
    """How many of a packed call's ``segment``'s positions its request's ring keeps: those among the prompt's
    last ``window`` (``PrefillSegment.last_positions``), none for a prompt shorter than ``min_context`` (its
    first decode step is below the context where MAC engages: ``MacConfig.min_context``)."""
    return 0 if segment.prompt_length < min_context else segment.last_positions(window)   # MacConfig.engages(L)


def fused_seeding_applies(query: torch.Tensor) -> bool:
    """Whether ``tail_summaries`` takes the fused kernel for ``query``: CUDA, half / bf16, head dim <= 256,
    and not while tracing (export runs the traceable reference)."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


def tail_summaries(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, band: int,
                   scale: float) -> AttentionSummary:
    """Rectified summaries of the last ``n`` positions of a sequence of ``S``: ``query [B, Hq, n, d]``
    (post-RoPE) at positions ``t = S - n .. S - 1`` of ``key / value [B, Hkv, S, d]``; entry ``t`` is
    ``AS^{(t)}_{[0, t - band]}`` (docs/spec.md §1.4), empty (``o = 0``, ``lse = -inf``) where ``t - band < 0``.
    Returns o ``[B, Hq, n, d]`` fp32, lse ``[B, Hq, n]`` fp32 (fp64 for fp64 inputs).

    On CUDA (``fused_seeding_applies``) this is flash attention with its log-sum-exp: the queries over keys
    ``0 .. S - band - 1`` with the causal mask aligned to the bottom right (query ``i`` sees keys
    ``<= i + S - band - n = t - band``), GQA without expanding heads, split over the keys where the block is short
    (``core.flash_split.flash_lower_right``, one request); o then carries the kernel's bf16 / fp16 rounding.
    Elsewhere the fp32 / fp64 reference (``rectified_summaries_reference``)."""
    B, Hq, n, d = query.shape
    S = key.shape[2]
    if not fused_seeding_applies(query) or S - band <= 0:
        qpos = torch.arange(S - n, S, device=query.device)
        return rectified_summaries_reference(query, key, value, qpos, band=band, scale=scale)
    k, v = key[:, :, : S - band], value[:, :, : S - band]
    if k.shape[1] != Hq and not _native_gqa(query, k, v, scale):
        k, v = expand_kv_heads(k, Hq), expand_kv_heads(v, Hq)
    if B == 1 and S - band >= n:    # a short block over many keys: split over the keys (core.flash_split)
        o, lse = flash_lower_right(query, k, v, scale)
        return AttentionSummary(o, lse)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        query.contiguous(), k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale)[:2]
    if S - n >= band:           # no query without keys (known on the host: no masking launches)
        return AttentionSummary(out.float(), lse.float())
    empty = (torch.arange(S - n, S, device=query.device) < band).view(1, 1, n)
    o = torch.where(empty.unsqueeze(-1), 0.0, out.float())
    return AttentionSummary(o, torch.where(empty, float("-inf"), lse.float()))


def band_split_applies(query: torch.Tensor, key: torch.Tensor, band: int, *, fresh: bool = False) -> bool:
    """Whether ``band_split_attention`` serves ``query [1, Hq, Q, d]`` at the last ``Q`` positions of ``key [1, Hkv,
    S, d]``: the fused seeding applies, every query has ``band`` earlier keys before its band (``S - Q >= band``, so
    no query's far part is empty), and this torch's flash takes a window (as far as known). A continued chunk
    (``fresh`` False) must also run on flash anyway (``not uses_cudnn``: the far part is a flash call, and cuDNN's
    lower-right split beats flash where its plan pays). ``fresh``: ``query`` is the ring's tail of a fresh segment
    (``fresh_split_attention``), whose far part is the seeding's own pass: the split then pays on any backend."""
    Q, S = query.shape[2], key.shape[2]
    return (band >= 1 and S - Q >= band and fused_seeding_applies(query) and (fresh or not uses_cudnn(Q, S))
            and _WINDOW_OK.get(query.device, True))


def band_split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, band: int,
                         scale: float) -> tuple[torch.Tensor, AttentionSummary] | None:
    """A continued chunk's causal attention and its queries' rectified summaries in one pass over the keys
    (``band_split_applies``): ``query [1, Hq, Q, d]`` at positions ``t = S - Q .. S - 1`` of ``key / value
    [1, Hkv, S, d]``. The far part — keys ``0 .. t - band``, ``tail_summaries`` of every query — is what MAC's
    ring keeps; the near part — keys ``t - band + 1 .. t``, flash with a left window of ``band - 1`` over the
    last ``Q + band - 1`` keys — completes it, merged through the two log-sum-exps in fp32. Seeding a chunk
    this way costs the near part (``Q x band``) instead of a second pass of the ring's queries over all ``S``
    keys. Returns ``(out [1, Hq, Q, d] in query's dtype, far)`` (far: o ``[1, Hq, Q, d]``, lse ``[1, Hq, Q]``,
    fp32), or None where this torch's flash takes no window (then the caller attends as before)."""
    Q, S = query.shape[2], key.shape[2]
    lo = S - Q - band + 1
    k_near, v_near = key[:, :, lo:], value[:, :, lo:]
    if k_near.shape[1] != query.shape[1] and not _native_gqa(query, k_near, v_near, scale):
        k_near, v_near = expand_kv_heads(k_near, query.shape[1]), expand_kv_heads(v_near, query.shape[1])
    try:
        near_o, near_lse = flash_forward(query.transpose(1, 2).contiguous(), k_near.transpose(1, 2).contiguous(),
                                         v_near.transpose(1, 2).contiguous(), True, scale, window_left=band - 1)
    except (RuntimeError, TypeError):
        _WINDOW_OK[query.device] = False
        return None
    far = tail_summaries(query, key, value, band=band, scale=scale)
    near_lse = near_lse.float()
    lse = torch.logaddexp(far.lse, near_lse)
    out = (far.o * torch.exp(far.lse - lse).unsqueeze(-1)
           + near_o.transpose(1, 2).float() * torch.exp(near_lse - lse).unsqueeze(-1))
    return out.to(query.dtype), far


def fresh_split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int, band: int,
                          scale: float) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionSummary] | None:
    """A fresh segment's causal attention with the rectified summaries its ring is seeded from, without the
    seeding's second pass over the keys: ``query [1, Hq, L, d]`` at positions ``0 .. L - 1`` of ``key / value
    [1, Hkv, L, d]``, ``n = min(window, L)`` the positions ``seeded_ring_rows`` keeps. The first ``L - n`` queries
    attend over the first ``L - n`` keys as the packed plan would attend a segment of that size
    (``core.ragged.causal_attention``: cuDNN where it pays), the last ``n`` through ``band_split_attention``, whose
    far part is ``tail_summaries`` of those queries, the call ``seeded_ring_rows`` would make.

    Returns ``((head [1, Hq, L - n, d], tail [1, Hq, n, d]) in query's dtype, far)`` (the two parts of the output
    in query order; far: o ``[1, Hq, n, d]``, lse ``[1, Hq, n]``, fp32, for ``seed_rings_(summary=)``), or None
    where the split does not apply (``band_split_applies(fresh=True)``; among others ``L - n < band``, so a prompt
    within the window never splits) or this torch's flash takes no window: then the caller attends as before."""
    L = query.shape[2]
    n = min(window, L)
    tail_q = query[:, :, L - n:]
    if not band_split_applies(tail_q, key, band, fresh=True):
        return None
    tail = band_split_attention(tail_q, key, value, band=band, scale=scale)
    if tail is None:
        return None
    h = L - n
    head = causal_attention(query[:, :, :h], key[:, :, :h], value[:, :, :h], scale)
    return (head, tail[0]), tail[1]


_WINDOW_OK: dict = {}
_GQA_OK: dict = {}


def _native_gqa(query, k, v, scale) -> bool:
    """Whether this torch's flash kernel takes fewer KV heads than query heads (asked once per device)."""
    dev = query.device
    if dev not in _GQA_OK:
        try:
            torch.ops.aten._scaled_dot_product_flash_attention(query[:, :, :1].contiguous(), k[:, :, :1], v[:, :, :1],
                                                             0.0, is_causal=True, return_debug_mask=False, scale=scale)
            _GQA_OK[dev] = True
        except RuntimeError:
            _GQA_OK[dev] = False
    return _GQA_OK[dev]


def seeded_ring_rows(query: torch.Tensor, q_pre: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                     window: int, band: int, scale: float, summary: AttentionSummary | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh ring rows of ``B`` requests after a prefill of ``L`` tokens.

    Returns ``(q_rows [B, Hq, K, d] (q_pre's dtype), o_rows [B, Hq, K, d] fp32,
    lse_rows [B, Hq, K] fp32, pos_rows [B, K] int64)``; entry ``t`` holds the rectified
    summary ``AS^{(t)}_{[0, t - band]}`` of query ``t`` (empty where ``t - band < 0``).
    ``summary``: those summaries of the last ``n = min(K, L)`` positions where the prefill's attention already
    made them (``fresh_split_attention``'s far part: o ``[B, Hq, n, d]``, lse ``[B, Hq, n]``, fp32), else
    ``tail_summaries`` computes them (the fused path) or the reference does.
    """
    if query.dim() != 4 or q_pre.shape != query.shape:
        raise ValueError(f"query and q_pre must both be [B, Hq, L, d], got {tuple(query.shape)} "
                         f"and {tuple(q_pre.shape)}")
    B, Hq, L, d = query.shape
    K = int(window)
    if summary is None and fused_seeding_applies(query):   # eager only: export traces the reference below
        summary = tail_summaries(query[:, :, L - min(K, L):], key, value, band=band, scale=scale)
    if summary is not None and summary.o.shape[2] != min(K, L):
        raise ValueError(f"summary must cover the last {min(K, L)} positions, got {summary.o.shape[2]}")
    if summary is not None and L >= K:                  # every column filled: cached columns, no masks
        t_col, j = _full_columns(L, K, query.device)
        return (q_pre.index_select(2, t_col), summary.o.index_select(2, j), summary.lse.index_select(2, j),
                t_col.view(1, K).expand(B, K))
    col = torch.arange(K, device=query.device)
    first = col.new_full((), 0) + (L - K)                            # position of the oldest kept entry
    t_col = first + torch.remainder(col - first, K)                  # [K]: position held by column c
    valid = t_col >= 0                                               # False only while L < K
    idx = torch.where(valid, t_col, torch.zeros_like(t_col))
    if summary is not None:                                          # the kept tail, in position order
        j = torch.where(valid, t_col - (L - summary.o.shape[2]), torch.zeros_like(t_col))
        summ = AttentionSummary(summary.o.index_select(2, j), summary.lse.index_select(2, j))
    else:
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        kf = expand_kv_heads(key, Hq).to(acc)
        vf = expand_kv_heads(value, Hq).to(acc)
        q_sel = query.index_select(2, idx).to(acc)                   # [B, Hq, K, d]
        logits = torch.einsum("bhnd,bhtd->bhnt", q_sel, kf) * scale  # [B, Hq, K, L]
        t = torch.arange(L, device=query.device)
        mask = t.view(1, -1) <= (t_col.view(-1, 1) - band)          # [K, L]
        summ = summarize(logits, vf.unsqueeze(2), mask)             # o [B, Hq, K, d], lse [B, Hq, K]
    q_rows = torch.where(valid.view(1, 1, K, 1), q_pre.index_select(2, idx), 0.0)
    o_rows = torch.where(valid.view(1, 1, K, 1), summ.o.float(), 0.0)
    lse_rows = torch.where(valid.view(1, 1, K), summ.lse.float(), float("-inf"))
    pos_rows = torch.where(valid, t_col, -1).view(1, K).expand(B, K)
    return q_rows, o_rows, lse_rows, pos_rows


_COLUMNS: dict = {}


def _full_columns(L: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a prompt of ``L >= K`` tokens: ``t_col [K]`` int64, the position column ``c`` keeps
    (``t mod K == c`` among the last ``K``), and ``j [K]``, its index among those last ``K``. Made once per
    ``(L mod K, K, device)`` and shared by every layer and call (``t_col`` shifts with ``L``)."""
    key = (L % K, K, device)
    base = _COLUMNS.get(key)
    if base is None:
        if len(_COLUMNS) > 256:
            _COLUMNS.clear()
        col = torch.arange(K, device=device)
        j = torch.remainder(col - L, K)                              # same for every L with this L mod K
        base = _COLUMNS[key] = j
    return base + (L - K), base


def seed_rings_(rings, slots: torch.Tensor, query: torch.Tensor, q_pre: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, *, band: int, scale: float, summary: AttentionSummary | None = None) -> None:
    """Write fresh seeded rows into ``rings = (qring, oring, ring_lse, ring_pos)`` at ``slots``, in place
    (``summary``: as ``seeded_ring_rows``')."""
    qring, oring, ring_lse, ring_pos = rings
    q_rows, o_rows, lse_rows, pos_rows = seeded_ring_rows(query, q_pre, key, value, window=qring.shape[2],
                                                          band=band, scale=scale, summary=summary)
    qring.index_copy_(0, slots, q_rows.to(qring.dtype))
    oring.index_copy_(0, slots, o_rows.to(oring.dtype))
    ring_lse.index_copy_(0, slots, lse_rows.to(ring_lse.dtype))
    ring_pos.index_copy_(0, slots, pos_rows.to(ring_pos.dtype))


def packed_seeding_applies(segments, window: int, band: int, min_context: int = 0) -> bool:
    """Whether ``seed_packed_`` seeds these packed segments: every one fresh (``start == 0``), and one that keeps
    ring positions (``ring_positions``) has fewer than ``band`` tokens before its last ``min(window, L)`` (so
    ``fresh_split_attention`` would not split it: its attention is one causal call and its ring's summaries a
    second pass either way)."""
    return all(s.start == 0 and (ring_positions(s, window, min_context) == 0
                                 or s.length - min(window, s.length) < band) for s in segments)


@dataclass(frozen=True)
class PackedSeeds:
    """Where a packed prefill's ring entries go (``packed_seeds``), made once per call and shared by the layers
    with this ``(window, band)``. A segment keeping ring positions (``ring_positions``) writes its last ``n =
    min(window, L)`` — its row reset and seeded at once, as ``seed_rings_`` does — and one keeping none writes
    nothing. ``M`` entries in token order.

    rows: ``[M]`` int64, the entries' tokens in the call (None: every token of the call's segments, in order);
    slots / cols / positions: ``[M]`` int64 ring row, column (``position mod window``) and prompt position;
    cleared: ``[P]`` int64 rows with fewer than ``window`` entries, emptied first (None if none);
    cu_q / cu_k: ``[B' + 1]`` int32 and used_k ``[B']`` int32, the far part's ``flash_varlen`` layout over the
    ``B'`` segments with entries (queries: the entries; keys: the segment's first ``L - band``); max_q / max_k."""

    rows: torch.Tensor | None
    slots: torch.Tensor
    cols: torch.Tensor
    positions: torch.Tensor
    cleared: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor
    max_q: int
    max_k: int


def packed_seeds(segments: tuple[PrefillSegment, ...], window: int, band: int,
                 device: torch.device, min_context: int = 0) -> PackedSeeds | None:
    """The ``PackedSeeds`` of fresh packed ``segments`` (``packed_seeding_applies``); None where no segment keeps
    a ring position (``ring_positions``). Built on the host, three copies to ``device``."""
    kept = [(s, min(window, s.length)) for s in segments if ring_positions(s, window, min_context) > 0]
    if not kept:
        return None
    pos = torch.cat([torch.arange(s.length - n, s.length) for s, n in kept])
    rows = torch.cat([torch.arange(s.offset + s.length - n, s.offset + s.length) for s, n in kept])
    slots = torch.cat([torch.full((n,), s.slot) for s, n in kept])
    ints = torch.stack([rows, slots, pos % window, pos]).to(device)
    cleared = [s.slot for s, n in kept if n < window]
    cu_q = torch.tensor([0] + [n for _, n in kept]).cumsum(0)
    used = torch.tensor([max(0, s.length - band) for s, _ in kept])
    starts = torch.tensor([s.offset for s, _ in kept] + [kept[-1][0].offset + kept[-1][0].length])
    small = torch.cat([cu_q, starts, used]).to(device=device, dtype=torch.int32)
    B = len(kept)
    every = rows.numel() == segments[-1].offset + segments[-1].length      # all tokens kept, in order
    return PackedSeeds(None if every else ints[0], ints[1], ints[2], ints[3],
                       torch.tensor(cleared, device=device) if cleared else None, small[: B + 1],
                       small[B + 1: 2 * B + 2], small[2 * B + 2:], max(n for _, n in kept), int(used.max()))


def seed_packed_(state, layer: int, seeds: PackedSeeds, query: torch.Tensor, q_pre: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, *, scale: float) -> None:
    """Seed the rings of every segment of a packed call at once: ``query / q_pre [1, Hq, N, d]`` (post- / pre-RoPE),
    ``key / value [1, Hkv, N, d]`` the call's tokens, ``state`` a ``MacState``. Entry ``t`` gets
    ``AS^{(t)}_{[0, t - band]}`` (``tail_summaries``' definition: flash's bf16 / fp16 rounding of o, empty where
    ``t < band``)."""
    q, k, v, qp = (x[0].transpose(0, 1) for x in (query, key, value, q_pre))    # token-major [N, H, d]
    if seeds.rows is not None:
        q, qp = q.index_select(0, seeds.rows), qp.index_select(0, seeds.rows)
    else:                   # the segments' tokens, not a decode tail after them (``core.ragged.DecodeTail``)
        q, qp = q[: seeds.slots.numel()], qp[: seeds.slots.numel()]
    o, lse = varlen_attention(q, k, v, seeds.cu_q, seeds.cu_k, seeds.max_q, seeds.max_k, scale=scale,
                              seqused_k=seeds.used_k)
    if seeds.cleared is not None:
        state.clear_rows(layer, seeds.cleared)
    state.write_columns(layer, seeds.slots, seeds.cols, seeds.positions, qp, AttentionSummary(o.float(), lse.t()))
