"""TensorRT-LLM PyTorch-backend metadata -> the inputs of one MAC decode step (pure; no ``tensorrt_llm``).

What TensorRT-LLM's ``AttentionMetadata`` (``_torch/attention_backend/interface.py``) carries for a step,
read by attribute name (:meth:`BatchView.from_metadata`; nothing is imported from ``tensorrt_llm``):

* ``seq_lens`` CPU int ``[num_seqs]``: query tokens of each sequence this step; the first ``num_contexts``
  sequences are context (prefill) chunks, the rest generation steps. ``q`` rows are packed in that order.
* ``request_ids`` ``[num_seqs]`` (``LlmRequest.py_request_id``).
* ``kv_cache_params.num_cached_tokens_per_seq`` ``[num_seqs]``: tokens already in the KV cache before the
  step (a generation token's position ``m`` is this count; after the step's append the keys are ``0..m``).
* ``kv_cache_manager.get_batch_cache_indices(request_ids)``: each sequence's KV block ids, and
  ``kv_cache_manager.tokens_per_block`` the block size.

:func:`mac_step_inputs` turns that into what ``MacDecodePlan.run`` / ``mac_decode_step_reference`` take for
the ``G`` generation tokens (``MacStepInputs``): token ``rows``, ``positions``, ring ``slots``, the
``page_table`` and KV lengths. :func:`paged_kv_views` views TensorRT-LLM's per-layer pool
(``KVCacheManager.get_buffers(layer)``: ``[num_blocks, 2, tokens_per_block, Hkv, d]`` NHD, or
``[num_blocks, 2, Hkv, tokens_per_block, d]`` HND) as the ``k, v [num_pages, page_size, Hkv, d]`` the
plan's paged path reads (strided views, no copy). :func:`gather_contiguous_kv` gathers pages into the
contiguous ``[G, Hkv, T, d]`` the CPU reference takes. :class:`RopeSpec` / :func:`rope_rotate` rotate a
pre-RoPE query at its positions (the backend receives pre-RoPE ``q`` because it declares fused RoPE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from macattn.builder.trtllm_attention import rope_tables

__all__ = ["BatchView", "MacStepInputs", "ContextSpan", "mac_step_inputs", "context_spans", "paged_kv_views",
           "gather_contiguous_kv", "RopeSpec", "rope_rotate", "KV_LAYOUTS"]

KV_LAYOUTS = ("NHD", "HND")


def _int_tuple(name: str, values, lo: int) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}[{i}] must be an int >= {lo}, got {v!r}")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class BatchView:
    """The step's batch as TensorRT-LLM's metadata gives it (host values; see the module docstring).

    seq_lens ``[N]`` query tokens per sequence (>= 1), num_contexts (first sequences that are context
    chunks), request_ids ``[N]``, num_cached ``[N]`` tokens in the KV cache before the step, block_ids
    ``[N][pages]`` KV block ids per sequence, tokens_per_block (>= 1).
    """

    seq_lens: tuple[int, ...]
    num_contexts: int
    request_ids: tuple[int, ...]
    num_cached: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    tokens_per_block: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", _int_tuple("seq_lens", self.seq_lens, 1))
        n = len(self.seq_lens)
        if isinstance(self.num_contexts, bool) or not isinstance(self.num_contexts, int) \
                or not 0 <= self.num_contexts <= n:
            raise ValueError(f"num_contexts must be an int in [0, {n}] (num_seqs), got {self.num_contexts!r}")
        object.__setattr__(self, "request_ids", _int_tuple("request_ids", self.request_ids, 0))
        object.__setattr__(self, "num_cached", _int_tuple("num_cached", self.num_cached, 0))
        object.__setattr__(self, "block_ids", tuple(_int_tuple(f"block_ids[{i}]", b, 0)
                                                    for i, b in enumerate(self.block_ids)))
        for name in ("request_ids", "num_cached", "block_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must have one entry per sequence ({n}), got {len(getattr(self, name))}")
        if len(set(self.request_ids)) != n:
            raise ValueError(f"request_ids must be distinct, got {list(self.request_ids)}")
        if isinstance(self.tokens_per_block, bool) or not isinstance(self.tokens_per_block, int) \
                or self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be an int >= 1, got {self.tokens_per_block!r}")
        for i, (c, s, b) in enumerate(zip(self.num_cached, self.seq_lens, self.block_ids)):
            if len(b) * self.tokens_per_block < c + s:
                raise ValueError(f"sequence {i} (request {self.request_ids[i]}) holds {c + s} tokens after the "
                                 f"step but its {len(b)} blocks of {self.tokens_per_block} do not cover them")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def from_metadata(cls, metadata) -> "BatchView":
        """Read TensorRT-LLM's ``AttentionMetadata`` (attribute names of ``interface.py``); the block ids
        come from ``metadata.kv_cache_manager.get_batch_cache_indices(request_ids)``."""
        missing = [a for a in ("seq_lens", "num_contexts", "request_ids", "kv_cache_params", "kv_cache_manager")
                   if getattr(metadata, a, None) is None]
        if missing:
            raise ValueError(f"metadata lacks {missing} (a TensorRT-LLM AttentionMetadata with a KV cache manager)")
        rids = list(metadata.request_ids)
        cached = metadata.kv_cache_params.num_cached_tokens_per_seq
        if cached is None:
            raise ValueError("metadata.kv_cache_params.num_cached_tokens_per_seq is None")
        n = int(metadata.seq_lens.shape[0])
        mgr = metadata.kv_cache_manager
        return cls(seq_lens=tuple(int(x) for x in metadata.seq_lens.tolist()),
                   num_contexts=int(metadata.num_contexts), request_ids=tuple(int(r) for r in rids),
                   num_cached=tuple(int(c) for c in list(cached)[:n]),
                   block_ids=tuple(tuple(int(b) for b in row) for row in mgr.get_batch_cache_indices(rids)),
                   tokens_per_block=int(mgr.tokens_per_block))


@dataclass(frozen=True)
class MacStepInputs:
    """The ``G`` generation tokens of a step as the decode plan takes them.

    rows ``[G]`` int64: token row in the packed ``q`` / output; positions ``[G]`` int64: ``m``;
    slots ``[G]`` int64: ring row; page_table ``[G, max_pages]`` int32 (padding entries 0);
    kv_lens ``[G]`` int32 = ``m + 1``; request_ids ``[G]``.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    request_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.rows.numel())


