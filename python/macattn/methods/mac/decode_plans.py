"""MAC's decode plans of one batch bucket of the runtime's GPU decode (``MacAttention.decode_plans``,
read by ``MacAttention.decode`` as ``StepContext.paged``).

One ``MacDecodePlan`` (``plugins/mac/decode_plan.py``) per distinct layer configuration (``plan_key``: window,
band, tau, match; layers sharing one share the plan and its scratch): a MAC layer's step is match,
device-side plan, split-KV attention over the pages, merge + ring append (``attend``); a layer with MAC
off runs the same plan's full-attention path. Each MAC layer's ``match_pos`` ``[nb, Hq]`` int64 (-1 a
miss) is copied into a per-layer buffer of the plans every step, from which the captured step records
MAC's diagnostics (``record_diagnostics``, padding rows weighted 0) and the host reads the latest step's
decisions (``latest_match_pos``).

``MacConfig.min_context`` (MAC engages at ``m >= C``) runs in two captured variants of the step, which
``MacAttention.decode_graph_key`` picks on the host from the rows' positions (``DecodePlans.variant``): where
every row is below ``C`` the MAC layers attend in full (``run_full``: no match, no append — the step of MAC off);
where any row is at or past ``C`` they run MAC, and a row below ``C`` matches at position 0 (nothing to match)
and appends into the runtime's scratch slot, which no request reads (``rows.scratch_slot``), so its own ring stays
as it was in both variants.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from macattn.methods.base import DecodeGeometry, DecodePlans, DecodeRows
from macattn.methods.mac.config import LayerMacParams, MacConfig
from macattn.methods.mac.match_sketch import sketch_dims, sketch_dtype, sketch_projection_of
from macattn.methods.mac.state import MacDiagnostics

__all__ = ["MacDecodePlans", "plan_key"]


def plan_key(params: LayerMacParams) -> tuple:
    """The ``LayerMacParams`` fields a ``MacDecodePlan`` is made for (layers sharing them share a plan):
    ``(window, band, tau, match, sketch kind, candidates)``, the last two None for the exact match."""
    two = params.match == "two_stage"
    return (params.window, params.band, params.tau, params.match,
            params.match_sketch if two else None, params.match_candidates if two else None)


class _RowsOf(Mapping):
    """``layer -> match_pos[:rows]`` of a bucket's buffers, sliced when read (not per step)."""

    def __init__(self, match_pos: dict[int, torch.Tensor], rows: int) -> None:
        self._mp, self._rows = match_pos, rows

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._mp[layer][: self._rows]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mp)

    def __len__(self) -> int:
        return len(self._mp)


