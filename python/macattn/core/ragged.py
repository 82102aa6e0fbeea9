"""Packed (ragged) prefill attention: several requests' prompt chunks in one model call, no masks.

A packed call runs ``N`` tokens as one row (``[1, N]``): segment ``i`` is request ``i``'s chunk of
``length`` tokens at prompt positions ``start .. start + length - 1``, its tokens at
``offset .. offset + length - 1`` of the call (FlashAttention's ``cu_seqlens`` layout). The call writes
every token's K/V into the paged pool first; a segment with ``start > 0`` then attends to its
earlier positions through their pool rows (``history``).

Each segment's causal attention is one call of torch's ``scaled_dot_product_attention`` on contiguous
tensors: ``is_causal`` for a fresh segment (``start == 0``: the square causal mask, which every fused
backend takes), ``causal_lower_right`` for a chunk after earlier chunks (query ``j`` of the chunk sees
keys ``0 .. start + j``; flash / memory-efficient kernels take it without a mask). No ``n x n`` mask
is ever materialised. A call whose segments are all fresh and below cuDNN's size (``RaggedPrefill.varlen``) runs
as one flash call over the packed tokens (``core.flash_split.flash_varlen``, FlashAttention's ``cu_seqlens``)
instead of one call per segment. On CUDA a segment runs on cuDNN only where its attention is large enough to repay
cuDNN's per-shape plan build (``uses_cudnn``), else on flash; the backends are tried in the order
``CUDA_BACKENDS`` gives, chosen by measurement (``benchmarks/bench_prefill_floor.py``;
``benchmarks/notes/serving.md``, "Serving at the hardware floor").

A call may also carry decode rows after its segments (``DecodeTail``: the runtime's one-forward mixed step): one
token each, at its request's position ``m``, attending over ``[0, m]`` of the paged pool through the caller's
paged decode attention, so the streams that decode beside a prompt chunk cost no second forward.

``ragged_attention_reference`` is the plain-torch definition (explicit masks, fp32 / fp64) the tests
hold the packed path against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from macattn.core.attention import expand_kv_heads
from macattn.core.flash_split import flash_lower_right, flash_varlen, flash_varlen_reference, kv_splits

__all__ = ["DecodeTail", "PrefillSegment", "RaggedPrefill", "Varlen", "causal_attention", "split_causal_attention",
           "ragged_attention_reference", "continued_cudnn_shapes", "prewarm_cudnn_plans", "varlen_applies",
           "varlen_attention",
           "CUDA_BACKENDS", "CUDNN_MIN_WORK", "uses_cudnn"]

# SDPA backends for prefill on CUDA, in priority order (the dispatcher skips one that cannot take the
# inputs). H100, 8B shapes (benchmarks/results/bench_prefill_floor_h100.json): a fresh 32K causal prompt
# takes 427 ms on cuDNN vs 806 ms on flash; a chunk after earlier chunks through cuDNN's lower-right path
# 469 ms vs flash's 345 ms (8K queries over 32K keys), hence ``split_causal_attention`` for cuDNN there.
CUDA_BACKENDS = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH],
}

# cuDNN builds an execution plan for every new (queries, keys) shape, ~70 ms on the H100, once per shape
# per process (benchmarks/notes/serving.md: a new prompt length paid it on every layer's first call). Its
# kernels beat flash's only by ~0.5-3 ms per layer, so a segment runs on cuDNN where its attention work —
# query x key pairs: Q^2 / 2 for a fresh causal segment, Q x (S - Q) for a continued chunk's earlier keys
# — reaches this: 32 layers then save more than one build (fresh 16K: 88 ms saved; 8K over 16K: 85 ms;
# 2K over 26K: 30 ms, stays on flash; below ~4K flash is faster outright).
CUDNN_MIN_WORK = 1 << 27
# A continued chunk whose plans are already built (``prewarm_cudnn_plans``, at start-up) pays no build: it runs
# on cuDNN from this much work on, where cuDNN's kernels beat flash's outright (measured on the H100: an 8K
# chunk over 8K-24K of history took 180-300 ms of attention on flash, ~2x cuDNN's rate, notes/serving.md)
CUDNN_PLANNED_MIN_WORK = 1 << 24
_PLANNED: set[tuple[int, int]] = set()      # (Q, S) of continued chunks whose cuDNN plans this process built


def attention_work(Q: int, S: int) -> int:
    """Query x key pairs of a causal segment of ``Q`` queries at the last ``Q`` of ``S`` keys: ``Q^2 / 2`` for a
    fresh one, ``Q x (S - Q)`` (the earlier keys) for a continued chunk."""
    return Q * Q // 2 if Q == S else Q * (S - Q)


def uses_cudnn(Q: int, S: int) -> bool:
    """Whether a causal segment of ``Q`` queries at the last ``Q`` of ``S`` keys runs on cuDNN (CUDA)."""
    work = attention_work(Q, S)
    return work >= CUDNN_MIN_WORK or ((Q, S) in _PLANNED and work >= CUDNN_PLANNED_MIN_WORK)


@dataclass(frozen=True)
class PrefillSegment:
    """One request's chunk in a packed call.

    offset: index of its first token in the call; length: its tokens (>= 1); start: prompt position of
    its first token; slot: its state row; history: ``[start]`` int64 pool rows of positions
    ``0 .. start - 1`` on the pool's device (None when ``start == 0``); prompt_end: where the request's
    prefill ends (its prompt length; None: with this chunk), so a method that keeps state of the last
    positions only can skip what a later chunk overwrites."""

    offset: int
    length: int
    start: int
    slot: int
    history: torch.Tensor | None = None
    prompt_end: int | None = None

    @property
    def end(self) -> int:
        """Prompt position after its last token."""
        return self.start + self.length

    @property
    def prompt_length(self) -> int:
        """The request's prompt length: where its prefill ends (``prompt_end``, or this chunk's ``end``)."""
        return self.end if self.prompt_end is None else self.prompt_end

    def last_positions(self, n: int) -> int:
        """How many of this chunk's positions are among the prompt's last ``n`` (0 .. ``length``)."""
        return max(0, self.end - max(self.start, self.prompt_length - n))


@dataclass(frozen=True)
class DecodeTail:
    """Decode rows at the end of a packed call, after its segments: ``count`` tokens, each a running request's next
    token at its position ``m`` (its K/V written to the pool with the call's). ``attend(layer, q)``: their attention,
    ``q [count, Hq, d]`` (post-RoPE, token-major) over each row's positions ``[0, m]`` in the pool -> ``[count, Hq, d]``
    (any float dtype; the plan casts it to the query's)."""

    count: int
    attend: Callable[[int, torch.Tensor], torch.Tensor]


def varlen_applies(query: torch.Tensor) -> bool:
    """Whether packed fresh segments of ``query`` run as one ``flash_varlen`` call: CUDA, fp16 / bf16, head dim
    <= 256, not while tracing (the CPU keeps one SDPA call per segment, the tests' reference path)."""
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, *, scale: float, seqused_k: torch.Tensor | None = None,
                     lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flash_varlen`` on CUDA, its plain-torch definition elsewhere (same arguments and results)."""
    run = flash_varlen if q.is_cuda else flash_varlen_reference
    return run(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, seqused_k=seqused_k, lse=lse)


@dataclass(frozen=True)
class Varlen:
    """A packed call's fresh segments as one flash call: ``cu [B + 1]`` int32 (the segments' offsets and the
    call's token count, on the query's device) and ``max_len`` (the longest segment)."""

    cu: torch.Tensor
    max_len: int


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [1, Hq, Q, d]`` at the last ``Q`` positions of ``k, v [1, Hkv, S, d]`` (``S >= Q``), causal:
    query ``j`` sees keys ``0 .. S - Q + j``. Returns ``[1, Hq, Q, d]`` in ``q``'s dtype.

    On CUDA a segment large enough for cuDNN (``uses_cudnn``) runs there — a continued chunk as two cuDNN
    calls merged by their log-sum-exps (``split_causal_attention``) — and any other on flash: a short continued
    chunk over a long history split over its keys (``core.flash_split``), the rest in one call."""
    Q, S = q.shape[2], k.shape[2]
    if not q.is_cuda:
        return _sdpa(q, k, v, scale)
    cudnn = uses_cudnn(Q, S)
    if cudnn and Q != S:
        out = _cudnn_split(q, k, v, scale)
        if out is not None:
            return out
    if (not cudnn and Q < S and q.dtype in (torch.float16, torch.bfloat16)
            and kv_splits(Q, q.shape[1], S, q.device) > 1):    # a short chunk over a long history
        return flash_lower_right(q, k, v, scale)[0].to(q.dtype)
    with sdpa_kernel(CUDA_BACKENDS["cudnn" if cudnn and Q == S else "flash"], set_priority=True):
        return _sdpa(q, k, v, scale)


_SPLIT_OK: dict = {}


def _cudnn_split(q, k, v, scale) -> torch.Tensor | None:
    """``split_causal_attention``, or None where cuDNN refuses it on this device (then, and from then on, the
    caller takes the fused lower-right path)."""
    if not _SPLIT_OK.get(q.device, True):
        return None
    try:
        return split_causal_attention(q, k, v, scale)
    except RuntimeError:
        _SPLIT_OK[q.device] = False
        return None


def continued_cudnn_shapes(chunks, max_seq_len: int) -> list[tuple[int, int]]:
    """The ``(Q, S)`` shapes of the continued chunks worth cuDNN's split path once their plans are built, when
    prompts of up to ``max_seq_len`` tokens are prefilled in parts of each length in ``chunks``: the ``j``-th part
    (``j >= 1``) is ``Q`` queries over ``S = (j + 1) Q`` keys, with at least ``CUDNN_PLANNED_MIN_WORK`` of work."""
    shapes = []
    for Q in sorted(set(chunks)):
        S = 2 * Q
        while Q > 0 and S <= max_seq_len:
            if attention_work(Q, S) >= CUDNN_PLANNED_MIN_WORK:
                shapes.append((Q, S))
            S += Q
    return shapes


def prewarm_cudnn_plans(shapes, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device) -> list[tuple[int, int]]:
    """Run ``split_causal_attention`` once per ``(Q, S)`` of ``shapes`` on zeros laid out as a packed prefill lays
    them out (token-major keys, ``segment_kv``), so cuDNN builds those execution plans now, not inside a served
    step (~70 ms a shape, ~1.2 s the first of its kind, measured on the H100); ``uses_cudnn`` then sends those
    shapes to cuDNN from ``CUDNN_PLANNED_MIN_WORK`` on. Returns the shapes built (none where cuDNN refuses the
    split, which then stays off for the device, as in ``causal_attention``)."""
    built = []
    for Q, S in shapes:
        q = torch.zeros(1, num_q_heads, Q, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(S, num_kv_heads, head_dim, dtype=dtype, device=device).transpose(0, 1).unsqueeze(0)
        if _cudnn_split(q, kv, kv, head_dim ** -0.5) is None:
            break
        built.append((Q, S))
        _PLANNED.add((Q, S))
    return built


def _sdpa(q, k, v, scale):
    Q, S = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if Q == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Q, S), scale=scale, enable_gqa=gqa)


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``causal_attention`` of a continued chunk (``Q < S``, CUDA, cuDNN) as the chunk's queries over the
    ``S - Q`` earlier keys (no mask) and over its own ``Q`` keys (square causal), merged through the two
    log-sum-exps in fp32. GQA without expanding heads. Raises ``RuntimeError`` where cuDNN refuses."""
    Q, S = q.shape[2], k.shape[2]
    q = q.contiguous()
    attn = torch.ops.aten._scaled_dot_product_cudnn_attention
    o1, l1 = attn(q, k[:, :, : S - Q], v[:, :, : S - Q], None, True, 0.0, False, False,
                  scale=scale)[:2]
    o2, l2 = attn(q, k[:, :, S - Q:], v[:, :, S - Q:], None, True, 0.0, True, False,
                  scale=scale)[:2]
    l1, l2 = l1.reshape(o1.shape[:3]).float(), l2.reshape(o2.shape[:3]).float()
    lse = torch.logaddexp(l1, l2)
    out = o1.float() * torch.exp(l1 - lse).unsqueeze(-1) + o2.float() * torch.exp(l2 - lse).unsqueeze(-1)
    return out.to(q.dtype)


class RaggedPrefill:
    """The per-call plan of a packed prefill (``StepContext.prefill``), built by the runtime.

    segments: the call's ``PrefillSegment``s in token order; k_pool / v_pool: per layer the flat paged
    pools ``[rows, Hkv, d]`` (already holding this call's K/V when a layer's attention runs); tail: the decode
    rows after the segments (``DecodeTail``; None: none). ``num_tokens`` counts the segments' tokens, the call has
    ``num_tokens + tail.count``.
    """

    def __init__(self, segments: list[PrefillSegment], k_pool: list[torch.Tensor], v_pool: list[torch.Tensor],
                 tail: DecodeTail | None = None) -> None:
        if not segments:
            raise ValueError("a packed prefill needs at least one segment")
        self.segments = tuple(segments)
        self.k_pool, self.v_pool = k_pool, v_pool
        self.num_tokens = segments[-1].offset + segments[-1].length
        self.tail = tail
        self._slot_rows: dict = {}
        self._memo: dict = {}

    def memo(self, key, build):
        """``build()``'s result, made once per call under ``key`` (per-call index tensors a method derives from
        the segments, shared by every layer)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def varlen(self, query: torch.Tensor) -> Varlen | None:
        """The call as one ``flash_varlen`` call, where every segment is fresh (``start == 0``) and runs on flash
        (not ``uses_cudnn``) and ``varlen_applies(query)``; else None (one call per segment)."""
        if not varlen_applies(query):
            return None

        def build() -> Varlen | None:       # once per call: every layer of it asks
            if any(s.start or uses_cudnn(s.length, s.length) for s in self.segments):
                return None
            cu = [s.offset for s in self.segments] + [self.num_tokens]
            return Varlen(torch.tensor(cu, dtype=torch.int32).to(query.device, non_blocking=True),   # no stream sync
                          max(s.length for s in self.segments))
        return self.memo(("varlen", query.device), build)

    def slot_row(self, i: int, device: torch.device) -> torch.Tensor:
        """Segment ``i``'s state slot as a ``[1]`` int64 tensor on ``device`` (made once per call, not per layer)."""
        rows = self._slot_rows.get(device)
        if rows is None:
            rows = self._slot_rows[device] = torch.tensor(self.slots, dtype=torch.int64, device=device)
        return rows[i: i + 1]

    @property
    def slots(self) -> list[int]:
        return [s.slot for s in self.segments]

    def last_token_indices(self) -> list[int]:
        """Index in the call of each segment's last token (whose logits the runtime keeps)."""
        return [s.offset + s.length - 1 for s in self.segments]

    def segment_kv(self, layer: int, i: int, key: torch.Tensor, value: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ``i``'s keys / values of positions ``0 .. end - 1``, ``[1, Hkv, end, d]``: its history
        from the pool followed by this call's ``key / value [1, Hkv, N, d]`` rows."""
        seg = self.segments[i]
        k_new = key[:, :, seg.offset: seg.offset + seg.length]
        v_new = value[:, :, seg.offset: seg.offset + seg.length]
        if seg.history is None:
            return k_new, v_new
        return (_behind_history(self.k_pool[layer], seg.history, k_new),
                _behind_history(self.v_pool[layer], seg.history, v_new))

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float, each=None, segment_attention=None) -> torch.Tensor:
        """Causal attention of every segment: ``query [1, Hq, N, d]`` (post-RoPE), ``key / value
        [1, Hkv, N, d]`` (this call's tokens) -> ``[1, N, Hq, d]`` in ``query``'s dtype. ``each(i, k, v)``, when
        given, gets segment ``i``'s keys / values (``segment_kv``'s) as they are used, so a method writing
        per-segment state reads them without gathering a continued segment's history again.
        ``segment_attention(i, q, k, v)``, when given, may compute segment ``i``'s causal attention itself
        (``[1, Hq, Q, d]``, or a tuple of consecutive query rows' parts ``[1, Hq, Q_j, d]`` that the call's one
        concatenation joins; e.g. with the method's state as a by-product) or return None for
        ``causal_attention``'s; it runs before ``each(i, k, v)``. Without it, a call of fresh segments on flash runs
        as one ``flash_varlen`` call (``varlen``). The tail's rows (``DecodeTail``) follow the segments' in the
        output."""
        if self.tail is None:
            return self._attend_segments(layer, query, key, value, scale, each, segment_attention)
        n = self.num_tokens
        if query.shape[2] != n + self.tail.count:
            raise ValueError(f"a packed call with a decode tail has {n} + {self.tail.count} tokens, got query "
                             f"{tuple(query.shape)}")
        out = self._attend_segments(layer, query[:, :, :n], key[:, :, :n], value[:, :, :n], scale, each,
                                    segment_attention)
        rows = self.tail.attend(layer, query[0, :, n:].transpose(0, 1))
        return torch.cat([out, rows.to(out.dtype).unsqueeze(0)], dim=1)

    def _attend_segments(self, layer, query, key, value, scale, each, segment_attention) -> torch.Tensor:
        packed = None if segment_attention is not None else self.varlen(query)
        if packed is not None:
            q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))         # token-major [N, H, d]
            out = varlen_attention(q, k, v, packed.cu, packed.cu, packed.max_len, packed.max_len, scale=scale,
                                   lse=False)[0]
            for i in range(len(self.segments) if each is not None else 0):
                each(i, *self.segment_kv(layer, i, key, value))
            return out.unsqueeze(0)
        outs = []
        for i, seg in enumerate(self.segments):
            k, v = self.segment_kv(layer, i, key, value)
            q = query[:, :, seg.offset: seg.offset + seg.length]
            out = None if segment_attention is None else segment_attention(i, q, k, v)
            if out is None:
                out = causal_attention(q, k, v, scale)
            outs += [part.transpose(1, 2) for part in (out if isinstance(out, tuple) else (out,))]
            if each is not None:
                each(i, k, v)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _behind_history(pool: torch.Tensor, history: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``pool [rows, Hkv, d]``'s rows ``history [start]`` followed by ``new [1, Hkv, Q, d]``, as a
    ``[1, Hkv, start + Q, d]`` view (in ``new``'s dtype) of one token-major buffer ``[start + Q, Hkv, d]``: the
    history is gathered straight into the buffer's head and ``new`` copied behind it, so no concatenation pass
    re-reads the history (at 32K of history that pass took ~0.2 ms per layer and tensor on the H100). The
    token-major layout is the one flash attention reads (``[B, S, H, d]``); the last dimension stays contiguous."""
    start = history.shape[0]
    buf = torch.empty((start + new.shape[2], *pool.shape[1:]), dtype=new.dtype, device=new.device)
    if pool.dtype == new.dtype:
        torch.index_select(pool, 0, history, out=buf[:start])
    else:
        buf[:start].copy_(pool.index_select(0, history))
    buf[start:].copy_(new[0].transpose(0, 1))
    return buf.transpose(0, 1).unsqueeze(0)


def ragged_attention_reference(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                               lengths: list[int], scale: float) -> torch.Tensor:
    """The definition: ``query [1, Hq, N, d]`` split into segments of ``lengths``; segment ``i``'s
    queries are the last ``lengths[i]`` positions of ``keys[i] / values[i] [1, Hkv, S_i, d]`` and see
    keys up to their own position (explicit mask, fp32 or fp64 math). Returns ``[1, N, Hq, d]`` fp32/fp64."""
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    Hq = query.shape[1]
    outs, off = [], 0
    for k, v, n in zip(keys, values, lengths):
        q = query[:, :, off: off + n].to(acc)
        S = k.shape[2]
        logits = torch.einsum("bhqd,bhsd->bhqs", q, expand_kv_heads(k, Hq).to(acc)) * scale
        allowed = torch.arange(S, device=q.device).view(1, S) <= (S - n + torch.arange(n, device=q.device)).view(n, 1)
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("bhqs,bhsd->bqhd", p, expand_kv_heads(v, Hq).to(acc)))
        off += n
    return torch.cat(outs, dim=1)