@dataclass(frozen=True)
class ContextSpan:
    """One context chunk: query rows ``[row_start, row_start + length)`` hold positions
    ``[first_position, first_position + length)`` of request ``request_id`` (ring ``slot``)."""

    request_id: int
    slot: int
    row_start: int
    first_position: int
    length: int

    @property
    def is_whole_prompt(self) -> bool:
        """True when the chunk starts at position 0 (no chunked prefill, no reused prefix)."""
        return self.first_position == 0


def mac_step_inputs(view: BatchView, slot_of, device: torch.device | str = "cpu") -> MacStepInputs:
    """The generation tokens of ``view``; ``slot_of(request_id) -> int`` gives each one's ring slot (e.g.
    ``RingSlotTable.slot``). A generation sequence must have exactly one query token (``ValueError``
    otherwise: speculative decoding's draft tokens are not supported)."""
    offsets = [0]
    for s in view.seq_lens:
        offsets.append(offsets[-1] + s)
    rows, pos, slots, rids, pages = [], [], [], [], []
    for i in range(view.num_contexts, view.num_seqs):
        if view.seq_lens[i] != 1:
            raise ValueError(f"generation sequence {i} (request {view.request_ids[i]}) has {view.seq_lens[i]} query "
                             f"tokens; MAC decodes one token per request and step (no draft tokens)")
        m = view.num_cached[i]
        rows.append(offsets[i])
        pos.append(m)
        slots.append(int(slot_of(view.request_ids[i])))
        rids.append(view.request_ids[i])
        pages.append(view.block_ids[i][:math.ceil((m + 1) / view.tokens_per_block)])
    G = len(rows)
    width = max((len(p) for p in pages), default=0)
    table = torch.zeros(G, max(width, 1), dtype=torch.int32)
    for g, p in enumerate(pages):
        table[g, :len(p)] = torch.tensor(p, dtype=torch.int32)
    if len(set(slots)) != G:
        raise ValueError(f"two generation requests share a ring slot: {dict(zip(rids, slots))}")
    as64 = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return MacStepInputs(as64(rows), as64(pos), as64(slots), table.to(device),
                         torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=device), tuple(rids))


def context_spans(view: BatchView, slot_of) -> tuple[ContextSpan, ...]:
    """The context chunks of ``view`` with their ring slots (for seeding the rings after prefill)."""
    spans, row = [], 0
    for i in range(view.num_contexts):
        spans.append(ContextSpan(view.request_ids[i], int(slot_of(view.request_ids[i])), row, view.num_cached[i],
                                 view.seq_lens[i]))
        row += view.seq_lens[i]
    return tuple(spans)


