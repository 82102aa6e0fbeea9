"""Offloaded retrieval-completion decode (docs/spec.md §3 in seed 003's own setting, issue 20 items 3–4): the prefill
KV of a request lives in host memory in pages; the device keeps only what every step reads and a cache of
hot pages, and a step fetches the pages it selects.

Per request slot (``S`` slots, ``L`` layers, ``Hkv`` KV heads, head dim ``d``, ``F`` features, pages of
``page`` tokens on absolute positions, ``P = ceil(max_prefill / page)``, ``C = hot_pages``, ``K =
budget_pages``):

==================  =============================  =================================================
field               shape                          where / meaning
==================  =============================  =================================================
host_k, host_v      ``[S, L, Hkv, P, page, d]``    host (pinned with a CUDA device): prefill K / V
host_lpk            ``[S, L, Hkv, P, page, F]``    host, fp32: log φ_k of the prefill keys
anchor_k/v[l]       ``[S, Hkv, A, d]``             device: the exact tokens in item order — sinks
                                                   ``[0, s0)``, then ``[m1, seq_len)`` (tail and every
                                                   generated token); ``A = n_sink + n_tail + max_generated``
page_lo/hi[l]       ``[S, Hkv, P, d]``             device, fp32: Quest bounds of the cache's keys
comp_a/b/shift[l]   ``[S, Hkv, F(, d)]``           device, fp32: the completion cache (docs/spec.md §3)
cache_k/v[l]        ``[S, Hkv, C·page, d]``        device: the hot-page cache (``C`` pages per KV head)
cache_lpk[l]        ``[S, Hkv, C·page, F]``        device, fp32: their log φ_k rows
slot_of_page[l]     ``[S, Hkv, P + 1]``            device int64: cache slot of each page, -1 if absent
page_of_slot[l]     ``[S, Hkv, C + 1]``            device int64: page in each cache slot, -1 if none
stamp[l]            ``[S, Hkv, C + 1]``            device int64: last use (LRU); the extra column of
                                                   these three tables is a scatter sink
seq_len, n_prefill  ``[S]``                        device int64
hits, misses        ``[S]``                        device int64: selected pages served from the cache /
                                                   fetched from the host, over the slot's steps
prefetched          ``[S]``                        device int64: pages a prefetch fetched
==================  =============================  =================================================

A decode step of layer ``l`` (``decode``): the token's K/V join the anchors and the bounds; ``select_mid_pages``
chooses ``K`` pages per KV head from the bounds (the page selector of the GPU-resident op,
``macattn::page_retrieval_completion``); ``lru_update`` finds them in the cache, gives the misses the least
recently used slots and returns each selected token's cache row; ``gather_pages`` copies the misses' K, V and
log φ_k from the host (on the GPU: one kernel reading pinned host memory, no host synchronisation); the shared
tail (``decode_retrieved_triton`` on the GPU, its fp64 reference on the CPU) attends exactly over the anchors
and the selected tokens and merges the completion under one normalisation. So the offloaded step computes the
GPU-resident page-selector step exactly (same bounds, same pages, same tokens) — tested against it and the fp64
reference.

Prefetch (``OffloadConfig.prefetch = "query"``): after layer ``l`` fetched its pages, the pages layer ``l+1``
would select under layer ``l``'s query are fetched for it on a copy stream, overlapping layer ``l``'s
attention and the rest of the layer; layer ``l+1`` waits for that stream before its own fetch, which then
finds those pages hot. Layer ``l``'s query is used, not the previous step's selection, because the previous
step's pages of layer ``l+1`` are already in its cache (``hot_pages >= budget_pages``): only a guess of what
is new can save fetch time. A wrong guess costs bandwidth and cache room (``hot_pages >= 2·budget_pages``
keeps the previous step's pages from being evicted by it).

Nothing of a step reads the device from the host on CUDA (CUDA-graph capturable, the copy stream included);
on the CPU every tier is a CPU tensor and the same code runs (``gather_pages_torch``, the reference tail).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macattn.core.slot_pool import SlotPool
from macattn.core.validation import check_int
from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.gate import gated_log_phi_q
from macattn.methods.completion.reference import (decode_retrieved_reference, layer_top_k, page_bounds, partition,
                                                  select_mid_pages_reference)

__all__ = ["OffloadConfig", "OffloadedKV", "PREFETCH", "lru_update", "offload_bytes", "pinned_zeros"]

PREFETCH = ("none", "query")


@dataclass(frozen=True)
class OffloadConfig:
    """hot_pages: device cache per (layer, KV head) in pages (>= the step's pages per KV head,
    ``CompletionConfig.pages_for(top_k)``); max_generated: generated tokens a request may hold (device
    rows); max_prefill: prompt tokens a slot's host pages hold; prefetch: ``"query"`` or ``"none"`` (module
    doc); host_budget_bytes: host memory for all slots' pages; device_budget_bytes: device memory per
    request (anchors, bounds, completion cache, hot cache, LRU tables)."""

    hot_pages: int = 128
    max_generated: int = 1024
    max_prefill: int = 131072
    prefetch: str = "query"
    host_budget_bytes: int = 96 << 30
    device_budget_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        check_int("hot_pages", self.hot_pages, 1)
        check_int("max_generated", self.max_generated, 1)
        check_int("max_prefill", self.max_prefill, 1)
        check_int("host_budget_bytes", self.host_budget_bytes, 1)
        check_int("device_budget_bytes", self.device_budget_bytes, 1)
        if self.prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {PREFETCH}, got {self.prefetch!r}")


def offload_bytes(cfg: CompletionConfig, off: OffloadConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                  feature_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of one request slot: ``host`` (pages of ``max_prefill`` tokens: K, V, log φ_k) and ``device``
    (anchors, bounds, completion cache, hot cache, LRU tables), and ``full_kv`` (K and V of ``max_prefill``
    tokens, what the GPU-resident op keeps)."""
    L, H, d, F, page = num_layers, num_kv_heads, head_dim, feature_dim, cfg.page_size
    P = -(-off.max_prefill // page)
    e = dtype.itemsize
    A = cfg.n_sink + cfg.n_tail + off.max_generated
    C = off.hot_pages
    host = L * H * P * page * (2 * d * e + F * 4)
    device = L * H * (2 * A * d * e + 2 * P * d * 4 + (F * d + 2 * F) * 4 + C * page * (2 * d * e + F * 4)
                      + 8 * ((P + 1) + 2 * (C + 1)))
    return {"host": host, "device": device, "full_kv": 2 * L * H * off.max_prefill * d * e}


def pinned_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor page-locked with ``cudaHostRegister`` (exactly its size: torch's pinned allocator
    rounds an allocation up to a power of two, 16 GiB for 8.6 GB of pages), unregistered when the returned
    tensor object is freed (hold it, not only views of it);
    ``torch.zeros(..., pin_memory=True)`` where registering fails. Registered memory is mapped into the
    device's address space (unified addressing), so kernels read it in place."""
    import weakref

    t = torch.zeros(*shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    ret = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(ret, "value", ret)) != 0:
        return t.pin_memory()
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())   # keep ``t`` (not only views of it) alive
    return t


