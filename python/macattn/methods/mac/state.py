"""Decode-time state owned by the runtime: MAC rings for every layer and request slot.

One ``MacState`` holds, per layer ``l`` (``S`` slots, ``Hq`` query heads, ``K_l`` the
layer's window, ``d`` head dim):

============  =====================  ==========================================
field         shape                  dtype
============  =====================  ==========================================
qring[l]      ``[S, Hq, K_l, d]``    ``query_dtype`` (bf16 on the GPU)
oring[l]      ``[S, Hq, K_l, d]``    ``summary_dtype`` (fp32 by default)
ring_lse[l]   ``[S, Hq, K_l]``       fp32, ``-inf`` = empty summary
ring_pos[l]   ``[S, K_l]``           int64, ``-1`` = empty slot
sring[l]      ``[S, Hq, K_l, DS]``   ``sketch_dtype(kind)``; None unless the layer's match is
                                     ``"two_stage"``: ``sketch(qring[l])`` (``match_sketch``)
in_use        ``[S]``                bool
============  =====================  ==========================================

The sketch ring is the two-stage match's compressed copy of ``qring``: every writer of ``qring``
(``seed``, ``sketch_rows_`` after the traceable seeding, the decode step's append) keeps
``sring[l][s] == sketch(qring[l][s])``.

A request owns one slot from ``acquire()`` to ``release()``; both reset the slot's rows
(positions ``-1``, ``lse = -inf``) so no entry of one request is ever a match candidate for
another: every read of an entry is gated by a valid position, and the query / summary / sketch
values left behind are never read (as the paged KV pool's freed blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.match_sketch import sketch, sketch_dims, sketch_dtype
from macattn.core.indexing import index_store_
from macattn.core.summaries import AttentionSummary

from macattn.core.slot_pool import SlotPool

__all__ = ["MacState", "MacDiagnostics"]


@dataclass
class MacDiagnostics:
    """Accumulators (docs/spec.md §1.5), fp64 on the state's device, updated without any host
    synchronisation (a reader's ``.tolist()`` / ``float()`` is where the host waits):

    per layer × query head ``[L, Hq]``: ``steps``, ``hits``, ``skipped`` (sum of ``(p - r)_+ / m``
    over steps; misses add 0), ``gap`` (sum of ``m - p`` over hits); per slot ``[S, 3]``:
    ``per_slot`` = (head-steps, hits, skipped) of the request in the slot, summed over layers and
    heads (reset with the slot; ``MacAttention.request_metrics`` reads it at the request's end). ``counted``: the
    slots whose ``per_slot`` row a decode step may have added to (host-side, from the steps' positions:
    ``MacAttention.decoded``), so a request that never engaged is read without waiting for the device.
    """

    steps: torch.Tensor
    hits: torch.Tensor
    skipped: torch.Tensor
    gap: torch.Tensor
    per_slot: torch.Tensor
    counted: set[int] = field(default_factory=set)

    @classmethod
    def zeros(cls, num_layers: int, num_heads: int, num_slots: int = 1,
              device: torch.device | str = "cpu") -> "MacDiagnostics":
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(num_layers, num_heads), z(num_layers, num_heads), z(num_layers, num_heads),
                   z(num_layers, num_heads), z(num_slots, 3))

    def record(self, layer: int, match_pos: torch.Tensor, positions: torch.Tensor, band: int,
               slots: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        """Add one step of one layer: ``match_pos [B, Hq]`` (-1 miss) at ``positions [B]`` (``weights``: as
        ``record_layers``)."""
        dev = self.hits.device
        self.record_layers(torch.full((1,), layer, device=dev), match_pos.unsqueeze(0), positions,
                           torch.full((1,), band, dtype=torch.float64, device=dev), slots, weights)

    def record_layers(self, layers: torch.Tensor, match_pos: torch.Tensor, positions: torch.Tensor,
                      bands: torch.Tensor, slots: torch.Tensor | None = None,
                      weights: torch.Tensor | None = None) -> None:
        """Add one step of several layers: ``match_pos [n, B, Hq]`` of ``layers [n]`` int64 (their bands
        ``[n]`` fp64; both on the accumulators' device: building them per step from host lists would
        synchronise) at ``positions [B]``; ``slots [B]`` (None: no per-slot figures) the requests' rows;
        ``weights [B]`` fp64 1 for a row that counts, 0 for padding and for a row before MAC engages
        (``MacConfig.min_context``; None: all count). Tensor ops only, so a
        CUDA graph can hold it."""
        dev = self.hits.device
        mp = match_pos.detach().to(dev, torch.float64)
        n, B, Hq = mp.shape
        w = (torch.ones(B, dtype=torch.float64, device=dev) if weights is None else weights.to(dev)).view(1, B, 1)
        m = positions.detach().to(dev, torch.float64).view(1, B, 1)
        hit = (mp >= 0).to(torch.float64) * w
        skip = torch.where(mp >= 0, (mp - bands.view(-1, 1, 1)).clamp(min=0) / m.clamp(min=1), 0.0) * w
        self.steps.index_add_(0, layers, w.sum().expand(n, Hq))
        self.hits.index_add_(0, layers, hit.sum(1))
        self.skipped.index_add_(0, layers, skip.sum(1))
        self.gap.index_add_(0, layers, ((m - mp) * hit).sum(1))
        if slots is not None:
            rows = torch.stack([w.view(B) * (n * Hq), hit.sum((0, 2)), skip.sum((0, 2))], 1)   # [B, 3]
            self.per_slot.index_add_(0, slots.to(dev), rows)

    def request(self, slot: int) -> dict[str, float]:
        """The request in ``slot``: MAC hit rate and skipped prefix over its decode steps (reads the device)."""
        return self.request_of(self.per_slot[slot].tolist())

    @staticmethod
    def request_of(counts) -> dict[str, float]:
        """``request``'s figures from a slot's ``(head-steps, hits, skipped)`` (summed over the heads of
        several tensor-parallel ranks, or one ``per_slot`` row)."""
        steps, hits, skipped = counts
        if not steps:
            return {}
        return {"mac_hit_rate": hits / steps, "mac_kv_skip": skipped / steps}

    def reset(self) -> None:
        for t in (self.steps, self.hits, self.skipped, self.gap, self.per_slot):
            t.zero_()

    @property
    def hit_rate(self) -> torch.Tensor:
        return self.hits / self.steps.clamp(min=1)

    @property
    def skipped_prefix(self) -> torch.Tensor:
        return self.skipped / self.steps.clamp(min=1)

    @property
    def mean_gap(self) -> torch.Tensor:
        return self.gap / self.hits.clamp(min=1)

    def as_dict(self) -> dict:
        return {"hit_rate": self.hit_rate.tolist(), "skipped_prefix": self.skipped_prefix.tolist(),
                "mean_gap": self.mean_gap.tolist(), "steps": self.steps[:, 0].tolist()}


@dataclass
class MacState(SlotPool):
    """Rings of all layers and slots; see the module docstring for shapes and dtypes."""

    SLOT_KIND = "MAC"

    config: MacConfig
    qring: list[torch.Tensor]
    oring: list[torch.Tensor]
    ring_lse: list[torch.Tensor]
    ring_pos: list[torch.Tensor]
    in_use: torch.Tensor
    diagnostics: MacDiagnostics
    sring: list[torch.Tensor | None] = field(default_factory=list, repr=False)
    _free: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def allocate(cls, config: MacConfig, *, num_layers: int, num_slots: int, num_q_heads: int,
                 head_dim: int, query_dtype: torch.dtype = torch.bfloat16,
                 summary_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "MacState":
        for name, val in (("num_layers", num_layers), ("num_slots", num_slots),
                          ("num_q_heads", num_q_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        qring, oring, lse, pos, sring = [], [], [], [], []
        for layer in range(num_layers):
            p = config.for_layer(layer)
            K = p.window
            qring.append(torch.zeros(num_slots, num_q_heads, K, head_dim, dtype=query_dtype, device=device))
            oring.append(torch.zeros(num_slots, num_q_heads, K, head_dim, dtype=summary_dtype, device=device))
            lse.append(torch.full((num_slots, num_q_heads, K), float("-inf"), dtype=torch.float32, device=device))
            pos.append(torch.full((num_slots, K), -1, dtype=torch.int64, device=device))
            sring.append(None if p.match != "two_stage" else torch.zeros(
                num_slots, num_q_heads, K, sketch_dims(p.match_sketch, head_dim),
                dtype=sketch_dtype(p.match_sketch), device=device))
        return cls(config, qring, oring, lse, pos, torch.zeros(num_slots, dtype=torch.bool),
                   MacDiagnostics.zeros(num_layers, num_q_heads, num_slots, device), sring,
                   list(range(num_slots - 1, -1, -1)))

    @property
    def num_layers(self) -> int:
        return len(self.qring)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qring, oring, ring_lse, ring_pos)`` of layer ``i``."""
        return self.qring[i], self.oring[i], self.ring_lse[i], self.ring_pos[i]

    def reset(self, slot: int) -> None:
        """Empty every ring row of ``slot`` in every layer: each entry's position -1 and log-sum-exp -inf. Every
        read of an entry (the match kernels and references, the two-stage candidates, a hit's summary) is gated
        by a valid position, so the query / summary / sketch values of the slot's previous request are left in
        place, unreachable, as the paged KV pool leaves a freed block's values: zeroing them wrote ~0.5 GB per
        admission and release at 8B shapes (K = 1024), ~1 ms on the H100 on every request's TTFT."""
        self._check_slot(slot)
        lse, pos = [t[slot] for t in self.ring_lse], [t[slot] for t in self.ring_pos]
        for rows in (lse, pos):   # one multi-tensor launch per ring kind, not one per layer (admission: TTFT path)
            torch._foreach_zero_(rows)
        torch._foreach_add_(lse, float("-inf"))
        torch._foreach_add_(pos, -1)
        self.diagnostics.per_slot[slot].zero_()
        self.diagnostics.counted.discard(slot)

    def copy(self, src: int, dst: int) -> None:
        """Copy every ring row (and the per-request diagnostics) of ``src`` into ``dst`` in every layer: a fork
        of the request in ``src`` continues from its rings (``runtime.slots.SlotStates.copy``)."""
        self._check_slot(src)
        self._check_slot(dst)
        for rings in (self.qring, self.oring, self.ring_lse, self.ring_pos, self.sring):
            for t in rings:
                if t is not None:
                    t[dst].copy_(t[src])
        self.diagnostics.per_slot[dst].copy_(self.diagnostics.per_slot[src])
        counted = self.diagnostics.counted
        (counted.add if src in counted else counted.discard)(dst)

    def sketch_rows_(self, layer: int, slots: torch.Tensor) -> None:
        """Recompute ``sring[layer]`` rows ``slots [n]`` from ``qring`` (after the traceable seeding);
        a no-op for a layer without a sketch ring."""
        sr = self.sring[layer]
        if sr is not None:
            kind = self.config.for_layer(layer).match_sketch
            index_store_(sr, slots, sketch(self.qring[layer].index_select(0, slots), kind))

    def clear_rows(self, layer: int, slots: torch.Tensor) -> None:
        """Empty rows ``slots [P]`` int64 of ``layer``'s rings, values zeroed as ``seeding.seed_rings_`` leaves the
        columns a prompt does not fill (one launch per ring)."""
        qring, oring, lse, pos = self.layer(layer)
        qring.index_fill_(0, slots, 0)
        oring.index_fill_(0, slots, 0)
        lse.index_fill_(0, slots, float("-inf"))
        pos.index_fill_(0, slots, -1)
        sr = self.sring[layer]
        if sr is not None:
            sr.view(torch.uint8).index_fill_(0, slots, 0)     # all-zero bits: 0 in every sketch dtype

    def write_columns(self, layer: int, slots: torch.Tensor, cols: torch.Tensor, positions: torch.Tensor,
                      q_pre: torch.Tensor, summary: AttentionSummary) -> None:
        """Write ``M`` ring entries of ``layer`` at once: entry ``m`` goes to row ``slots[m]``, column ``cols[m]``
        (``slots / cols / positions [M]`` int64, no (slot, column) twice) with its pre-RoPE query ``q_pre [M, Hq,
        d]``, rectified summary (o ``[M, Hq, d]``, lse ``[M, Hq]``) and position; the sketch ring follows. One
        indexed store per ring for every request of a packed prefill (``seeding.seed_packed_``)."""
        qring, oring, lse, pos = self.layer(layer)
        q = q_pre.to(qring.dtype)
        at = (slots, slice(None), cols)
        qring[at] = q
        sr = self.sring[layer]
        if sr is not None:
            index_store_(sr, at, sketch(q, self.config.for_layer(layer).match_sketch))
        oring[at] = summary.o.to(oring.dtype)
        lse[at] = summary.lse.to(lse.dtype)
        pos[slots, cols] = positions

    def seed(self, layer: int, slot: int, positions: torch.Tensor, q_pre: torch.Tensor,
             summary: AttentionSummary) -> None:
        """Write prefill positions ``[n]`` with their pre-RoPE queries ``[Hq, n, d]`` and
        rectified summaries (o ``[Hq, n, d]``, lse ``[Hq, n]``) into ``slot`` of ``layer``.

        Only the last ``K`` positions are kept (earlier ones would be overwritten).
        """
        self._check_slot(slot)
        qring, oring, lse, pos = self.layer(layer)
        K = qring.shape[2]
        keep = slice(max(0, positions.numel() - K), None)
        positions = positions[keep].to(pos.device)
        col = positions % K
        qring[slot][:, col] = q_pre[:, keep].to(qring.dtype)
        sr = self.sring[layer]
        if sr is not None:
            index_store_(sr, (slot, slice(None), col), sketch(qring[slot][:, col], self.config.for_layer(layer).match_sketch))
        oring[slot][:, col] = summary.o[:, keep].to(oring.dtype)
        lse[slot][:, col] = summary.lse[:, keep].to(lse.dtype)
        pos[slot][col] = positions
