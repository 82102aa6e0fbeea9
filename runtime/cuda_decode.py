"""GPU decode: the bound model's whole step per batch bucket, replayed as one CUDA graph.

FlashInfer's plan()/run() split, applied to the whole model step: per batch bucket
``nb`` (powers of two up to ``max_batch_size``) one ``DecodeBucket`` holds the static
inputs (token ids, positions ``m``, state slots, sampling rows; for a method over the paged KV
pool also the page table, the KV write rows and one ``MacDecodePlan`` per distinct layer
configuration (window, band, tau)) and, with ``use_cuda_graphs``, the captured steps: embedding
-> layers -> final norm -> logits -> next tokens (-> MAC's diagnostics accumulators), one graph
per variant ``(greedy, diagnostics)`` (``greedy``: argmax only, else temperature / top-k / top-p,
captured the first time a batch has a sampling request; ``diagnostics``:
``MacAttention.collect_diagnostics``). The host writes the inputs (``StepInputs``: one copy),
replays, and reads the tokens back: the one synchronisation of a step. ``step`` pads a batch of ``B <= nb`` requests with rows that point
at a scratch state slot (and a scratch KV block), owned by the executor and never handed to a
request, so padding never touches a request's state.

Over the paged pool, every layer's attention (the bound method, ``StepContext.paged``) runs
``MacDecodePlan.run`` (MAC: match, device-side plan, split-KV attention over the pages, merge +
ring append) or ``run_full`` (MAC off in a layer, and the full-attention method). A method that
keeps its own KV (``capabilities.paged_kv`` False: retrieval-completion) gets the slots and
positions only. Graphs are captured when every bound method (and FastMKA composed with it)
declares ``cuda_graphs`` and ``decode_capturable()`` holds for its config. MAC's diagnostics (hit
rate, skipped prefix, gap; per layer and per request slot) are accumulated inside the step from
the per-layer ``match_pos`` buffers, padding rows weighted 0; a method's host-side bookkeeping
runs in its ``decoded`` hook after the step.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from macattn.methods.mac.backend import MacAttention
from macattn.methods.mac.match_sketch import sketch_dims, sketch_dtype, sketch_projection_of
from macattn.runtime.kv_cache import PagedWriteView
from macattn.runtime.sampling import PAD_ROW, SamplingBatch, sample_tokens
from macattn.runtime.step_inputs import StepInputs

__all__ = ["DecodeBucket", "CudaDecoder"]

FULL_PLAN = "full"   # the plan key of the full-attention method (an attend-only plan)
_UNSET = object()            # a page-table row not written yet


class _RowsOf(Mapping):
    """``layer -> match_pos[:B]`` of a bucket's buffers, sliced when read (not per step)."""

    def __init__(self, match_pos: dict, rows: int) -> None:
        self._mp, self._rows = match_pos, rows

    def __getitem__(self, layer):
        return self._mp[layer][: self._rows]

    def __iter__(self):
        return iter(self._mp)

    def __len__(self) -> int:
        return len(self._mp)


def plan_key(params) -> tuple:
    """The ``LayerMacParams`` fields a ``MacDecodePlan`` is made for (layers sharing them share a plan)."""
    two = params.match == "two_stage"
    return (params.window, params.band, params.tau, params.match,
            params.match_sketch if two else None, params.match_candidates if two else None)


@dataclass
class DecodeBucket:
    """One batch bucket (``nb`` rows, on the model's device).

    inputs: the ``StepInputs`` the step's static tensors are views of — ids ``[nb, 1]``,
    positions / slots ``[nb]`` int64, the rows' ``SamplingBatch``, and over the paged pool
    page_table ``[nb, max_pages]`` int32 and write_rows ``[nb]`` int64 (flat pool row of position
    ``m``); table_rows: the (request, block count) each page-table row holds. mask ``[nb, 1, 1, 1]``
    bool (paged pool only; all true: the op masks by position). plans: layer params ->
    ``MacDecodePlan``. match_pos: layer -> ``[nb, Hq]`` int64 written each step; diag_index: its
    layers and their bands on the device (diagnostics). graphs / outputs: per variant
    (``step_key``), the captured step and its ``(tokens [nb], logits [nb, V])``.
    """

    nb: int
    inputs: StepInputs
    sampling: SamplingBatch
    mask: torch.Tensor | None = None
    table_rows: list = field(default_factory=list)
    plans: dict = field(default_factory=dict)
    match_pos: dict = field(default_factory=dict)
    diag_index: tuple | None = None
    graphs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs.device["ids"]

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs.device["positions"]

    @property
    def slots(self) -> torch.Tensor:
        return self.inputs.device["slots"]

    @property
    def page_table(self) -> torch.Tensor | None:
        return self.inputs.device.get("page_table")

    @property
    def write_rows(self) -> torch.Tensor | None:
        return self.inputs.device.get("write_rows")

    def attend_full(self, q, k_pages, v_pages, positions):
        """Full attention over ``[0, m]`` of every request (the full-attention method)."""
        return self.plans[FULL_PLAN].run_full(q, k_pages, v_pages, positions, page_table=self.page_table, check=False)

    def attend(self, layer, params, q, q_pre, k_pages, v_pages, positions, slots, rings, sring=None):
        """The layer's MAC attention for this bucket (called by ``MacAttention.decode``); ``sring``: the
        layer's sketch ring (two-stage match), kept by the plan's append."""
        plan = self.plans[plan_key(params)]
        if params.enabled:
            proj = None if sring is None else sketch_projection_of(params.match_sketch, q.shape[-1], q.device)
            out, match_pos, _ = plan.run(q, q_pre, k_pages, v_pages, positions, slots, *rings,
                                         page_table=self.page_table, check=False, sring=sring, proj=proj)
            buf = self.match_pos.get(layer)
            if buf is None:
                buf = self.match_pos[layer] = torch.empty_like(match_pos)
            buf.copy_(match_pos)
            return out
        self.match_pos.pop(layer, None)
        return plan.run_full(q, k_pages, v_pages, positions, page_table=self.page_table, check=False)


