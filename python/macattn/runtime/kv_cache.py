"""The paged KV pool and the per-call views the patched transformers model writes through.

Pool, per layer: ``k[l]``, ``v[l]`` ``[num_blocks * block_size, Hkv, d]`` in the model dtype
(a flat view of ``[num_blocks, block_size, Hkv, d]``); rows are addressed through block
tables (``BlockManager``).

The views duck-type the one method transformers' attention modules call on
``past_key_values``: ``update(key [B, Hkv, n, d], value, layer_idx) -> (keys, values)``.
The model always receives explicit ``position_ids`` and a 4-D mask, so nothing else of
the ``Cache`` API is consulted.
"""
from __future__ import annotations

import torch

__all__ = ["PagedKVCache", "PrefillView", "DecodeView", "PagedWriteView"]


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        rows = num_blocks * block_size
        self.k = [torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s pool as pages ``[num_blocks, block_size, Hkv, d]`` (FlashInfer NHD), views."""
        k, v = self.k[layer], self.v[layer]
        shape = (k.shape[0] // self.block_size, self.block_size, *k.shape[1:])
        return k.view(shape), v.view(shape)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PrefillView:
    """A prefill call's K/V writes: the call's ``[1, Hkv, N, d]`` keys / values go to pool ``rows [N]``
    (one ``index_copy_`` per layer) and are handed back as given; the attention reads earlier positions
    through the call's plan (``macattn.core.ragged.RaggedPrefill``). ``cached``: tokens the request had
    before this call when it is one request's (0: a fresh prompt; FastMKA resets its summary then)."""

    def __init__(self, cache: PagedKVCache, rows: torch.Tensor, cached: int = 0) -> None:
        self.cache, self.rows, self.cached = cache, rows.to(cache.k[0].device, non_blocking=True), cached

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cached

    def pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's flat pools ``(k, v)`` ``[P, Hkv, d]`` (``FusedForward`` appends to ``rows`` itself)."""
        return self.cache.k[layer], self.cache.v[layer]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k.index_copy_(0, self.rows, key[0].transpose(0, 1).to(k.dtype))
        v.index_copy_(0, self.rows, value[0].transpose(0, 1).to(v.dtype))
        return key, value


class DecodeView:
    """One decode step of ``B`` requests at positions ``m [B]``: writes each new token's K/V
    (``[B, Hkv, 1, d]``) to ``write_rows [B]`` and returns the gathered history
    ``[B, Hkv, T, d]`` (``T = max(m) + 1``; rows past ``m_b`` hold row 0's data, masked by the op)."""

    def __init__(self, cache: PagedKVCache, write_rows: torch.Tensor, gather_rows: torch.Tensor) -> None:
        dev = cache.k[0].device
        self.cache, self.write_rows, self.gather_rows = cache, write_rows.to(dev), gather_rows.to(dev)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before this call (the longest request's; > 0 for every decode)."""
        return int(self.gather_rows.shape[1]) - 1

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k[self.write_rows] = key[:, :, 0].to(k.dtype)
        v[self.write_rows] = value[:, :, 0].to(v.dtype)
        return k[self.gather_rows].transpose(1, 2), v[self.gather_rows].transpose(1, 2)


class PagedWriteView:
    """GPU decode of ``B`` requests: writes each new token's K/V to ``write_rows [B]`` (static
    tensor, ``index_copy_``: capturable) and hands the attention the whole pool as pages
    ``[num_blocks, block_size, Hkv, d]``; the MAC plan reads it through a page table.

    Also a ``macattn.models.fused.PagedAppend``: ``FusedForward`` appends the rotated keys and the
    values itself (one kernel with RoPE) through ``write_rows`` / ``pool`` and reads ``pages``."""

    def __init__(self, cache: PagedKVCache, write_rows: torch.Tensor) -> None:
        self.cache, self.write_rows = cache, write_rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """> 0: a decode step continues cached requests (no host sync to say how far)."""
        return 1

    def pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s flat pools ``(k, v)`` ``[num_blocks * block_size, Hkv, d]``."""
        return self.cache.k[layer], self.cache.v[layer]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.pages(layer)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k.index_copy_(0, self.write_rows, key[:, :, 0].to(k.dtype))
        v.index_copy_(0, self.write_rows, value[:, :, 0].to(v.dtype))
        return self.cache.pages(layer_idx)
