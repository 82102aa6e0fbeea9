"""Decode-time retrieval-completion state owned by the runtime, per layer and request slot.

``CompletionState`` holds, per layer ``l`` (``S`` slots, ``Hkv`` KV heads, ``T`` = max sequence
length, head dim ``d``, ``F`` features):

==============  ======================  ====================================================
field           shape                   dtype / meaning
==============  ======================  ====================================================
k[l], v[l]      ``[S, Hkv, T, d]``      model dtype: post-RoPE keys and values of the request
log_phi_k[l]    ``[S, Hkv, T, F]``      fp32: log φ_k of every cached key (mid rows are read)
comp_a[l]       ``[S, Hkv, F, d]``      fp32: stable completion cache ``A`` of the mid region
comp_b[l]       ``[S, Hkv, F]``         fp32: ``b``
comp_shift[l]   ``[S, Hkv, F]``         fp32: per-feature shift ``c``
page_lo[l],     ``[S, Hkv, P, d]``      fp32, only with ``page_size`` (the page selector): per-channel min /
page_hi[l]                              max of the keys of each page of ``page_size`` tokens, over the
                                        tokens in the cache (pages with none: +inf / -inf)
seq_len         ``[S]``                 int64: tokens in the slot's cache (0 = empty)
n_prefill       ``[S]``                 int64: the request's prefill length ``N``
in_use          ``[S]``                 bool
==============  ======================  ====================================================

Rows picked by ``slots`` are exactly the inputs of ``macattn::retrieval_completion``. A request
owns a slot from ``acquire()`` to ``release()``; both reset its rows (zeros), so nothing of one
request is visible to the next owner. Satisfies ``runtime.slots.PerSlotState``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macattn.core.slot_pool import SlotPool
from macattn.methods.completion.reference import page_bounds

__all__ = ["CompletionState"]

_PER_LAYER = ("k", "v", "log_phi_k", "comp_a", "comp_b", "comp_shift", "page_lo", "page_hi")


@dataclass
class CompletionState(SlotPool):
    """Per-request caches of all layers and slots; see the module docstring for shapes and dtypes."""

    SLOT_KIND = "completion"

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    log_phi_k: list[torch.Tensor]
    comp_a: list[torch.Tensor]
    comp_b: list[torch.Tensor]
    comp_shift: list[torch.Tensor]
    seq_len: torch.Tensor
    n_prefill: torch.Tensor
    in_use: torch.Tensor
    _free: list[int] = field(default_factory=list, repr=False)
    page_lo: list[torch.Tensor] = field(default_factory=list)
    page_hi: list[torch.Tensor] = field(default_factory=list)
    page_size: int = 0

    @classmethod
    def allocate(cls, *, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 feature_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 page_size: int = 0) -> "CompletionState":
        """All rows zero. ``page_size >= 1`` adds the page bounds ``page_lo / page_hi`` (``P = ceil(max_seq_len /
        page_size)``), 0 leaves them out."""
        for name, val in (("num_layers", num_layers), ("num_slots", num_slots), ("num_kv_heads", num_kv_heads),
                          ("max_seq_len", max_seq_len), ("head_dim", head_dim), ("feature_dim", feature_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        s, h, t, d, f = num_slots, num_kv_heads, max_seq_len, head_dim, feature_dim
        z = lambda *shape, dt=torch.float32: [torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
                                             for _ in range(num_layers)]
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 0:
            raise ValueError(f"page_size must be an int >= 0, got {page_size!r}")
        P = -(-t // page_size) if page_size else 0
        bounds = (z(s, h, P, d), z(s, h, P, d)) if page_size else ([], [])
        return cls(z(s, h, t, d, dt=dtype), z(s, h, t, d, dt=dtype), z(s, h, t, f), z(s, h, f, d), z(s, h, f),
                   z(s, h, f), torch.zeros(s, dtype=torch.int64, device=device),
                   torch.zeros(s, dtype=torch.int64, device=device), torch.zeros(s, dtype=torch.bool),
                   list(range(num_slots - 1, -1, -1)), *bounds, page_size)

    def set_page_bounds(self, layer: int, slot: int, key: torch.Tensor) -> None:
        """Bounds of ``slot``'s pages after its prefill keys ``key [Hkv, N, d]``: pages of those tokens from
        them, the others empty (+inf / -inf) until ``extend_page_bounds`` fills them."""
        lo, hi = page_bounds(key, self.page_size, torch.float32)
        n = lo.shape[1]
        self.page_lo[layer][slot, :, :n], self.page_hi[layer][slot, :, :n] = lo, hi
        self.page_lo[layer][slot, :, n:], self.page_hi[layer][slot, :, n:] = float("inf"), float("-inf")

    def extend_page_bounds(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor) -> None:
        """Fold the keys ``key [B, Hkv, d]`` appended at ``positions [B]`` of ``slots [B]`` into their pages'
        bounds (device ops, no host sync)."""
        page = positions // self.page_size
        lo, hi = self.page_lo[layer], self.page_hi[layer]
        kf = key.float()
        lo[slots, :, page] = torch.minimum(lo[slots, :, page], kf)
        hi[slots, :, page] = torch.maximum(hi[slots, :, page], kf)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[2]

    def reset(self, slot: int) -> None:
        """Empty ``slot`` in every layer (all rows zero, lengths 0)."""
        self._check_slot(slot)
        for name in _PER_LAYER:
            for t in getattr(self, name):
                t[slot].zero_()
        self.seq_len[slot] = 0
        self.n_prefill[slot] = 0

    def is_empty(self, slot: int) -> bool:
        """True when every row of ``slot`` is zero (what ``reset`` leaves)."""
        self._check_slot(slot)
        rows = [t[slot] for n in _PER_LAYER for t in getattr(self, n)]
        return all(not bool(r.any()) for r in rows) and int(self.seq_len[slot]) == 0 and int(self.n_prefill[slot]) == 0
