"""KV tiers of offloaded retrieval-completion requests (SPEC §3's offloaded setting, issue 20).

A request's prefill KV lives in pages in host memory (pinned when the device is CUDA) and on disk
(``prefix_store``: A3's chunk store with its integrity rules, under the prefix layout); the device
holds what every step reads — per-page key bounds (Quest: per-channel min / max of each page's keys)
— and a small LRU cache of hot pages. A decode step selects pages per KV head from the bounds
(``macattn.plugins.page_select``) and ``fetch``\\ es them: hits come from the cache, misses are copied
from the host pages into it. (Sinks, the exact tail, generated tokens and the
completion cache are the completion method's own per-slot state.)

Shapes (``L`` layers, ``Hkv`` KV heads, ``T`` prefill tokens, ``P = ceil(T / page_size)`` pages,
``d`` head dim; the last page is zero-padded and its bounds cover its real tokens only):

* host pages ``k / v [L, Hkv, P, page_size, d]`` (the model's KV dtype): a ``(layer, head, page)``
  unit is contiguous, ``page_size * d`` elements;
* bounds ``lo / hi [L, Hkv, P, d]`` on the device, the KV dtype's values in fp32;
* hot cache ``[hot_pages, page_size, d]`` per request for ``k`` and ``v``, keyed by unit.

The cache bookkeeping is on the host: ``fetch`` reads the selected page ids there (one
synchronisation per call) and copies unit by unit. The offloaded decode itself runs on
``macattn.methods.completion.offload.OffloadedKV`` (device-side LRU per layer and KV head, the page
gather reading pinned host memory from the GPU, no host synchronisation, capturable); this module keeps
the on-disk tier (``prefix_store``) that the ``completion_offload`` engine method persists prompts to.

Capacity (host bytes over all requests, device bytes per request) is checked at ``admit``, before
anything is allocated, with an error naming the budget. ``KVTiers`` is a per-slot state
(``num_slots``, ``reset(slot)``) registered with the runtime's ``SlotStates``: a slot's pages,
bounds and cache are dropped when it is acquired or released.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from macattn.core.validation import check_int
from macattn.methods.completion.reference import page_bounds
from macattn.runtime.chunk_store import ChunkKVStore

__all__ = ["KVTierConfig", "RequestTiers", "KVTiers", "prefix_store", "PREFIX_LAYOUT"]

PREFIX_LAYOUT = "macattn-prefix-v1:k_post_rope,v:[layers,tokens,kv_heads,head_dim]"


@dataclass(frozen=True)
class KVTierConfig:
    """page_size: tokens per page (>= 1); hot_pages: device cache capacity per request in
    ``(layer, head, page)`` units (>= 0); host_budget_bytes: pinned host memory for all requests'
    pages; device_budget_bytes: device memory per request for its bounds and hot cache."""

    page_size: int = 64
    hot_pages: int = 1024
    host_budget_bytes: int = 64 << 30
    device_budget_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 1)
        check_int("hot_pages", self.hot_pages, 0)
        check_int("host_budget_bytes", self.host_budget_bytes, 1)
        check_int("device_budget_bytes", self.device_budget_bytes, 1)


def prefix_store(directory, *, model_id: str, tokenizer_id: str = "", max_bytes: int | None = None) -> ChunkKVStore:
    """The on-disk tier: a ``ChunkKVStore`` of prompt prefixes' ``k, v [L, T, Hkv, d]`` (keys after
    RoPE, as the KV cache holds them) under ``PREFIX_LAYOUT``, so its entries never mix with A3's
    pre-RoPE chunks; every load checks model identity, token ids, dtype, shapes and the payload sha256."""
    return ChunkKVStore(directory, model_id=model_id, tokenizer_id=tokenizer_id, max_bytes=max_bytes,
                        layout=PREFIX_LAYOUT)


@dataclass
class RequestTiers:
    """One request's tiers: host ``k_pages / v_pages [L, Hkv, P, page, d]``, device ``lo / hi
    [L, Hkv, P, d]``, hot cache ``cache_k / cache_v [hot_pages, page, d]`` with ``lru`` (unit ->
    cache row, least recent first), ``num_tokens`` ``T``; counters of fetched units and bytes."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    cache_k: torch.Tensor
    cache_v: torch.Tensor
    num_tokens: int
    lru: OrderedDict = field(default_factory=OrderedDict)
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0

    @property
    def host_bytes(self) -> int:
        return 2 * self.k_pages.numel() * self.k_pages.element_size()