class MacDecodePlans(DecodePlans):
    """MAC's plans for one bucket (``nb`` rows) of a model of ``num_layers`` layers under ``config``.

    plans: ``plan_key`` -> ``MacDecodePlan``. match_pos: layer -> ``[nb, Hq]`` int64, written by each
    step of every layer with MAC on (a layer with MAC off has none). The layers and bands of the
    diagnostics live on the device, made once (``match_pos``' order)."""

    def __init__(self, geometry: DecodeGeometry, rows: DecodeRows, config: MacConfig, num_layers: int) -> None:
        super().__init__(geometry, rows)
        self.config = config
        self.plans: dict[tuple, object] = {}
        for layer in range(num_layers):
            key = plan_key(config.for_layer(layer))
            if key not in self.plans:
                self.plans[key] = self._make(*key)
        self.match_pos: dict[int, torch.Tensor] = {}
        self._diag_index: tuple | None = None
        self._mac_layers = config.enabled_layers(num_layers)
        self._first_mac_layer = min(self._mac_layers, default=None)
        self._gate: tuple[torch.Tensor, torch.Tensor] | None = None     # this step's, made by its first MAC layer
        self._missed = (torch.full((geometry.batch_size, geometry.num_q_heads), -1, dtype=torch.int64,
                                   device=geometry.device) if config.min_context > 0 else None)

    def _make(self, window: int, band: int, tau: float | None, match: str, sketch_kind, candidates):
        extra = {} if match != "two_stage" else dict(
            match_candidates=candidates, match_sketch_dims=sketch_dims(sketch_kind, self.geometry.head_dim),
            match_sketch_itemsize=sketch_dtype(sketch_kind).itemsize)
        return self.make_plan(window=window, band=band, tau=tau, **extra)

    def attend(self, layer, params, q, q_pre, k_pages, v_pages, positions, slots, rings, sring=None):
        """The layer's MAC attention for this bucket (``MacAttention.decode``): ``rings`` the layer's
        ``(qring, oring, ring_lse, ring_pos)``, appended to at ``positions``; ``sring`` its sketch ring
        (two-stage match), kept by the plan's append. A layer with MAC off attends to the full prefix."""
        plan = self.plans[plan_key(params)]
        if params.enabled and self.engaged:
            match_positions = None
            if self.config.min_context > 0:
                if layer == self._first_mac_layer or self._gate is None:
                    self._gate = self._rows_below(positions, slots)
                match_positions, slots = self._gate
            proj = None if sring is None else sketch_projection_of(params.match_sketch, q.shape[-1], q.device)
            out, match_pos, _ = plan.run(q, q_pre, k_pages, v_pages, positions, slots, *rings,
                                         page_table=self.page_table, check=False, sring=sring, proj=proj,
                                         match_positions=match_positions)
            buf = self.match_pos.get(layer)
            if buf is None:
                buf = self.match_pos[layer] = torch.empty_like(match_pos)
            buf.copy_(match_pos)
            return out
        if not params.enabled:
            self.match_pos.pop(layer, None)
        return plan.run_full(q, k_pages, v_pages, positions, page_table=self.page_table, check=False)

    def attend_full(self, q, k_pages, v_pages, positions):
        """Full attention of every row over ``[0, m]`` (``DecodePlans.attend_full``; a packed call's decode tail):
        the first plan's ``run_full`` (its kernels take no MAC parameter)."""
        return next(iter(self.plans.values())).run_full(q, k_pages, v_pages, positions, page_table=self.page_table,
                                                        check=False)

    @property
    def engaged(self) -> bool:
        """Whether this step runs MAC's match (the variant ``MacAttention.decode_graph_key`` chose: its last
        item); True before any variant was set and when ``min_context`` is 0."""
        return self.config.min_context == 0 or self.variant is None or bool(self.variant[-1])

    def _rows_below(self, positions: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's ``(match positions [nb], ring slots [nb])``: a row below ``min_context`` matches at position
        0 (no ring entry lies before it) and appends into the scratch slot."""
        below = ~self.config.engages(positions)
        return positions.masked_fill(below, 0), slots.masked_fill(below, self.rows.scratch_slot)

    def record_diagnostics(self, diagnostics: MacDiagnostics) -> None:
        """Add this step's hit / skip / gap of every MAC layer to ``diagnostics`` (per layer and per
        request slot; padding rows weigh 0): tensor ops only, inside the captured step."""
        if not self.match_pos or not self.engaged:
            return
        layers, bands = self._diag_tensors()
        weights = self.rows.valid
        if self.config.min_context > 0:          # a row before MAC engages counts nowhere
            weights = weights * self.config.engages(self.rows.positions)
        diagnostics.record_layers(layers, torch.stack(list(self.match_pos.values())), self.rows.positions, bands,
                                  self.rows.slots, weights=weights)

    def latest_match_pos(self, batch_size: int) -> Mapping[int, torch.Tensor]:
        """``layer -> [batch_size, Hq]`` int64 of the latest step (views of the buffers, sliced when read; every
        row -1 after a step where no row had reached ``min_context``)."""
        if not self.engaged:
            return _RowsOf(dict.fromkeys(self._mac_layers, self._missed), batch_size)
        return _RowsOf(self.match_pos, batch_size)

    def _diag_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The MAC layers ``[n]`` int64 and their bands ``[n]`` fp64 on the device, made once per layer set."""
        key = tuple(self.match_pos)
        if self._diag_index is None or self._diag_index[0] != key:
            dev = self.geometry.device
            self._diag_index = (key, torch.tensor(key, device=dev),
                                torch.tensor([float(self.config.for_layer(layer).band) for layer in key],
                                             dtype=torch.float64, device=dev))
        return self._diag_index[1], self._diag_index[2]
