"""MAC as an ``AttentionMethod`` (docs/spec.md §1): prefill runs the model's attention and seeds the
rings; decode matches the pre-RoPE query against the ring, reuses the matched step's rectified
summary and recomputes band + tail (``torch.ops.macattn.mac_match`` / ``mac_attend``: the
Triton kernels on CUDA once ``macattn.methods.kernels.register_kernels()`` ran, the reference
elsewhere), or — under the runtime on CUDA — the bucket's ``MacDecodePlans`` over the paged pool
(``decode_plans``: one ``MacDecodePlan`` per layer configuration; ``macattn.methods.mac.decode_plans``).
``MacConfig(match="two_stage")``: the two-stage match (the reference function off the runtime's GPU
path, the plan's Triton kernels on it) over the state's sketch ring, which every append keeps.
A layer with a calibrated threshold (``match_scale``) matches and stores ``q~ / s`` (``match_query``):
every path below (seeding, reference, GPU plan, ONNX graph) then runs the paper's unit radius.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from macattn.core.attention import check_no_padding, full_attention_reference
from macattn.core.indexing import index_store_, storage_view
from macattn.core.summaries import AttentionSummary
from macattn.methods.base import AttentionMethod, Capabilities, DecodeGeometry, DecodeRows, ModelDims, StepContext
from macattn.methods.mac import ops  # noqa: F401  (defines torch.ops.macattn.mac_match / mac_attend)
from macattn.methods.mac.config import ENGINE_MISS_POLICIES, MacConfig
from macattn.methods.mac.decode_plans import MacDecodePlans
from macattn.methods.mac.match_sketch import sketch
from macattn.methods.mac.reference import mac_match_two_stage_reference
from macattn.methods.mac.seeding import (band_split_applies, band_split_attention, fresh_split_attention,
                                         packed_seeding_applies, packed_seeds, ring_positions, seed_packed_,
                                         seed_rings_, tail_summaries)
from macattn.methods.mac.state import MacState

__all__ = ["MacAttention"]


class MacAttention(AttentionMethod):
    """MAC over ``num_slots`` request rows of rings (``self.state``).

    Static settings (set before running, never per step): ``record_error`` — every decode step
    also computes full attention and keeps ``||mac - full|| / ||full||`` per layer in
    ``layer_errors`` (diagnostics only); ``collect_diagnostics`` — hit / skip / gap per layer
    and head into ``state.diagnostics`` (the runtime's GPU decode accumulates them inside its captured step).
    Outputs of the latest decode call: ``last_match_pos[layer]`` ``[B, Hq]`` int64 (-1 miss; a
    mapping of layer to tensor).
    Without a runtime (``StepContext.slots`` None, plain ``model.generate``) a fresh prompt takes
    ``B`` fresh rows (``slots``) and releases the previous call's.
    """

    name: ClassVar[str] = "mac"
    config_type: ClassVar[type] = MacConfig
    capabilities: ClassVar[Capabilities] = Capabilities(
        paged_kv=True, cuda_graphs=True, onnx_export=True, tensorrt_plugin=True, needs_pre_rope_query=True,
        miss_policies=ENGINE_MISS_POLICIES, head_sharded=True, prefix_caching=True)

    def __init__(self, config: MacConfig, dims: ModelDims, *, num_slots: int,
                 query_dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dims, num_slots=num_slots)
        self.state = MacState.allocate(config, num_layers=dims.num_layers, num_slots=num_slots,
                                       num_q_heads=dims.num_q_heads, head_dim=dims.head_dim,
                                       query_dtype=query_dtype or dims.dtype, device=dims.device)
        self.record_error = False
        self.collect_diagnostics = True
        self.layer_errors: dict[int, list[float]] = {}
        self.last_match_pos: Mapping[int, torch.Tensor] = {}
        self.slots: torch.Tensor | None = None      # plain-transformers rows (no runtime)
        self._mac_layers = config.enabled_layers(dims.num_layers)
        # 1 / s_h per calibrated layer ([Hq] fp64 on the model's device, made here: never inside a captured step)
        self.inv_match_scale: dict[int, torch.Tensor] = {}
        for layer in range(dims.num_layers):
            s = config.for_layer(layer).match_scales(dims.num_q_heads)
            if s is not None:
                self.inv_match_scale[layer] = 1.0 / torch.tensor(s, dtype=torch.float64, device=dims.device)

    def match_query(self, layer: int, q_pre: torch.Tensor) -> torch.Tensor:
        """The query MAC matches and stores for ``layer``: ``q_pre`` ``[B, Hq, T, d]`` (or ``[B, Hq, d]``)
        divided per head by the layer's ``match_scale`` (the calibrated threshold), in ``q_pre``'s dtype;
        ``q_pre`` itself under the paper's rule."""
        inv = self.inv_match_scale.get(layer)
        if inv is None:
            return q_pre
        inv = inv.view(-1, *([1] * (q_pre.dim() - 2)))     # [Hq, 1] or [Hq, 1, 1]
        acc = torch.promote_types(q_pre.dtype, torch.float32)
        return (q_pre.to(acc) * inv.to(q_pre.device, acc)).to(q_pre.dtype)

    @classmethod
    def default_config(cls) -> MacConfig:
        """MAC with its defaults (the engine's ``mac_config=None``, one meaning on every surface: ``EngineArgs``);
        ``MacConfig(enabled=False)`` runs full attention through MAC's ops."""
        return MacConfig()

    @classmethod
    def engine_config(cls, config: MacConfig | None = None) -> MacConfig:
        """``config`` (None: the defaults), refused with ``ValueError`` when a layer asks for a miss policy or a
        match the engine does not run (``MacConfig.require_engine_support``)."""
        config = super().engine_config(config)
        config.require_engine_support("ModelRunner")
        return config

    def slot_states(self):
        return {"mac": self.state}

    def prefix_recompute_tokens(self, prompt_len: int) -> int:
        """The largest ring window ``K`` over the layers where MAC is enabled (0 when it is enabled on none: a
        layer with MAC off never matches against its ring; 0 for a prompt shorter than ``min_context``, which
        seeds no ring). A prefill seeds a ring from the pre-RoPE queries
        of the prompt's last ``K`` positions (``_seed``), which exist only while those positions run: so a
        prefix-cache hit leaves at least ``K`` tokens to prefill. Its prefill is then a continued chunk over
        the cached K/V writing every ring column: the ring equals a fresh prefill's (bit for bit on the CPU
        reference when the rest runs as one chunk)."""
        if not self.config.engages(prompt_len):
            return 0
        return max((self.config.for_layer(layer).window for layer in self._mac_layers), default=0)

    def request_metrics(self, slot: int) -> dict[str, float]:
        """The request's hit rate and skipped prefix; ``{}`` without reading the device where none of its decode
        steps engaged (``MacDiagnostics.counted``: a request below ``min_context``, MAC off), so a finishing
        request does not wait for the step in flight (async scheduling)."""
        diagnostics = self.state.diagnostics
        return diagnostics.request(slot) if self.collect_diagnostics and slot in diagnostics.counted else {}

    def decoded(self, slots: list[int], positions: list[int]) -> None:
        """Mark the slots whose step engaged (a MAC layer, ``m >= min_context``) as counted by the diagnostics."""
        if self.collect_diagnostics and self._mac_layers:
            self.state.diagnostics.counted.update(s for s, m in zip(slots, positions) if self.config.engages(m))

    def request_metrics_part(self, slot: int) -> list[float] | None:
        """The slot's ``(head-steps, hits, skipped)`` over this rank's heads (None: no diagnostics)."""
        return self.state.diagnostics.per_slot[slot].tolist() if self.collect_diagnostics else None

    def combine_request_metrics(self, parts: list) -> dict[str, float]:
        """The hit rate and skipped prefix of the counts summed over the ranks' heads."""
        parts = [p for p in parts if p is not None]
        return self.state.diagnostics.request_of([sum(c) for c in zip(*parts)]) if parts else {}

    # --- the runtime's GPU decode (per batch bucket) -------------------------------------------
    def decode_plans(self, geometry: DecodeGeometry, rows: DecodeRows) -> MacDecodePlans:
        """One ``MacDecodePlan`` per distinct layer configuration (``MacDecodePlans``)."""
        return MacDecodePlans(geometry, rows, self.config, self.dims.num_layers)

    def decode_graph_key(self, positions) -> tuple[bool, bool]:
        """``(collect_diagnostics, engaged)``: the step with the diagnostics' accumulation is its own captured
        variant, and so is the step where no row has reached ``min_context`` (engaged False: the MAC layers
        attend in full, ``MacDecodePlans``)."""
        return self.collect_diagnostics, self._engaged(positions)

    def _engaged(self, positions) -> bool:
        """Whether a decode step of rows at ``positions`` runs MAC's match: ``min_context`` 0, or a row at it."""
        return self.config.min_context == 0 or any(self.config.engages(m) for m in positions)

    def decode_in_full(self, positions) -> bool:
        """True where no layer has MAC on, or no row has reached ``min_context``: every layer then attends in full
        and no ring is read or written (the step of MAC off)."""
        return not self._mac_layers or not self._engaged(positions)

    def decode_graph_keys(self) -> tuple[tuple[bool, bool], ...]:
        """The variants a step of the current settings can take: engaged only, or both with ``min_context``."""
        engaged = (True, False) if self.config.min_context > 0 else (True,)
        return tuple((self.collect_diagnostics, e) for e in engaged)

    def record_decode_step(self, plans: MacDecodePlans | None, key: tuple[bool, bool]) -> None:
        """With diagnostics on (``key[0]``), the step's hit / skip / gap per layer and per request slot from the
        plans' ``match_pos`` (inside the captured step: no host work per step)."""
        if key[0] and plans is not None:
            plans.record_diagnostics(self.state.diagnostics)

    def decode_step_done(self, plans: MacDecodePlans | None, batch_size: int) -> None:
        """``last_match_pos``: the step's decisions, views of the plans' buffers (sliced when read)."""
        if plans is not None:
            self.last_match_pos = plans.latest_match_pos(batch_size)

    # --- plain transformers use (no runtime) -------------------------------------------------
    def start_batch(self, batch_size: int) -> None:
        """Release the previous call's rows and take fresh (reset) ones for ``batch_size`` requests."""
        self.release()
        if batch_size > self.state.num_slots:
            raise ValueError(f"batch_size must be <= num_slots={self.state.num_slots}, got {batch_size}")
        self.slots = torch.tensor([self.state.acquire() for _ in range(batch_size)], dtype=torch.int64)

    def release(self) -> None:
        if self.slots is not None:
            for s in self.slots.tolist():
                self.state.release(s)
        self.slots = None

    def _slots(self, step: StepContext) -> torch.Tensor | None:
        return step.slots if step.slots is not None else self.slots

    def _rings(self, step: StepContext, layer: int):
        return self.state.layer(layer) if step.rings is None else step.rings[layer]

    # --- attention ---------------------------------------------------------------------------
    def prefill(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        B, Hq, T, d = query.shape
        S = key.shape[2]
        params = self.config.for_layer(layer)
        q_pre = self.match_query(layer, q_pre)
        min_context = self.config.min_context
        if step.prefill is not None:         # a packed call: attend, seeding each segment's ring row on its K/V
            plan = step.prefill
            if not params.enabled:           # a layer with MAC off never reads its ring: nothing to seed
                return plan.attend(layer, query, key, value, scale)
            if plan.varlen(query) is not None and packed_seeding_applies(plan.segments, params.window, params.band,
                                                                         min_context):
                out = plan.attend(layer, query, key, value, scale)     # every segment at once, then every ring
                seeds = plan.memo(("mac", params.window, params.band),
                                  lambda: packed_seeds(plan.segments, params.window, params.band, query.device,
                                                       min_context))
                if seeds is not None:
                    seed_packed_(self.state, layer, seeds, query, q_pre, key, value, scale=scale)
                return out
            far: dict[int, AttentionSummary] = {}

            def attention(i, q, k, v):
                # a segment holding ring positions: its attention yields their summaries (no second pass to seed)
                if ring_positions(plan.segments[i], params.window, min_context) == 0:
                    return None
                if q.shape[2] == k.shape[2]:        # fresh: the ring's tail attends apart from the rest
                    got = fresh_split_attention(q, k, v, window=params.window, band=params.band, scale=scale)
                elif band_split_applies(q, k, params.band):
                    got = band_split_attention(q, k, v, band=params.band, scale=scale)
                else:
                    got = None
                if got is None:
                    return None
                far[i] = got[1]
                return got[0]

            def seed(i, k, v):
                seg = plan.segments[i]
                keep = ring_positions(seg, params.window, min_context)
                if keep == 0:     # a later chunk writes every ring column (it holds the prompt's last K), or none
                    return
                part = slice(seg.offset, seg.offset + seg.length)
                self._seed(layer, plan.slot_row(i, query.device), params, query[:, :, part], q_pre[:, :, part],
                           k, v, scale, keep=keep, host_slots=[seg.slot], summary=far.pop(i, None))

            return plan.attend(layer, query, key, value, scale, each=seed, segment_attention=attention)
        out, _ = fallback(module, query, key, value, attention_mask, scaling=scale, **kwargs)
        if S == T and layer == 0 and step.slots is None:
            self.start_batch(B)
        slots = self._slots(step)
        if slots is None:
            raise RuntimeError("MAC prefill of a continued sequence without a batch; call start_batch first")
        if S != T and step.rings is not None:
            raise NotImplementedError("graph export supports prefill of a fresh prompt only")
        if not self.config.engages(S):       # the decode starts below where MAC engages: no ring to seed
            return out
        self._seed(layer, slots.to(query.device), params, query, q_pre, key, value, scale, rings=step.rings)
        return out

    def _seed(self, layer: int, slots: torch.Tensor, params, query, q_pre, key, value, scale: float,
              rings=None, keep: int | None = None, host_slots: list[int] | None = None,
              summary: AttentionSummary | None = None) -> None:
        """Seed ring rows ``slots [B]`` from a prefill call: ``query / q_pre [B, Hq, T, d]`` at the last
        ``T`` positions of ``key / value [B, Hkv, S, d]``. A fresh prompt (``S == T``) resets and seeds
        whole rows with tensor ops (traceable; ``rings``: the export's explicit ring tensors); a chunk
        after earlier ones writes its last ``min(K, T, keep)`` positions on top of the row (``keep``: how
        many of them later chunks leave in the ring; ``host_slots``: ``slots`` as ints, where the caller has
        them, so the host does not wait for the GPU to read them back; ``summary``: the rectified summaries its
        attention already made, ``band_split_attention``'s far part of a chunk's queries or
        ``fresh_split_attention``'s of a fresh prompt's last ``min(K, T)``)."""
        T, S = query.shape[2], key.shape[2]
        if S == T:
            seed_rings_(self._rings(StepContext(rings=rings), layer), slots, query, q_pre, key, value,
                        band=params.band, scale=scale, summary=summary)
            if rings is None:
                self.state.sketch_rows_(layer, slots)
            return
        n = min(params.window, T, T if keep is None else keep)
        summ = (tail_summaries(query[:, :, T - n:], key, value, band=params.band, scale=scale) if summary is None
                else AttentionSummary(summary.o[:, :, T - n:], summary.lse[:, :, T - n:]))
        qpos = torch.arange(S - n, S, device=query.device)
        for b, slot in enumerate(slots.tolist() if host_slots is None else host_slots):
            self.state.seed(layer, slot, qpos, q_pre[b, :, T - n:], type(summ)(summ.o[b], summ.lse[b]))

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        B, Hq, _, d = query.shape
        S = key.shape[2]
        slots = self._slots(step)
        if slots is None or slots.numel() != B:
            raise RuntimeError(f"MAC decode for a batch of {B} without a matching prefill")
        if step.positions is None:
            check_no_padding(attention_mask)
            positions = torch.full((B,), S - 1, dtype=torch.int64, device=query.device)
        else:
            positions = step.positions.to(device=query.device, dtype=torch.int64)
            if positions.shape != (B,):
                raise ValueError(f"StepContext.positions must be [B]={B}, got {tuple(positions.shape)}")
        slots = slots.to(query.device)
        params = self.config.for_layer(layer)
        q, qp = query[:, :, 0], self.match_query(layer, q_pre[:, :, 0])
        rings = self._rings(step, layer)
        sring = self.state.sring[layer] if step.rings is None else None
        if step.paged is not None:
            return step.paged.attend(layer, params, q, qp, key, value, positions, slots, rings, sring).unsqueeze(1)
        two_stage = params.enabled and params.match == "two_stage"
        if two_stage:
            if step.rings is not None:
                raise NotImplementedError("graph export runs the exact match (MacConfig(match='exact'))")
            match_pos, _ = mac_match_two_stage_reference(qp, rings[0], rings[2], rings[3], slots, positions,
                                                         band=params.band, tau=params.tau, sketch=params.match_sketch,
                                                         candidates=params.match_candidates)
        elif params.enabled:
            match_pos, _ = torch.ops.macattn.mac_match(qp, rings[0], rings[2], rings[3], slots, positions,
                                                        params.band, params.tau)
        else:
            match_pos = torch.full((B, Hq), -1, dtype=torch.int64, device=query.device)
        below = None
        if params.enabled and self.config.min_context > 0:     # rows before MAC engages: full, rings untouched
            if step.rings is not None:
                raise NotImplementedError("graph export runs MAC from the first step (MacConfig(min_context=0))")
            below = ~self.config.engages(positions)
            match_pos = match_pos.masked_fill(below[:, None], -1)
            kept = _RingColumns(rings + (() if sring is None else (sring,)), slots, positions)
        out = torch.ops.macattn.mac_attend(q, qp, key, value, positions, match_pos, slots, *rings,
                                           params.band, float(scale))
        if sring is not None:    # the append's sketch (mac_attend appended qp to the ring)
            index_store_(sring, (slots, slice(None), positions % sring.shape[2]),
                         sketch(qp.to(rings[0].dtype), params.match_sketch))
        if below is not None:
            kept.restore(below)
        if not isinstance(self.last_match_pos, dict):      # the GPU decoder's read-only view
            self.last_match_pos = {}
        self.last_match_pos[layer] = match_pos
        if self.collect_diagnostics and step.rings is None:
            self.state.diagnostics.record(layer, match_pos, positions, params.band,
                                          slots if step.slots is not None else None,
                                          weights=None if below is None else (~below).to(torch.float64))
        if self.record_error:
            full = full_attention_reference(q, key, value, positions, scale=scale)
            err = (out.to(full.dtype) - full).norm() / full.norm().clamp(min=1e-30)
            self.layer_errors.setdefault(layer, []).append(float(err))
        return out.unsqueeze(1)


class _RingColumns:
    """The ring column each decode row's append writes (``(slot, :, m mod K)`` of ``qring / oring / ring_lse``
    and the sketch ring, ``(slot, m mod K)`` of ``ring_pos``), read before the append so that ``restore`` can put
    back the rows that must leave their ring as it was. Tensor ops only, no host synchronisation."""

    def __init__(self, rings: tuple[torch.Tensor, ...], slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.rings, self.slots = rings, slots
        self.cols = positions % rings[0].shape[2]
        self.saved = [self._column(r).clone() for r in rings]

    def _index(self, ring: torch.Tensor) -> tuple:
        return (self.slots, self.cols) if ring.dim() == 2 else (self.slots, slice(None), self.cols)

    def _column(self, ring: torch.Tensor) -> torch.Tensor:
        return storage_view(ring)[self._index(ring)]

    def restore(self, rows: torch.Tensor) -> None:
        """Put back the saved columns of the rows where ``rows [B]`` bool is set."""
        for ring, saved in zip(self.rings, self.saved):
            now = self._column(ring)
            keep = rows.view(-1, *([1] * (now.dim() - 1)))
            storage_view(ring)[self._index(ring)] = torch.where(keep, saved, now)