class KVTiers:
    """The tiers of ``num_slots`` request slots on ``device`` (module doc)."""

    def __init__(self, config: KVTierConfig, *, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        check_int("num_slots", num_slots, 1)
        self.config, self.num_slots = config, num_slots
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.requests: dict[int, RequestTiers] = {}

    # --- per-slot state protocol -------------------------------------------------------------
    def reset(self, slot: int) -> None:
        check_int("slot", slot, 0, self.num_slots - 1)
        self.requests.pop(slot, None)

    @property
    def host_bytes(self) -> int:
        return sum(r.host_bytes for r in self.requests.values())

    def device_bytes(self, num_tokens: int) -> int:
        """Device bytes of one request of ``num_tokens`` prefill tokens (bounds + hot cache)."""
        P = -(-num_tokens // self.config.page_size)
        bounds = 2 * self.num_layers * self.num_kv_heads * P * self.head_dim * 4
        cache = 2 * self.config.hot_pages * self.config.page_size * self.head_dim * self.dtype.itemsize
        return bounds + cache

    # --- admission -------------------------------------------------------------------------
    def admit(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> RequestTiers:
        """Page request ``slot``'s prefill ``k, v [L, Hkv, T, d]`` into host memory and put its bounds
        on the device. ``ValueError`` naming the budget when it does not fit (nothing allocated)."""
        check_int("slot", slot, 0, self.num_slots - 1)
        L, H, d = self.num_layers, self.num_kv_heads, self.head_dim
        if k.dim() != 4 or k.shape[0] != L or k.shape[1] != H or k.shape[3] != d or k.shape[2] < 1:
            raise ValueError(f"k must be [num_layers={L}, num_kv_heads={H}, T >= 1, head_dim={d}], got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        if slot in self.requests:
            raise ValueError(f"slot {slot} already holds a request's tiers; release it first")
        T, page = k.shape[2], self.config.page_size
        P = -(-T // page)
        host = 2 * L * H * P * page * d * self.dtype.itemsize
        if self.host_bytes + host > self.config.host_budget_bytes:
            raise ValueError(f"host_budget_bytes={self.config.host_budget_bytes} is too small: the pages of "
                             f"{T} tokens need {host} bytes, {self.host_bytes} are in use")
        dev = self.device_bytes(T)
        if dev > self.config.device_budget_bytes:
            raise ValueError(f"device_budget_bytes={self.config.device_budget_bytes} is too small: {T} tokens "
                             f"need {dev} bytes of bounds and hot cache on the device")
        pin = self.device.type == "cuda"

        def paged(x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(L, H, P * page, d, dtype=self.dtype, pin_memory=pin)
            out[:, :, :T] = x.to("cpu", self.dtype)
            return out.view(L, H, P, page, d)

        lo, hi = page_bounds(k.to(self.dtype), page, torch.float32)
        hot = (self.config.hot_pages, page, d)
        req = RequestTiers(paged(k), paged(v), lo.to(self.device), hi.to(self.device),
                           torch.zeros(hot, dtype=self.dtype, device=self.device),
                           torch.zeros(hot, dtype=self.dtype, device=self.device), T)
        self.requests[slot] = req
        return req

    def persist(self, slot: int, store: ChunkKVStore, token_ids) -> str:
        """Write request ``slot``'s prefill KV to ``store`` (``prefix_store``) under its ``token_ids``."""
        req = self.tiers(slot)
        T = req.num_tokens
        if len(token_ids) != T:
            raise ValueError(f"token_ids must be the request's {T} prefill tokens, got {len(token_ids)}")
        unpaged = lambda x: x.flatten(2, 3)[:, :, :T].transpose(1, 2).contiguous()  # noqa: E731  [L, T, Hkv, d]
        return store.put(token_ids, unpaged(req.k_pages), unpaged(req.v_pages))

    def admit_from_store(self, slot: int, store: ChunkKVStore, token_ids) -> RequestTiers | None:
        """Admit request ``slot`` from the prefix ``token_ids`` persisted in ``store``; None when it is
        not there (the caller prefills). ``ChunkStoreIntegrityError`` for a tampered entry."""
        got = store.get(token_ids, self.dtype)
        if got is None:
            return None
        k, v = got
        return self.admit(slot, k.transpose(1, 2), v.transpose(1, 2))

    def tiers(self, slot: int) -> RequestTiers:
        if slot not in self.requests:
            raise KeyError(f"slot {slot} holds no admitted request")
        return self.requests[slot]

    # --- decode ----------------------------------------------------------------------------
    def fetch(self, slot: int, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``pages [Hkv, n]`` (page indices per KV head) of ``layer`` on the device, each
        ``[Hkv, n, page_size, d]``. Hot units come from the cache; the others are copied from the host
        pages into it (the least recently used units make room; with ``hot_pages = 0``, or more units
        than the cache holds, they are copied straight into the result)."""
        req = self.tiers(slot)
        check_int("layer", layer, 0, self.num_layers - 1)
        H, P = self.num_kv_heads, req.k_pages.shape[2]
        if pages.dim() != 2 or pages.shape[0] != H:
            raise ValueError(f"pages must be [num_kv_heads={H}, n], got {tuple(pages.shape)}")
        idx = pages.to("cpu", torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= P):
            raise ValueError(f"pages must be in [0, {P - 1}] ({req.num_tokens} tokens), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        n, page, d = idx.shape[1], self.config.page_size, self.head_dim
        out_k = torch.empty(H, n, page, d, dtype=self.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        units = [(layer, h, int(p)) for h in range(H) for p in idx[h]]
        use_cache = 0 < len(set(units)) <= self.config.hot_pages
        for i, unit in enumerate(units):
            h, j = divmod(i, n)
            row = req.lru.get(unit) if use_cache else None
            if row is not None:
                req.lru.move_to_end(unit)
                req.hits += 1
            else:
                req.misses += 1
                req.bytes_fetched += 2 * page * d * self.dtype.itemsize
                src_k, src_v = req.k_pages[unit[0], unit[1], unit[2]], req.v_pages[unit[0], unit[1], unit[2]]
                if not use_cache:
                    out_k[h, j].copy_(src_k, non_blocking=True)
                    out_v[h, j].copy_(src_v, non_blocking=True)
                    continue
                row = self._cache_row(req)
                req.cache_k[row].copy_(src_k, non_blocking=True)
                req.cache_v[row].copy_(src_v, non_blocking=True)
                req.lru[unit] = row
            out_k[h, j] = req.cache_k[row]
            out_v[h, j] = req.cache_v[row]
        return out_k, out_v

    def _cache_row(self, req: RequestTiers) -> int:
        if len(req.lru) < self.config.hot_pages:
            return len(req.lru)
        _, row = req.lru.popitem(last=False)
        return row
