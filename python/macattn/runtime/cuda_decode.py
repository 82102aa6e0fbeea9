"""GPU decode: the bound model's whole step per batch bucket, replayed as one CUDA graph.

FlashInfer's plan()/run() split, applied to the whole model step: per batch bucket
``nb`` (powers of two up to ``max_batch_size``) one ``DecodeBucket`` holds the static
inputs (token ids, positions ``m``, state slots, sampling rows; for a method over the paged KV
pool also the page table and the KV write rows) and the bound method's ``DecodePlans`` for the
bucket (``AttentionMethod.decode_plans``: its own metadata and scratch, made once per bucket; the
default an attend-only plan) and, with ``use_cuda_graphs``, the captured steps: embedding -> layers
-> final norm -> logits -> next tokens (and the penalties' token counts) -> the method's
``record_decode_step``, one graph per variant ``(sampler variant, method key)`` (``SamplerVariant``:
argmax only, or the draw with temperature / min-p / top-k / top-p, with or without the bias table
(logit bias, min-tokens bans) and the penalties, each captured the first time a batch needs it;
``method key``: ``AttentionMethod.decode_graph_key`` of the step's positions, what changes the method's
launches or what its step records — MAC: its diagnostics, and whether a row has reached ``min_context``; each
key is set as the plans' ``variant`` before its step runs, and ``prewarm`` captures ``decode_graph_keys()``).
The host writes the inputs (``StepInputs``: one copy), replays, and reads the tokens back: the one
synchronisation of a step.
``step`` pads a batch of ``B <= nb`` requests with rows that point at a scratch state slot (and a
scratch KV block), owned by the executor and never handed to a request, so padding never touches a
request's state (padding rows carry ``valid == 0`` for what the method records).

Over the paged pool, every layer's attention (the bound method, ``StepContext.paged`` = the bucket's
plans) runs through the plans' calls (``DecodePlans.attend`` / ``attend_full``) over the pages. A
method that keeps its own KV (``capabilities.paged_kv`` False: retrieval-completion) gets the slots
and positions only (no plans). Graphs are captured when every bound method (and FastMKA composed
with it) declares ``cuda_graphs`` and ``decode_capturable()`` holds for its config. After the step
the method's host-side hooks run: ``decoded`` (its bookkeeping) and ``decode_step_done`` (its view
of the step's outputs). This module names no method: it calls these hooks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from macattn.core.ragged import DecodeTail
from macattn.methods.base import DecodeGeometry, DecodePlans, DecodeRows
from macattn.runtime.in_flight import TokenFeed
from macattn.runtime.kv_cache import PagedWriteView
from macattn.runtime.sampling import PAD_ROW, SamplerVariant, SamplingBatch, sample_tokens
from macattn.runtime.step_inputs import StepInputs

__all__ = ["DecodeBucket", "CudaDecoder"]

_UNSET = object()            # a page-table row not written yet


@dataclass
class DecodeBucket:
    """One batch bucket (``nb`` rows, on the model's device).

    inputs: the ``StepInputs`` the step's static tensors are views of — ids ``[nb, 1]``,
    positions / slots ``[nb]`` int64, valid ``[nb]`` fp64, the rows' ``SamplingBatch``, and over the
    paged pool page_table ``[nb, max_pages]`` int32 and write_rows ``[nb]`` int64 (flat pool row of
    position ``m``); table_rows: the (request, block count) each page-table row holds. mask
    ``[nb, 1, 1, 1]`` bool (paged pool only; all true: the op masks by position). plans: the bound
    method's ``DecodePlans`` for this bucket (paged pool only; ``StepContext.paged`` of its steps).
    graphs / outputs: per variant (``step_key``), the captured step and its
    ``(tokens [nb], logits [nb, V])``. tail_q: the query rows ``[nb, Hq, d]`` of a packed call's decode tail
    (``CudaDecoder.tail``; made on first use).
    """

    nb: int
    inputs: StepInputs
    sampling: SamplingBatch
    mask: torch.Tensor | None = None
    table_rows: list = field(default_factory=list)
    plans: DecodePlans | None = None
    graphs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    tail_q: torch.Tensor | None = None

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
    def valid(self) -> torch.Tensor:
        return self.inputs.device["valid"]

    @property
    def page_table(self) -> torch.Tensor | None:
        return self.inputs.device.get("page_table")

    @property
    def write_rows(self) -> torch.Tensor | None:
        return self.inputs.device.get("write_rows")


class CudaDecoder:
    """Decode steps of a ``ModelExecutor`` on CUDA (see module doc)."""

    def __init__(self, executor, *, use_cuda_graphs: bool) -> None:
        self.ex = executor
        # FastMKA composes with the attention method: both must declare a capturable decode
        methods = [executor.method] + ([executor.mka] if executor.mka is not None else [])
        self.use_cuda_graphs = use_cuda_graphs and all(m.capabilities.cuda_graphs and m.decode_capturable()
                                                       for m in methods)
        self.paged_kv = executor.paged_kv
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
        inputs = StepInputs(nb, max_pages=self.max_pages, paged=self.paged_kv, device=dev)
        b = DecodeBucket(nb=nb, inputs=inputs, sampling=inputs.sampling())
        if not self.paged_kv:
            return b
        b.mask = torch.ones(nb, 1, 1, 1, dtype=torch.bool, device=dev)
        b.table_rows = [_UNSET] * nb
        hf = ex.model.config
        geometry = DecodeGeometry(batch_size=nb, max_context=ex.config.max_seq_len, page_size=ex.config.block_size,
                                  num_q_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                                  head_dim=ex.head_dim, dtype=ex.dtype, device=dev)
        rows = DecodeRows(positions=b.positions, slots=b.slots, valid=b.valid, page_table=b.page_table,
                          scratch_slot=ex.scratch_slot)
        b.plans = ex.method.decode_plans(geometry, rows)
        return b

    def _capture(self, b: DecodeBucket, key: tuple[SamplerVariant, Hashable]) -> None:
        """Capture ``b``'s whole step for ``key = (sampler variant, method key)`` (warm-up first, on the
        bucket's scratch rows only: slot, block, position 0 — no request's state is touched; padding
        rows carry ``valid == 0`` for what the method records and the token counts)."""
        dev = self.ex.device
        if key[0].penalize:
            self.ex.token_counts.ensure()        # allocated once, before any graph reads it
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

    def _forward(self, b: DecodeBucket, variant: SamplerVariant, method_key: Hashable
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step (what a graph captures): the model over ``b``'s inputs, the sampler of ``variant`` (with
        the penalties: the rows' token counts read, the step's tokens counted), then the method's
        ``record_decode_step`` for ``method_key``. Returns ``(tokens [nb], logits [nb, V])``."""
        ex = self.ex
        if b.plans is not None:
            b.plans.variant = method_key
        if not self.paged_kv:
            with ex.step(slots=b.slots, positions=b.positions):
                logits = ex.run_model(b.ids, b.positions.view(b.nb, 1))
        else:
            with ex.step(slots=b.slots, positions=b.positions, paged=b.plans):
                logits = ex.run_model(b.ids, b.positions.view(b.nb, 1), b.mask, PagedWriteView(ex.kv, b.write_rows))
        counts = ex.token_counts.rows(b.slots) if variant.penalize else None
        tokens = sample_tokens(logits, b.sampling, greedy_only=not variant.draw, use_bias=variant.bias, counts=counts)
        if variant.penalize:
            ex.token_counts.record(b.slots, tokens, b.valid)
        ex.method.record_decode_step(b.plans, method_key)
        return tokens, logits

    def _write_inputs(self, b: DecodeBucket, seqs) -> None:
        """Write ``seqs``' step inputs into ``b``'s static tensors (``StepInputs``: numpy writes into the
        pinned twin, one copy); rows past ``len(seqs)`` (all of them for ``[]``) point at the scratch
        slot, block and position 0. A page-table row is rewritten only when its request or block
        count changed."""
        ex, h = self.ex, b.inputs.host
        b.inputs.wait_copied()
        n, bs = len(seqs), ex.config.block_size
        m = [s.num_tokens - 1 for s in seqs]
        h["ids"][:n, 0] = [s.last_token_on_host for s in seqs]
        h["ids"][n:] = 0
        h["positions"][:n] = m
        h["positions"][n:] = 0
        h["slots"][:n] = [s.slot for s in seqs]
        h["slots"][n:] = ex.scratch_slot
        h["valid"][:n] = 1.0
        h["valid"][n:] = 0.0
        rows = ex.sampling_rows(seqs) + [PAD_ROW] * (b.nb - n)
        keys = [(s.request_id, s.num_generated < s.sampling.min_tokens) for s in seqs] + [None] * (b.nb - n)
        b.inputs.write_sampling(rows, keys)
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

    @torch.inference_mode()
    def prewarm(self) -> list[int]:
        """Capture every bucket's greedy step now (what ``step`` would capture on first use); returns the sizes."""
        if not self.use_cuda_graphs:
            return []
        variant = self.step_key([])[0]
        for method_key in self.ex.method.decode_graph_keys():
            for nb in self.sizes:
                self._bucket(nb, (variant, method_key))
        if self.paged_kv and self.ex.method.decode_in_full([]):     # a decode tail's kernels, compiled now
            for nb in self.sizes:
                self.tail([], nb=nb)
        return list(self.sizes)

    def _bucket(self, nb: int, key: tuple[SamplerVariant, Hashable] | None) -> DecodeBucket:
        """Bucket ``nb`` (made on first use), with variant ``key`` captured when graphs are on (None: none)."""
        b = self.buckets.get(nb)
        if b is None:
            b = self.buckets[nb] = self._new_bucket(nb)
        if self.use_cuda_graphs and key is not None and key not in b.graphs:
            self._capture(b, key)
        return b

    # --- a packed call's decode tail -------------------------------------------------------
    @torch.inference_mode()
    def tail(self, seqs, feed: TokenFeed | None = None, *, nb: int | None = None
             ) -> tuple[torch.Tensor, DecodeTail, Callable[[], None]]:
        """``seqs``' decode rows as the tail of a packed call (``core.ragged.DecodeTail``; the method's decode of
        their positions is full attention, ``AttentionMethod.decode_in_full``): their bucket's inputs are written
        (the pending tokens from ``feed``) and ``(ids [B] int64 on the device, the tail, done)`` returned. The tail's
        attention is the bucket's plans' ``attend_full`` over the pages, eager (what those rows' decode step runs).
        ``done()``: the method's host hooks after the call, as after a decode step.
        ``nb``: the bucket (default: ``len(seqs)``'s); an empty ``seqs`` runs the tail's attention once on the
        scratch rows (``prewarm``)."""
        ex, B = self.ex, len(seqs)
        b = self._bucket(self.bucket_size(B) if nb is None else nb, None)
        self._write_inputs(b, seqs)
        if feed is not None:
            feed.write(b.ids, seqs)
        if b.tail_q is None:
            g = b.plans.geometry
            b.tail_q = torch.zeros(b.nb, g.num_q_heads, g.head_dim, dtype=g.dtype, device=g.device)
        q_buf = b.tail_q

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            q_buf[:B].copy_(q)
            return b.plans.attend_full(q_buf, *ex.kv.pages(layer), b.positions)[:B]

        if not seqs:
            attend(0, q_buf[:0])
        key = ex.method.decode_graph_key([s.num_tokens - 1 for s in seqs])
        return b.ids[:B, 0], DecodeTail(B, attend), lambda: self._step_done(b, seqs, key)

    # --- one step --------------------------------------------------------------------------
    def step_key(self, seqs) -> tuple[SamplerVariant, Hashable]:
        """Which captured variant a step of ``seqs`` replays: ``(SamplerVariant of their parameters, the
        method's decode_graph_key of their positions)``."""
        return (SamplerVariant.of([s.sampling for s in seqs]),
                self.ex.method.decode_graph_key([s.num_tokens - 1 for s in seqs]))

    @torch.inference_mode()
    def step(self, seqs, feed: TokenFeed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next tokens [B] int64 on the device, logits [B, V])`` of each request's token at
        ``m = num_tokens - 1``; writes its K/V (and the method its per-request state). Nothing is read back:
        the caller reads the tokens. ``feed``: the step in flight's tokens, for the requests whose last
        token is pending."""
        B = len(seqs)
        key = self.step_key(seqs)
        b = self._bucket(self.bucket_size(B), key)
        self._write_inputs(b, seqs)
        if feed is not None:
            feed.write(b.ids, seqs)
        if self.use_cuda_graphs:
            if b.plans is not None:
                b.plans.variant = key[1]
            b.graphs[key].replay()
            tokens, logits = b.outputs[key]
            logits = logits[:B].clone()
        else:
            tokens, logits = self._forward(b, *key)
            logits = logits[:B]
        tokens = tokens[:B].clone()         # the static output is rewritten by the bucket's next replay
        self._step_done(b, seqs, key[1])
        return tokens, logits

    def _step_done(self, b: DecodeBucket, seqs, method_key: Hashable) -> None:
        """The method's host hooks after a step of ``seqs`` in bucket ``b`` (its decode step, or a packed call's
        decode tail): ``decoded``, then ``decode_step_done`` with the plans' ``variant`` set to the step's
        ``method_key`` (its ``decode_graph_key``)."""
        if b.plans is not None:
            b.plans.variant = method_key
        self.ex.method.decoded([s.slot for s in seqs], [s.num_tokens - 1 for s in seqs])
        self.ex.method.decode_step_done(b.plans, len(seqs))