def lru_update(slot_of_page: torch.Tensor, page_of_slot: torch.Tensor, stamp: torch.Tensor, pages: torch.Tensor,
               now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Look ``pages [S, Hkv, K]`` (int64, -1 = none) up in the cache tables of one layer and update them in
    place (device ops, no host synchronisation): hits get stamp ``now`` (a 0-d or ``[1]`` int64 tensor);
    misses take the least recently used slots (never a slot hit now: needs ``C >= K``), whose old pages
    leave. Tables: ``slot_of_page [S, Hkv, P + 1]``, ``page_of_slot / stamp [S, Hkv, C + 1]`` (the last
    column a scatter sink). Returns ``(slots [S, Hkv, K] int64, miss [S, Hkv, K] bool)``: each page's cache
    slot (0 where none) and whether it must be fetched."""
    P, C, K = slot_of_page.shape[2] - 1, stamp.shape[2] - 1, pages.shape[2]
    if K > C:
        raise ValueError(f"hot_pages={C} must be >= the pages a step selects per KV head ({K})")
    valid = pages >= 0
    cur = slot_of_page.gather(2, torch.where(valid, pages, P))                  # the sink column holds -1
    hit = valid & (cur >= 0)
    miss = valid & ~hit
    now_k = now.reshape(1, 1, 1).expand_as(pages)
    stamp.scatter_(2, torch.where(hit, cur, C), now_k)
    if K:
        cand = torch.topk(stamp[..., :C], K, dim=2, largest=False, sorted=True).indices
        new = cand.gather(2, (miss.cumsum(2) - 1).clamp(min=0))
    else:
        new = torch.zeros_like(pages)
    new = torch.where(miss, new, C)
    old = page_of_slot.gather(2, new)                                            # evicted pages (-1: none)
    slot_of_page.scatter_(2, torch.where(miss & (old >= 0), old, P), -1)
    slot_of_page.scatter_(2, torch.where(miss, pages, P), torch.where(miss, new, -1))
    page_of_slot.scatter_(2, new, torch.where(miss, pages, -1))
    stamp.scatter_(2, new, now_k)
    return torch.where(hit, cur, torch.where(miss, new, 0)), miss


@dataclass
class OffloadedKV(SlotPool):
    """The offloaded tiers of ``num_slots`` requests (module docstring). ``allocate`` checks capacity before
    allocating anything."""

    SLOT_KIND = "offloaded completion"

    cfg: CompletionConfig
    off: OffloadConfig
    host_k: torch.Tensor
    host_v: torch.Tensor
    host_lpk: torch.Tensor
    anchor_k: list[torch.Tensor]
    anchor_v: list[torch.Tensor]
    page_lo: list[torch.Tensor]
    page_hi: list[torch.Tensor]
    comp_a: list[torch.Tensor]
    comp_b: list[torch.Tensor]
    comp_shift: list[torch.Tensor]
    cache_k: list[torch.Tensor]
    cache_v: list[torch.Tensor]
    cache_lpk: list[torch.Tensor]
    slot_of_page: list[torch.Tensor]
    page_of_slot: list[torch.Tensor]
    stamp: list[torch.Tensor]
    seq_len: torch.Tensor
    n_prefill: torch.Tensor
    hits: torch.Tensor
    misses: torch.Tensor
    prefetched: torch.Tensor
    clock: torch.Tensor
    in_use: torch.Tensor
    _free: list[int] = field(default_factory=list, repr=False)
    use_kernels: bool = False
    completion: bool = True
    _host_tokens: dict = field(default_factory=dict, repr=False)
    _copy_stream: object = None
    _events: list = field(default_factory=list, repr=False)
    _log_mass: list = field(default_factory=list, repr=False)   # per layer the gate's log_mass [Hq] or None

    @classmethod
    def allocate(cls, cfg: CompletionConfig, off: OffloadConfig, *, num_layers: int, num_slots: int,
                 num_kv_heads: int, head_dim: int, feature_dim: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", use_kernels: bool | None = None, completion: bool = True,
                 host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> "OffloadedKV":
        """``cfg``: the method's config (``selector="quest"`` with a fixed ``top_k``: pages of ``page_size``,
        ``pages_for(top_k)`` of them per KV head and step). ``use_kernels`` (None: on CUDA): the Triton page
        selector, gather and tail, else the torch / fp64 reference twins. ``completion=False``: the Top-k-only
        baseline (softmax over the exact set; log φ_k pages never fetched). ``host``: existing host tensors
        ``(k, v, log_phi_k)`` of the shapes in the module docstring (e.g. one request's pages expanded over the
        slots, for a benchmark of requests with one prompt), used instead of allocating. ``ValueError`` naming
        the budget or parameter when the slots do not fit (nothing allocated)."""
        for name, val in (("num_layers", num_layers), ("num_slots", num_slots), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim), ("feature_dim", feature_dim)):
            check_int(name, val, 1)
        if cfg.selector != "quest" or cfg.top_k is None:
            raise ValueError(f"the offloaded decode needs selector='quest' and a fixed top_k, got "
                             f"selector={cfg.selector!r}, top_k={cfg.top_k!r}")
        if cfg.gate is not None:
            cfg.gate.check_layers(num_layers)
        K = max(cfg.pages_for(layer_top_k(cfg.gate, layer, cfg.top_k, feature_dim=feature_dim, head_dim=head_dim)[0])
                for layer in range(num_layers))
        if K > off.hot_pages:
            raise ValueError(f"hot_pages={off.hot_pages} must be >= the pages a step selects per KV head "
                             f"(ceil(top_k / page_size={cfg.page_size}) = {K} with top_k={cfg.top_k} and the gate's "
                             f"Top-k alone of the layers it turns off)")
        need = offload_bytes(cfg, off, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             feature_dim=feature_dim, dtype=dtype)
        if need["host"] * num_slots > off.host_budget_bytes:
            raise ValueError(f"host_budget_bytes={off.host_budget_bytes} is too small: {num_slots} slots of "
                             f"max_prefill={off.max_prefill} tokens need {need['host'] * num_slots} bytes of host pages")
        if need["device"] > off.device_budget_bytes:
            raise ValueError(f"device_budget_bytes={off.device_budget_bytes} is too small: a request needs "
                             f"{need['device']} bytes on the device (anchors, bounds, completion and hot-page caches)")
        device = torch.device(device)
        gpu = device.type == "cuda"
        S, L, H, d, F, page = num_slots, num_layers, num_kv_heads, head_dim, feature_dim, cfg.page_size
        P = -(-off.max_prefill // page)
        A = cfg.n_sink + cfg.n_tail + off.max_generated
        C = off.hot_pages

        def alloc_host(*shape, dt):
            return pinned_zeros(*shape, dtype=dt) if gpu else torch.zeros(*shape, dtype=dt)

        def dev(*shape, dt=torch.float32, fill=0):
            return [torch.full(shape, fill, dtype=dt, device=device) for _ in range(L)]

        i64 = dict(dtype=torch.int64, device=device)
        if host is not None:
            shapes = [(S, L, H, P, page, d)] * 2 + [(S, L, H, P, page, F)]
            if [tuple(t.shape) for t in host] != shapes:
                raise ValueError(f"host tensors must have shapes {shapes}, got {[tuple(t.shape) for t in host]}")
            hk, hv, hl = host
        else:
            hk, hv, hl = (alloc_host(S, L, H, P, page, d, dt=dtype), alloc_host(S, L, H, P, page, d, dt=dtype),
                          alloc_host(S, L, H, P, page, F, dt=torch.float32))
        st = cls(cfg, off, hk, hv, hl, dev(S, H, A, d, dt=dtype), dev(S, H, A, d, dt=dtype),
                 dev(S, H, P, d), dev(S, H, P, d), dev(S, H, F, d), dev(S, H, F), dev(S, H, F),
                 dev(S, H, C * page, d, dt=dtype), dev(S, H, C * page, d, dt=dtype), dev(S, H, C * page, F),
                 dev(S, H, P + 1, dt=torch.int64, fill=-1), dev(S, H, C + 1, dt=torch.int64, fill=-1),
                 dev(S, H, C + 1, dt=torch.int64, fill=-1), torch.zeros(S, **i64), torch.zeros(S, **i64),
                 torch.zeros(S, **i64), torch.zeros(S, **i64), torch.zeros(S, **i64), torch.zeros(1, **i64), torch.zeros(S, dtype=torch.bool),
                 list(range(S - 1, -1, -1)), gpu if use_kernels is None else use_kernels, bool(completion))
        st._log_mass = cfg.gate.log_mass_tensors(device) if cfg.gate is not None else [None] * L
        if gpu and off.prefetch == "query":
            st._copy_stream = torch.cuda.Stream(device)
            st._events = [torch.cuda.Event() for _ in range(L)]
        return st

    # --- shapes ----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.anchor_k)

    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def budget_pages(self) -> int:
        """Pages per KV head and step of a layer with the completion term (the config's ``top_k``)."""
        return self.cfg.pages_for(self.cfg.top_k)

    def layer_plan(self, layer: int) -> tuple[int, bool]:
        """``(pages per KV head and step, completion term on)`` of ``layer``: its gated Top-k
        (``reference.layer_top_k``) in pages; the term is off everywhere with ``completion=False``."""
        k, on = layer_top_k(self.cfg.gate, layer, self.cfg.top_k, feature_dim=self.cache_lpk[layer].shape[3],
                            head_dim=self.anchor_k[layer].shape[3])
        return self.cfg.pages_for(k), on and self.completion

    # --- per-slot state protocol -------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """Empty ``slot``: its written host pages and its device rows zero, no cached page, counters 0 (host
        pages past the last request's are zero already, or never read: only a request's own pages are)."""
        self._check_slot(slot)
        n_pages = -(-self._host_tokens.pop(slot, 0) // self.page_size)
        for t in (self.host_k, self.host_v, self.host_lpk):
            t[slot, :, :, :n_pages].zero_()
        for name in ("anchor_k", "anchor_v", "page_lo", "page_hi", "comp_a", "comp_b", "comp_shift", "cache_k",
                     "cache_v", "cache_lpk"):
            for t in getattr(self, name):
                t[slot].zero_()
        for name in ("slot_of_page", "page_of_slot", "stamp"):
            for t in getattr(self, name):
                t[slot].fill_(-1)
        for t in (self.seq_len, self.n_prefill, self.hits, self.misses, self.prefetched):
            t[slot] = 0

    # --- admission (prefill) -------------------------------------------------------------------
    def admit_layer(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, log_phi_k: torch.Tensor,
                    comp: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, write_host: bool = True) -> None:
        """Request ``slot``'s prefill of ``layer``: ``k / v [Hkv, N, d]`` (post-RoPE keys), ``log_phi_k [Hkv, N,
        F]`` fp32, ``comp = (A [Hkv, F, d], b [Hkv, F], shift [Hkv, F])`` its completion cache. Pages go to
        the host, sinks and tail to the anchors, bounds and the cache to the device. ``ValueError`` when
        ``N`` exceeds ``max_prefill``. ``write_host=False``: the host pages hold this prompt already."""
        self._check_slot(slot)
        check_int("layer", layer, 0, self.num_layers - 1)
        H, N, d = k.shape
        if N > self.off.max_prefill or N < 1:
            raise ValueError(f"prompt length must be in [1, max_prefill={self.off.max_prefill}], got {N}")
        page = self.page_size
        n_pages = -(-N // page)

        def to_host(dst: torch.Tensor, x: torch.Tensor) -> None:
            flat = dst.view(H, -1, x.shape[-1])
            flat[:, :N].copy_(x, non_blocking=True)
            flat[:, N:n_pages * page].zero_()

        if write_host:
            self._host_tokens[slot] = max(self._host_tokens.get(slot, 0), N)
            to_host(self.host_k[slot, layer], k.to(self.host_k.dtype))
            to_host(self.host_v[slot, layer], v.to(self.host_v.dtype))
            to_host(self.host_lpk[slot, layer], log_phi_k.float())
        p = partition(N, N, n_sink=self.cfg.n_sink, n_tail=self.cfg.n_tail)
        anchors = torch.cat([torch.arange(p.mid_start), torch.arange(p.mid_end, N)]).to(k.device)
        n_anchor = anchors.numel()
        self.anchor_k[layer][slot, :, :n_anchor] = k[:, anchors]
        self.anchor_v[layer][slot, :, :n_anchor] = v[:, anchors]
        lo, hi = page_bounds(k, page, torch.float32)
        self.page_lo[layer][slot, :, :n_pages], self.page_hi[layer][slot, :, :n_pages] = lo, hi
        self.page_lo[layer][slot, :, n_pages:], self.page_hi[layer][slot, :, n_pages:] = float("inf"), float("-inf")
        self.comp_a[layer][slot], self.comp_b[layer][slot], self.comp_shift[layer][slot] = comp
        self.slot_of_page[layer][slot].fill_(-1)
        self.page_of_slot[layer][slot].fill_(-1)
        self.stamp[layer][slot].fill_(-1)
        if layer == 0:
            self.seq_len[slot] = N
            self.n_prefill[slot] = N

    # --- decode ----------------------------------------------------------------------------
    def append(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The decode tokens ``k / v [B, Hkv, d]`` at ``positions [B]`` of ``slots [B]`` join the anchors (row
        ``s0 + position - m1``) and their pages' bounds. Positions must be below ``n_prefill + max_generated``
        (the engine admits no more)."""
        npf = self.n_prefill[slots]
        s0 = npf.clamp(max=self.cfg.n_sink)
        m1 = torch.maximum(s0, npf - self.cfg.n_tail)
        row = s0 + positions - m1
        self.anchor_k[layer][slots, :, row] = k.to(self.anchor_k[layer].dtype)
        self.anchor_v[layer][slots, :, row] = v.to(self.anchor_v[layer].dtype)
        page = positions // self.page_size
        lo, hi = self.page_lo[layer], self.page_hi[layer]
        inb = page < lo.shape[2]              # generated tokens past the last page slot have no bounds to keep
        pg = torch.where(inb, page, 0)
        kf = k.float()
        lo[slots, :, pg] = torch.where(inb[:, None, None], torch.minimum(lo[slots, :, pg], kf), lo[slots, :, pg])
        hi[slots, :, pg] = torch.where(inb[:, None, None], torch.maximum(hi[slots, :, pg], kf), hi[slots, :, pg])
        if layer == 0:
            self.seq_len[slots] = positions + 1

    def select(self, layer: int, q_all: torch.Tensor, n_prefill: torch.Tensor) -> torch.Tensor:
        """The page selector over every slot: ``q_all [S, Hq, d]`` -> ``[S, Hkv, K]`` absolute pages."""
        cfg = self.cfg
        budget = self.layer_plan(layer)[0]
        args = (q_all, self.page_lo[layer], self.page_hi[layer], n_prefill)
        if self.use_kernels:
            from macattn.plugins.retrieval_completion.op import select_mid_pages

            return select_mid_pages(*args, cfg.n_sink, cfg.n_tail, cfg.page_size, budget)
        return select_mid_pages_reference(*args, n_sink=cfg.n_sink, n_tail=cfg.n_tail, page_size=cfg.page_size,
                                          budget=budget).to(q_all.device)

    def fetch(self, layer: int, q_all: torch.Tensor, n_prefill: torch.Tensor, *,
              speculative: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Select layer ``layer``'s pages for ``q_all [S, Hq, d]`` and bring the missing ones into the hot cache.
        Returns ``(positions, rows)``, each ``[S, Hkv, K·page]`` int64: every selected token's position (-1:
        none) and its row of ``cache_k / cache_v / cache_lpk``. Counts hits / misses, or with ``speculative``
        (a prefetch) its fetched pages in ``prefetched``."""
        from macattn.plugins.page_fetch.op import gather_pages

        pages = self.select(layer, q_all, n_prefill)
        self.clock += 1
        slots, miss = lru_update(self.slot_of_page[layer], self.page_of_slot[layer], self.stamp[layer], pages,
                                 self.clock)
        valid = pages >= 0
        if speculative:
            self.prefetched += miss.sum((1, 2))
        else:
            self.hits += (valid & ~miss).sum((1, 2))
            self.misses += miss.sum((1, 2))
        tiers = ((self.host_k, self.cache_k), (self.host_v, self.cache_v), (self.host_lpk, self.cache_lpk))
        for src, dst in tiers if self.layer_plan(layer)[1] else tiers[:2]:
            gather_pages(src[:, layer], dst[layer], pages, slots, miss, use_kernel=self.use_kernels)
        page = self.page_size
        off = torch.arange(page, device=pages.device)
        positions = torch.where(valid[..., None], pages[..., None] * page + off, -1).flatten(2)
        rows = (slots[..., None] * page + off).flatten(2)
        return positions, rows

    def decode(self, layer: int, q_all: torch.Tensor, lpq_all: torch.Tensor, seq_lens: torch.Tensor,
               n_prefill: torch.Tensor, scale: float, *, prefetch_q: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's attention for every slot: ``q_all [S, Hq, d]`` (rows not decoding: anything, with
        ``seq_lens`` 1 and ``n_prefill`` 0), ``lpq_all [S, Hq, F]`` fp32 log φ_q, ``seq_lens / n_prefill [S]``
        -> ``out [S, Hq, d]`` in q's dtype. The step's token must have been ``append``\\ ed. With prefetch on
        (and a CUDA copy stream), layer ``layer + 1``'s guessed pages are fetched on the copy stream after
        this layer's own fetch (``prefetch_q``: the query to guess with, default ``q_all``)."""
        cfg = self.cfg
        pages, on = self.layer_plan(layer)
        if self._copy_stream is not None and layer > 0:     # layer - 1 prefetched for this layer
            torch.cuda.current_stream().wait_event(self._events[layer])
        positions, rows = self.fetch(layer, q_all, n_prefill)
        if self._copy_stream is not None and layer + 1 < self.num_layers:
            self._prefetch(layer + 1, q_all if prefetch_q is None else prefetch_q, n_prefill)
        if on:                                   # the gate's calibrated mass (an off layer's term is skipped)
            lpq_all = gated_log_phi_q(lpq_all, True, self._log_mass[layer])
        args = (q_all, self.anchor_k[layer], self.anchor_v[layer], seq_lens, n_prefill, lpq_all, self.comp_a[layer],
                self.comp_b[layer], self.comp_shift[layer], positions)
        kw = dict(retrieved=(self.cache_k[layer], self.cache_v[layer], self.cache_lpk[layer]), rows=rows,
                  anchors_compact=True, n_sink=cfg.n_sink, n_tail=cfg.n_tail,
                  top_k=pages if on else 1 << 30,      # >= every mid: no completion
                  page_size=cfg.page_size, scale=scale)
        if self.use_kernels:
            from macattn.plugins.retrieval_completion.op import decode_retrieved_triton

            out = torch.empty_like(q_all)
            return decode_retrieved_triton(*args, out=out, **kw)
        return decode_retrieved_reference(*args, **kw).to(q_all.device)

    # --- prefetch (CUDA) ---------------------------------------------------------------------
    def _prefetch(self, layer: int, q_all: torch.Tensor, n_prefill: torch.Tensor) -> None:
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fetch(layer, q_all, n_prefill, speculative=True)
            self._events[layer].record(stream)

    # --- figures ------------------------------------------------------------------------------
    def hit_rate(self, slot: int) -> float:
        """Share of ``slot``'s selected pages served from the hot cache (reads the device)."""
        h, m = int(self.hits[slot]), int(self.misses[slot])
        return h / (h + m) if h + m else 0.0