class CudaDecoder:
    """Decode steps of a ``ModelExecutor`` on CUDA (see module doc)."""

    def __init__(self, executor, *, use_cuda_graphs: bool) -> None:
        from macattn.plugins.decode_plan import MacDecodePlan

        self.ex = executor
        # FastMKA composes with the attention method: both must declare a capturable decode
        methods = [executor.method] + ([executor.mka] if executor.mka is not None else [])
        self.use_cuda_graphs = use_cuda_graphs and all(m.capabilities.cuda_graphs and m.decode_capturable()
                                                       for m in methods)
        self.paged_kv = executor.paged_kv
        self._plan_cls = MacDecodePlan
        cfg = executor.config
        self.max_pages = -(-cfg.max_seq_len // cfg.block_size)
        self.buckets: dict[int, DecodeBucket] = {}
        sizes, n = [], 1
        while n < cfg.max_batch_size:
            sizes.append(n)
            n *= 2
        self.sizes = sizes + [cfg.max_batch_size]

    def bucket_size(self, batch: int) -> int:
        return next(n for n in self.sizes if n >= batch)

    # --- buckets ---------------------------------------------------------------------------
    def _new_bucket(self, nb: int) -> DecodeBucket:
        ex, dev = self.ex, self.ex.device
        hf = ex.model.config
        inputs = StepInputs(nb, max_pages=self.max_pages, paged=self.paged_kv, device=dev)
        b = DecodeBucket(nb=nb, inputs=inputs, sampling=inputs.sampling())
        if self.paged_kv:
            b.mask = torch.ones(nb, 1, 1, 1, dtype=torch.bool, device=dev)
            b.table_rows = [_UNSET] * nb
        if not self.paged_kv:
            return b
        def plan(window: int, band: int, tau: float | None, match: str = "exact", sketch_kind=None,
                 candidates=None):
            return self._plan_cls(
                batch_size=nb, max_context=ex.config.max_seq_len, num_q_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads, head_dim=ex.head_dim, window=window, band=band,
                tau=tau, page_size=ex.config.block_size, q_dtype=ex.dtype, device=dev,
                **({} if match != "two_stage" else dict(
                    match_candidates=candidates, match_sketch_dims=sketch_dims(sketch_kind, ex.head_dim),
                    match_sketch_itemsize=sketch_dtype(sketch_kind).itemsize)))

        method = ex.method
        if isinstance(method, MacAttention):
            for layer in range(ex.num_layers):
                key = plan_key(method.config.for_layer(layer))
                if key not in b.plans:
                    b.plans[key] = plan(*key)
        else:
            b.plans[FULL_PLAN] = plan(1, 0, None)
        return b

    def _capture(self, b: DecodeBucket, key: tuple[bool, bool]) -> None:
        """Capture ``b``'s whole step for ``key = (greedy, diagnostics)`` (warm-up first, on the
        bucket's scratch rows only: slot, block, position 0 — no request's state is touched; padding
        rows weigh 0 in the diagnostics)."""
        dev = self.ex.device
        self._write_inputs(b, [])
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._forward(b, *key)
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b.outputs[key] = self._forward(b, *key)
        b.graphs[key] = graph

    def _forward(self, b: DecodeBucket, greedy: bool, diagnostics: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.ex
        if not self.paged_kv:
            with ex.step(slots=b.slots, positions=b.positions):
                logits = ex.run_model(b.ids, b.positions.view(b.nb, 1))
        else:
            with ex.step(slots=b.slots, positions=b.positions, paged=b):
                logits = ex.run_model(b.ids, b.positions.view(b.nb, 1), b.mask, PagedWriteView(ex.kv, b.write_rows))
        tokens = sample_tokens(logits, b.sampling, greedy_only=greedy)
        if diagnostics and b.match_pos:     # MAC's accumulators, inside the step: no host work per step
            layers, bands = self._diag_index(b, ex.method)
            ex.method.state.diagnostics.record_layers(layers, torch.stack(list(b.match_pos.values())), b.positions,
                                                      bands, b.slots, weights=b.inputs.device["valid"])
        return tokens, logits

    def _write_inputs(self, b: DecodeBucket, seqs) -> None:
        """Write ``seqs``' step inputs into ``b``'s static tensors (``StepInputs``: numpy writes into the
        pinned twin, one copy); rows past ``len(seqs)`` (all of them for ``[]``) point at the scratch
        slot, block and position 0. A page-table row is rewritten only when its request or block
        count changed."""
        ex, h = self.ex, b.inputs.host
        n, bs = len(seqs), ex.config.block_size
        m = [s.num_tokens - 1 for s in seqs]
        h["ids"][:n, 0] = [s.output[-1] for s in seqs]
        h["ids"][n:] = 0
        h["positions"][:n] = m
        h["positions"][n:] = 0
        h["slots"][:n] = [s.slot for s in seqs]
        h["slots"][n:] = ex.scratch_slot
        h["valid"][:n] = 1.0
        h["valid"][n:] = 0.0
        rows = ex.sampling_rows(seqs) + [PAD_ROW] * (b.nb - n)
        h["temperature"][:] = [p.temperature for p, _, _ in rows]
        h["top_k"][:] = [p.top_k for p, _, _ in rows]
        h["top_p"][:] = [p.top_p for p, _, _ in rows]
        h["seed"][:] = [seed for _, seed, _ in rows]
        h["sample_pos"][:] = [pos for _, _, pos in rows]
        if self.paged_kv:
            h["write_rows"][:n] = [s.block_table[x // bs] * bs + x % bs for s, x in zip(seqs, m)]
            h["write_rows"][n:] = ex.scratch_block * bs
            table = h["page_table"]
            for i in range(b.nb):
                key = (seqs[i].request_id, len(seqs[i].block_table)) if i < n else None
                if b.table_rows[i] != key:
                    table[i] = ex.scratch_block
                    if key is not None:
                        table[i, :key[1]] = seqs[i].block_table
                    b.table_rows[i] = key
        b.inputs.upload()

    # --- one step --------------------------------------------------------------------------
    def step_key(self, seqs) -> tuple[bool, bool]:
        """Which captured variant a step of ``seqs`` replays: ``(greedy sampler only, MAC diagnostics on)``."""
        method = self.ex.method
        return (all(s.sampling.greedy for s in seqs),
                isinstance(method, MacAttention) and method.collect_diagnostics)

    @torch.inference_mode()
    def step(self, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next tokens [B] int64 on the CPU, logits [B, V])`` of each request's token at
        ``m = num_tokens - 1``; writes its K/V and appends to its rings."""
        ex = self.ex
        B = len(seqs)
        nb = self.bucket_size(B)
        b = self.buckets.get(nb)
        if b is None:
            b = self.buckets[nb] = self._new_bucket(nb)
        method = ex.method
        key = self.step_key(seqs)
        if self.use_cuda_graphs and key not in b.graphs:
            self._capture(b, key)
        self._write_inputs(b, seqs)
        if self.use_cuda_graphs:
            b.graphs[key].replay()
            tokens, logits = b.outputs[key]
            logits = logits[:B].clone()
        else:
            tokens, logits = self._forward(b, *key)
            logits = logits[:B]
        tokens = tokens[:B].cpu()
        method.decoded([s.slot for s in seqs], [s.num_tokens - 1 for s in seqs])
        if isinstance(method, MacAttention) and b.match_pos:
            method.last_match_pos = _RowsOf(b.match_pos, B)
        return tokens, logits

    def _diag_index(self, b: DecodeBucket, method) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's MAC layers and their bands as device tensors, made once (``match_pos``'s order)."""
        key = tuple(b.match_pos)
        if b.diag_index is None or b.diag_index[0] != key:
            dev = self.ex.device
            b.diag_index = (key, torch.tensor(key, device=dev),
                            torch.tensor([float(method.config.for_layer(layer).band) for layer in key],
                                         dtype=torch.float64, device=dev))
        return b.diag_index[1], b.diag_index[2]