def paged_kv_views(buffer: torch.Tensor, kv_layout: str = "NHD") -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` each ``[num_blocks, tokens_per_block, Hkv, d]`` (views) of one layer's TensorRT-LLM pool
    ``buffer``: ``[num_blocks, 2, tokens_per_block, Hkv, d]`` (NHD) or ``[num_blocks, 2, Hkv,
    tokens_per_block, d]`` (HND); the last dimension stays contiguous, as the plan's paged path needs."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    if buffer.dim() != 5 or buffer.shape[1] != 2:
        raise ValueError(f"buffer must be [num_blocks, 2 (K and V), ...] 5-D, got {tuple(buffer.shape)} "
                         f"(a K-only cache, kv_factor 1, is not supported)")
    if buffer.stride(-1) != 1:
        raise ValueError("buffer's last dimension (head_dim) must be contiguous")
    k, v = buffer[:, 0], buffer[:, 1]
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def gather_contiguous_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                         kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``k, v [G, Hkv, T, d]`` (``T = max(kv_lens)``; rows past a request's length are zero)
    from pages ``[num_pages, page_size, Hkv, d]`` through ``page_table [G, max_pages]``: the CPU
    reference's layout."""
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must be equal 4-D [num_pages, page_size, Hkv, d], got "
                         f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    G = page_table.shape[0]
    if kv_lens.shape != (G,):
        raise ValueError(f"kv_lens must be [G={G}], got {tuple(kv_lens.shape)}")
    P, Hkv, d = k_pages.shape[1], k_pages.shape[2], k_pages.shape[3]
    T = int(kv_lens.max()) if G else 0
    k = k_pages.new_zeros(G, Hkv, T, d)
    v = v_pages.new_zeros(G, Hkv, T, d)
    t = torch.arange(T)
    for g in range(G):
        n = int(kv_lens[g])
        if n > page_table.shape[1] * P:
            raise ValueError(f"kv_lens[{g}] = {n} exceeds its {page_table.shape[1]} pages of {P}")
        pages = page_table[g, t[:n] // P].long()
        k[g, :, :n] = k_pages[pages, t[:n] % P].transpose(0, 1)
        v[g, :, :n] = v_pages[pages, t[:n] % P].transpose(0, 1)
    return k, v


_LINEAR = ("none", "linear")


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding MAC applies to the pre-RoPE query: rotate-half (GPT-NeoX) RoPE over the full
    head dimension ``head_dim`` with base ``theta`` and linear position scaling ``scale`` (1 = none),
    positions ``< max_positions``."""

    head_dim: int
    theta: float
    scale: float = 1.0
    max_positions: int = 4096

    def __post_init__(self) -> None:
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2 \
                or self.head_dim % 2:
            raise ValueError(f"head_dim must be an even int >= 2, got {self.head_dim!r}")
        if isinstance(self.max_positions, bool) or not isinstance(self.max_positions, int) or self.max_positions < 1:
            raise ValueError(f"max_positions must be an int >= 1, got {self.max_positions!r}")
        if not (isinstance(self.theta, (int, float)) and math.isfinite(self.theta) and self.theta > 1):
            raise ValueError(f"theta must be a finite float > 1, got {self.theta!r}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale >= 1):
            raise ValueError(f"scale must be a finite float >= 1 (linear RoPE scaling), got {self.scale!r}")

    @classmethod
    def from_rope_params(cls, rope, head_dim: int, *, is_neox: bool = True) -> "RopeSpec":
        """From TensorRT-LLM's ``RopeParams`` (fields ``dim``, ``theta``, ``scale_type``, ``scale``,
        ``max_positions``; ``PositionalEmbeddingParams.is_neox``). ``ValueError`` for what MAC's query
        rotation does not implement: partial rotary (``dim != head_dim``), GPT-J interleaved RoPE, and
        scaling other than none / linear (llama3, YaRN, longrope, dynamic)."""
        if not is_neox:
            raise ValueError("MAC rotates the query with rotate-half (GPT-NeoX) RoPE; is_neox=False is not supported")
        if int(rope.dim) != head_dim:
            raise ValueError(f"MAC needs full-width RoPE: rope.dim = {rope.dim}, head_dim = {head_dim}")
        kind = str(getattr(rope.scale_type, "name", rope.scale_type)).split(".")[-1].lower()
        if kind not in _LINEAR:
            raise ValueError(f"RoPE scaling {kind!r} is not supported by MAC's query rotation (none / linear)")
        return cls(head_dim, float(rope.theta), float(rope.scale) if kind == "linear" else 1.0,
                   int(rope.max_positions))

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` fp32 ``[max_positions, head_dim]`` (``trtllm_attention.rope_tables``)."""
        cos, sin = rope_tables(self.head_dim, self.max_positions, float(self.theta), float(self.scale))
        return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x [G, H, d]`` (pre-RoPE) rotated at ``positions [G]`` int64 with ``RopeSpec.tables``; computed in
    fp32, returned in ``x``'s dtype."""
    if x.dim() != 3 or positions.shape != (x.shape[0],):
        raise ValueError(f"x must be [G, H, d] and positions [G], got {tuple(x.shape)} and {tuple(positions.shape)}")
    d = x.shape[-1]
    if cos.shape[-1] != d:
        raise ValueError(f"tables are for head_dim {cos.shape[-1]}, x has {d}")
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin_signed.index_select(0, positions).unsqueeze(1)
    xf = x.float()
    swapped = torch.cat([xf[..., d // 2:], xf[..., :d // 2]], dim=-1)
    return (xf * c + swapped * s).to(x.dtype)
