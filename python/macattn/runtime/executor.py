"""Runs the bound transformers model over the paged KV cache: packed prefill of several requests'
prompt chunks in one call, decode of a batch of requests of different lengths.

The model is bound in place to the engine's ``AttentionMethod`` (``macattn.models.attention``).
Every model call runs inside ``ModelBinding.step(StepContext(...))`` — the one place the
per-call metadata (state rows, per-request positions, the decode bucket's plans, the packed
prefill's ``RaggedPrefill``) is set. Per-request RoPE comes from explicit ``position_ids``.
Prefill (``prefill_chunks``): the chunks' tokens run back to back as one row, their K/V go to their
pool rows (``PrefillView``) and each attends causally to its own request's positions through the plan
(``macattn.core.ragged``: SDPA's fused kernels, no masks), the method seeding each request's state.
On CUDA, decode goes through ``CudaDecoder`` (the whole step per batch bucket, the Triton plans over
the paged pool, CUDA graphs), which pads batches with a scratch state row and, over the paged pool, a
scratch KV block reserved here.

A step whose decode rows attend in full (``AttentionMethod.decode_in_full``: MAC below ``min_context`` or off, the
full method) beside prompt chunks runs as one model call (``fuses`` / ``mixed_step``): the rows go after the chunks'
tokens as the packed call's decode tail (``core.ragged.DecodeTail``), attending over the paged pool through the
decode bucket's plans (``DecodePlans.attend_full``) on CUDA (``CudaDecoder.tail``), the plain-torch reference
elsewhere; so the streams decoding beside a prompt pay no decode forward of their own (``benchmarks/notes/serving.md``,
eighth pass).

Sampling (``sample``, and inside the GPU decode step) reads and updates the penalties' per-slot token
counts (``TokenCounts``, a per-slot state registered with the slots). A request with
``prompt_logprobs`` gets the logits of every position of its packed chunks (``logits_at``), reduced
per chunk to the log-probability of each next prompt token and the top-k (``Sequence.prompt_logprobs``).

``PrefillIO`` is what a whole-request prefill (A3's fused prefix, a prefix-store load) may do with a
request: write its prompt K/V rows and run a continued prefill — nothing else of the executor.
"""
from __future__ import annotations

from typing import Callable

import torch

from macattn.core.attention import full_attention_reference
from macattn.core.ragged import (DecodeTail, PrefillSegment, RaggedPrefill, continued_cudnn_shapes,
                                 prewarm_cudnn_plans)
from macattn.methods.base import AttentionMethod, StepContext
from macattn.methods.registry import build_method
from macattn.models.attention import bind, unbind
from macattn.models.fused import FusedForward
from macattn.models.transformers_api import CACHE_KWARG

from macattn.runtime.block_manager import BlockManager
from macattn.runtime.config import CUDA_CHUNK_QUANTUM, RuntimeConfig, quantized_chunk
from macattn.runtime.in_flight import TokenFeed
from macattn.runtime.kv_cache import DecodeView, PagedKVCache, PrefillView
from macattn.runtime.prefill_graphs import PrefillGraphs, graph_buckets
from macattn.runtime.prefix_cache import cache_salt
from macattn.runtime.sampling import SamplerVariant, SamplingBatch, SamplingRow, TokenCounts, sample_tokens
from macattn.runtime.sequence import PrefillChunk, Sequence

__all__ = ["ModelExecutor", "PrefillIO"]

_LOGPROB_ROWS = 256          # prompt positions reduced to log-probabilities at a time (bounds the fp32 copy)


class ModelExecutor:
    """model: a LLaMA / Qwen2 / Mistral ``*ForCausalLM`` (bound here, in place, to ``method``,
    whose state has ``max_batch_size`` rows plus, on CUDA, one scratch row)."""

    def __init__(self, model, method_factory, config: RuntimeConfig) -> None:
        hf = model.config
        self.config = config
        self.device = torch.device(config.device)
        self.model = model.to(self.device).eval()
        gpu = self.device.type == "cuda"
        if gpu:
            from macattn.methods.kernels import register_kernels

            register_kernels()
        self.method: AttentionMethod = method_factory(config.max_batch_size + gpu)
        self.binding = bind(self.model, self.method)
        try:
            self._build(hf, gpu)
        except BaseException:
            unbind(self.model)       # a failed construction leaves the model bound to nothing
            raise

    def _build(self, hf, gpu: bool) -> None:
        config = self.config
        # FastMKA (``macattn.models.mka.patch_mka`` applied before) composes with the method: its
        # per-request session summary lives in runtime-owned rows (the same slots); it computes K/V
        # through its own modules, so such a model runs its transformers forward
        self.mka_ctx = getattr(self.model, "_mka_ctx", None)
        if self.mka_ctx is not None and config.quantization is not None:
            raise ValueError(f"quantization={config.quantization!r} is not available for FastMKA-patched models")
        self.fused = (FusedForward(self.model, config.quantization)
                      if config.fused_weights and self.mka_ctx is None else None)
        self.num_layers = hf.num_hidden_layers
        self.head_dim = self.method.dims.head_dim
        self.dtype = self.method.dims.dtype
        self.paged_kv = self.method.capabilities.paged_kv   # False: the method's state is the KV cache
        self.prefix_caching = self._prefix_caching(config.enable_prefix_caching)
        salt = None if not self.prefix_caching else cache_salt(
            type(self.model).__name__, getattr(hf, "_name_or_path", ""), str(self.dtype), config.block_size,
            config.fused_weights, config.quantization, self.method.name, repr(self.method.config))
        self.blocks = BlockManager(config.num_blocks, config.block_size, salt=salt)
        self.kv = None if not self.paged_kv else PagedKVCache(num_layers=self.num_layers, num_blocks=config.num_blocks + gpu,
                               block_size=config.block_size, num_kv_heads=hf.num_key_value_heads,
                               head_dim=self.head_dim, dtype=self.dtype, device=self.device)
        self.mka = None
        self._mka_use_op = None
        if self.mka_ctx is not None:
            self.mka = build_method("mka", self.method.dims, num_slots=self.num_slots, config=self.mka_ctx.config)
            self.mka_ctx.bind_runtime(self.mka.state, self.binding)
            if gpu and not self.mka_ctx.config.l3 and self.dtype in (torch.float32, torch.float16, torch.bfloat16):
                # a decode step's routing, summary and K/V through the fused op (its Triton kernels on CUDA), not
                # the modules' torch ops plus the model's own K/V projections; restored by close()
                self._mka_use_op, self.mka_ctx.use_op = self.mka_ctx.use_op, True
        # A3's fused prefill: the strategy for requests that carry a chunked prompt (``seq.rag``)
        self.a3 = build_method("a3", self.method.dims, num_slots=self.num_slots) if self.paged_kv else None
        self.scratch_slot = None
        self.scratch_block = config.num_blocks if gpu and self.paged_kv else None
        self.vocab_size = hf.vocab_size
        self.token_counts = TokenCounts(self.num_slots, hf.vocab_size, self.device)
        self.decoder = None
        if gpu:
            from macattn.runtime.cuda_decode import CudaDecoder

            self.decoder = CudaDecoder(self, use_cuda_graphs=config.use_cuda_graphs)
        self.prefill_graphs = None
        if (gpu and config.use_cuda_graphs and self.fused is not None and self.paged_kv and not self.fused.sharded
                and self.kv.k[0].dtype == self.dtype):     # the fused RoPE + append writes the model's dtype
            self.prefill_graphs = PrefillGraphs(self.fused, self.kv, pad_row=self.scratch_block * config.block_size,
                                                needs_q_pre=self.method.capabilities.needs_pre_rope_query,
                                                buckets=graph_buckets(config.max_batch_size))

    def _prefix_caching(self, asked: bool | None) -> bool:
        """Whether prefix caching runs (``RuntimeConfig.enable_prefix_caching``: None = where supported);
        ``ValueError`` naming what refuses it when it is asked for."""
        if asked is False:
            return False
        why = (f"method {self.method.name!r} does not support it (Capabilities.prefix_caching: its per-request "
               "state cannot be rebuilt from cached KV blocks)" if not self.method.capabilities.prefix_caching
               else f"method {self.method.name!r} keeps its own KV, not the paged pool" if not self.paged_kv
               else "the model is FastMKA-patched (its session summary runs along the whole prompt)"
               if self.mka_ctx is not None else None)
        if why is not None and asked:
            raise ValueError(f"enable_prefix_caching=True is not available: {why}; pass False or None")
        return why is None

    def prefix_recompute_tokens(self, prompt_len: int) -> int:
        """Tokens at the end of a ``prompt_len``-token prompt that a prefix-cache hit still prefills: at least 1
        (the first token's logits), at least the method's ``prefix_recompute_tokens(prompt_len)``."""
        return max(1, self.method.prefix_recompute_tokens(prompt_len))

    @property
    def num_slots(self) -> int:
        return self.method.num_slots

    def prewarm_graphs(self) -> dict[str, list]:
        """Capture every CUDA graph the engine would capture on first use — each decode bucket's greedy step and
        each prefill bucket's pieces — and build cuDNN's plans for the continued-chunk shapes long prompts meet
        (``core.ragged.continued_cudnn_shapes`` of the quantized chunk lengths), so no request pays a capture or
        a plan build. Returns the sizes captured per kind and the ``"QxS"`` plan shapes."""
        decode = self.decoder.prewarm() if self.decoder is not None else []
        prefill = self.prefill_graphs.prewarm() if self.prefill_graphs is not None else []
        plans = []
        cfg = self.config
        if self.device.type == "cuda" and self.paged_kv and cfg.max_num_batched_tokens is not None:
            chunks = {quantized_chunk(cfg.max_num_batched_tokens - 1, self.chunk_quantum),
                      quantized_chunk(cfg.max_prefill_tokens, self.chunk_quantum)}
            dims = self.method.dims
            plans = prewarm_cudnn_plans(continued_cudnn_shapes(chunks, cfg.max_seq_len), dims.num_q_heads,
                                        dims.num_kv_heads, dims.head_dim, self.dtype, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"decode": decode, "prefill": prefill, "cudnn_plans": [f"{q}x{s}" for q, s in plans]}

    @property
    def chunk_quantum(self) -> int:
        """A prompt chunk that leaves part of its prompt is a multiple of this many tokens (the scheduler's
        ``chunk_quantum``): ``config.CUDA_CHUNK_QUANTUM`` on CUDA, where cuDNN plans per shape; 1 elsewhere."""
        return CUDA_CHUNK_QUANTUM if self.device.type == "cuda" else 1

    def close(self) -> None:
        """Release the device memory this executor allocated: the KV pool, the fused weights, the decode
        buckets and the prefill pieces with their CUDA graphs, the sampler's counts (the method's state goes with
        the model's binding, ``unbind``), and gives a FastMKA context back its ``use_op``. It runs nothing after; a
        reference to it left anywhere then holds no memory."""
        if getattr(self, "_mka_use_op", None) is not None:
            self.mka_ctx.use_op, self._mka_use_op = self._mka_use_op, None
        self.kv = self.fused = self.decoder = self.prefill_graphs = self.token_counts = self.a3 = self.mka = None

    def slot_states(self) -> dict:
        """Every per-request state to register with the slot registry: the method's, FastMKA's and the
        sampler's token counts."""
        states = dict(self.method.slot_states())
        if self.mka is not None:
            states.update(self.mka.slot_states())
        states["sampler_token_counts"] = self.token_counts
        return states

    def request_metrics(self, slot: int) -> dict[str, float]:
        """The method's figures of the request in ``slot`` (read before the slot is reset)."""
        return self.method.request_metrics(slot)

    def reserve_scratch(self, slot: int) -> None:
        """The padding rows' state row on CUDA (taken from the slot registry by the engine)."""
        self.scratch_slot = slot

    def run_model(self, ids: torch.Tensor, positions: torch.Tensor, mask=None, past_key_values=None,
                  logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` of each row's last position for ``ids [B, T]`` at ``positions [B, T]``, or with
        ``logits_at [n]`` (indices into the ``B * T`` tokens) the logits ``[n, V]`` of those tokens: the
        fused forward (``RuntimeConfig.fused_weights``) or the model's own."""
        if self.fused is not None:
            return self.fused(ids, positions, mask, past_key_values, logits_at=logits_at)
        if mask is None and isinstance(past_key_values, PrefillView):
            # transformers takes a 4-D mask as given: a placeholder skips building an N x N mask that the
            # packed plan (which masks by segment) would ignore
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **{CACHE_KWARG: past_key_values},
                         use_cache=past_key_values is not None,
                         logits_to_keep=1 if logits_at is None else logits_at).logits
        return out[:, -1] if logits_at is None else out.reshape(-1, out.shape[-1])

    def step(self, *, slots: torch.Tensor, positions: torch.Tensor | None = None, paged=None, prefill=None):
        """Context manager: the model calls inside it run with these state rows / positions / plans."""
        return self.binding.step(StepContext(slots=slots, positions=positions, paged=paged, prefill=prefill))

    def packs(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt is prefilled in packed chunks (any split, several requests per call):
        a plain prompt over the paged pool. Others (A3's chunked prompts, a prefix-store load, a method
        that keeps its own KV) are prefilled whole, one request per call, by ``prefill``."""
        return self.paged_kv and seq.rag is None and not seq.reuse_prefix

    def prefill_chunks(self, chunks: list[PrefillChunk]) -> list[torch.Tensor | None]:
        """Prefill one step's ``chunks`` (``ScheduledStep.prefills``): the packable ones in one packed
        model call (one call per request on a FastMKA-patched model, whose session summary runs along one
        request's tokens), the others whole through ``prefill``. Returns per chunk the logits ``[V]`` of
        its prompt's last position when the chunk completes the prompt, else None."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        packed = []
        for i, c in enumerate(chunks):
            if self.packs(c.seq):
                packed.append(i)
                continue
            if c.start != 0 or not c.completes_prompt:
                raise ValueError(f"request {c.seq.request_id} is prefilled whole; got positions {c.start}..{c.end}")
            out[i] = self.prefill(c.seq)
            c.seq.num_prefilled = c.end
        for group in ([packed] if self.mka_ctx is None else [[i] for i in packed]) if packed else []:
            logits, _ = self._prefill_packed([chunks[i] for i in group])
            for i, row in zip(group, logits):
                out[i] = row if chunks[i].completes_prompt else None
        return out

    def fuses(self, decodes: list[Sequence], chunks: list[PrefillChunk]) -> bool:
        """Whether a step of ``decodes`` beside prompt ``chunks`` runs as one model call (``mixed_step``): both
        present, over the paged pool, not FastMKA-patched (its summary runs along one request), every chunk packs,
        and the method's decode of the rows' positions is full attention (``AttentionMethod.decode_in_full``)."""
        return (bool(decodes) and bool(chunks) and self.paged_kv and self.mka_ctx is None
                and all(self.packs(c.seq) for c in chunks)
                and self.method.decode_in_full([s.num_tokens - 1 for s in decodes]))

    def mixed_step(self, decodes: list[Sequence], chunks: list[PrefillChunk], feed: TokenFeed | None = None
                   ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One model call for a step that ``fuses``: ``chunks`` packed as ``prefill_chunks`` packs them, each of
        ``decodes`` feeding its last generated token (from ``feed`` where pending) at ``m = num_tokens - 1`` after
        them. Returns ``(logits [B, V] of the decode rows (not sampled), per chunk what prefill_chunks returns)``."""
        if not self.fuses(decodes, chunks):
            raise ValueError("mixed_step runs a step that fuses (ModelExecutor.fuses)")
        logits, tail = self._prefill_packed(list(chunks), list(decodes), feed)
        return tail, [row if c.completes_prompt else None for c, row in zip(chunks, logits)]

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Prefill ``seq``'s whole prompt: A3's ``prefill_request`` when it carries a chunked prompt
        (``seq.rag``), the method's when it loads from a prefix store, else ``prefill_plain``."""
        if seq.sampling.prompt_logprobs is not None and (seq.rag is not None or seq.reuse_prefix):
            raise ValueError(f"request {seq.request_id}: prompt_logprobs is not available for chunked (A3) prompts "
                             "or prefix-store loads")
        if seq.rag is not None:
            if self.a3 is None:
                raise ValueError(f"chunked (A3) prompts need a method over the paged KV cache; "
                                 f"{self.method.name!r} keeps its own")
            return self.a3.prefill_request(PrefillIO(self, seq), seq)
        logits = self.method.prefill_request(PrefillIO(self, seq), seq) if seq.reuse_prefix else None
        return self.prefill_plain(seq) if logits is None else logits

    @torch.inference_mode()
    def prefill_plain(self, seq: Sequence) -> torch.Tensor:
        """Run ``seq.prompt`` (positions ``0 .. L-1``), write its K/V, seed its state.
        Returns the last position's logits ``[V]``."""
        L = len(seq.prompt)
        if not self.paged_kv:
            ids = torch.tensor([seq.prompt], dtype=torch.int64, device=self.device)
            pos = torch.arange(L, device=self.device)
            with self.step(slots=torch.tensor([seq.slot], dtype=torch.int64)):
                if seq.sampling.prompt_logprobs is None:
                    return self.run_model(ids, pos.unsqueeze(0))[0]
                logits = self.run_model(ids, pos.unsqueeze(0), logits_at=pos)
            self._prompt_logprobs(PrefillChunk(seq, 0, L), logits)
            return logits[-1]
        return self._prefill_packed([PrefillChunk(seq, 0, L)])[0][0]

    @torch.inference_mode()
    def _prefill_packed(self, chunks: list[PrefillChunk], decodes: list[Sequence] = (),
                        feed: TokenFeed | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One packed model call over ``chunks`` (``macattn.core.ragged``: their tokens back to back, K/V
        written to their pool rows, each attending causally to its own earlier positions, each request's
        state seeded) and ``decodes`` after them (a decode tail: ``mixed_step``). Returns ``(the logits [n, V] of
        each chunk's last token, the decode rows' [B, V] or None)``; sets ``num_prefilled``. A chunk of a request
        with ``prompt_logprobs`` gets the logits of all its tokens (``logits_at``), reduced to its prompt
        log-probabilities (``_prompt_logprobs``)."""
        dev = self.device
        ids, pos, write, segments, offset = [], [], [], [], 0
        at, last, spans = [], [], []        # logits rows kept; each chunk's last one; (chunk, first row)
        for c in chunks:
            seq = c.seq
            ids.extend(seq.prompt[c.start:c.end])
            pos.append(torch.arange(c.start, c.end))
            write.append(self.blocks.rows(seq, c.start, c.end))
            history = self.blocks.rows(seq, 0, c.start).to(dev) if c.start else None
            segments.append(PrefillSegment(offset, c.num_tokens, c.start, seq.slot, history, len(seq.prompt)))
            if seq.sampling.prompt_logprobs is not None:
                spans.append((c, len(at)))
                at.extend(range(offset, offset + c.num_tokens))
            else:
                at.append(offset + c.num_tokens - 1)
            last.append(len(at) - 1)
            offset += c.num_tokens
        tail = tail_ids = done = None
        if decodes:
            tail_ids, tail, done = (self.decoder.tail if self.decoder is not None else self._tail)(decodes, feed)
            for s in decodes:
                m = s.num_tokens - 1
                ids.append(0)           # the token is tail_ids' (pending on the device where async)
                pos.append(torch.tensor([m]))
                write.append(self.blocks.rows(s, m, m + 1))
            at.extend(range(offset, offset + len(decodes)))
        plan = RaggedPrefill(segments, self.kv.k, self.kv.v, tail)
        ids_t, pos_t, rows_t = torch.tensor(ids, dtype=torch.int64), torch.cat(pos), torch.cat(write)
        at_t = torch.tensor(at, dtype=torch.int64).to(dev, non_blocking=True)
        graphs = self.prefill_graphs
        with self.step(slots=torch.tensor(plan.slots, dtype=torch.int64), prefill=plan):
            if graphs is not None and ids_t.numel() <= graphs.max_tokens:
                logits = graphs.run(ids_t, pos_t, rows_t, at_t, tail_ids)
            else:
                view = PrefillView(self.kv, rows_t, cached=chunks[0].start if len(chunks) == 1 else 0)
                ids_d = ids_t.view(1, -1).to(dev, non_blocking=True)
                if tail_ids is not None:
                    ids_d[0, offset:].copy_(tail_ids)
                logits = self.run_model(ids_d, pos_t.view(1, -1).to(dev, non_blocking=True), None, view,
                                        logits_at=at_t)
        for c in chunks:
            c.seq.num_prefilled = c.end
        if done is not None:
            done()
        for c, row in spans:
            self._prompt_logprobs(c, logits[row:row + c.num_tokens])
        decoded = logits[len(at) - len(decodes):] if decodes else None
        if spans:
            return logits[torch.tensor(last, dtype=torch.int64, device=logits.device)], decoded
        return (logits[:len(chunks)] if decodes else logits), decoded

    def _tail(self, seqs: list[Sequence], feed: TokenFeed | None
              ) -> tuple[torch.Tensor, DecodeTail, Callable[[], None]]:
        """``CudaDecoder.tail`` off CUDA: each row's history gathered from the pool, the plain-torch attention
        (``full_attention_reference``, the full method's decode there)."""
        dev, B = self.device, len(seqs)
        ids = torch.tensor([s.last_token_on_host for s in seqs], dtype=torch.int64, device=dev)
        if feed is not None:
            feed.write(ids, seqs)
        m = [s.num_tokens - 1 for s in seqs]
        positions = torch.tensor(m, dtype=torch.int64, device=dev)
        gather = self.blocks.gather_rows(seqs, [x + 1 for x in m]).to(dev)          # [B, T]

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            k, v = (pool[gather].transpose(1, 2) for pool in (self.kv.k[layer], self.kv.v[layer]))   # [B, Hkv, T, d]
            return full_attention_reference(q, k, v, positions)

        def done() -> None:
            self.method.decoded([s.slot for s in seqs], m)
            self.method.decode_step_done(None, B)

        return ids, DecodeTail(B, attend), done

    @staticmethod
    def _prompt_logprobs(c: PrefillChunk, rows: torch.Tensor) -> None:
        """Extend ``c.seq.prompt_logprobs`` (``[None]`` for position 0, started by the prompt's first chunk)
        with positions ``c.start + 1 .. min(c.end, L - 1)`` from ``rows [c.num_tokens, V]``, the logits of
        positions ``c.start .. c.end - 1``: per position ``{prompt token: logprob}`` followed by the top
        ``prompt_logprobs`` tokens' (log-softmax in fp32, or fp64 for fp64 logits)."""
        seq = c.seq
        if c.start == 0:
            seq.prompt_logprobs = [None]
        k = seq.sampling.prompt_logprobs
        m = min(c.end, len(seq.prompt) - 1) - c.start
        dt = torch.promote_types(rows.dtype, torch.float32)
        for b in range(0, max(m, 0), _LOGPROB_ROWS):
            n = min(_LOGPROB_ROWS, m - b)
            lp = torch.log_softmax(rows[b:b + n].to(dt), dim=-1)
            targets = seq.prompt[c.start + 1 + b:c.start + 1 + b + n]
            mine = lp.gather(1, torch.tensor(targets, dtype=torch.int64, device=lp.device)[:, None])[:, 0].tolist()
            top_v, top_i = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else (None, None)
            top_v, top_i = (top_v.tolist(), top_i.tolist()) if k else ([[]] * n, [[]] * n)
            for t, v, tv, ti in zip(targets, mine, top_v, top_i):
                entry = {t: v}
                for i, x in zip(ti, tv):
                    entry.setdefault(i, x)
                seq.prompt_logprobs.append(entry)

    def fork_kv(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` — a fork of ``parent`` sharing its full prompt blocks (``BlockManager.allocate_fork``)
        — a copy of the K/V of the parent's partially filled last prompt block. Nothing for a method that
        keeps its own KV (its per-slot state is copied with the slot's)."""
        if not self.paged_kv:
            return
        L = len(parent.prompt)
        start = L - L % self.blocks.block_size
        if start == L:
            return
        src = self.blocks.rows(parent, start, L).to(self.device)
        dst = self.blocks.rows(child, start, L).to(self.device)
        with torch.inference_mode():
            for pool in self.kv.k + self.kv.v:
                pool.index_copy_(0, dst, pool.index_select(0, src))

    @staticmethod
    def sampling_rows(seqs: list[Sequence]) -> list[SamplingRow]:
        """``(params, seed, position of the token to generate, tokens generated)`` per request
        (``SamplingBatch.of``)."""
        return [SamplingRow(s.sampling, s.seed, s.num_tokens, s.num_generated) for s in seqs]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """``sample_on_device``'s tokens, read back."""
        return self.sample_on_device(seqs, logits).tolist()

    @torch.inference_mode()
    def sample_on_device(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Each request's next token (``[B]`` int64 on ``logits``' device, not read back) from its row of
        ``logits [B, V]`` (``runtime.sampling``). The penalties' token counts: a request's prompt is marked before
        its first token; every sampled token is counted (once the counts exist: the first request with a penalty
        allocates them)."""
        variant = SamplerVariant.of([s.sampling for s in seqs])
        counts, slots, tc = None, None, self.token_counts
        if variant.penalize:
            for s in seqs:
                if not s.num_generated and s.sampling.penalized:
                    tc.add_prompt(s.slot, s.prompt)
        if tc.allocated:
            slots = torch.tensor([s.slot for s in seqs], dtype=torch.int64).to(logits.device)
            counts = tc.rows(slots) if variant.penalize else None
        batch = SamplingBatch.of(self.sampling_rows(seqs), logits.device)
        tokens = sample_tokens(logits, batch, greedy_only=not variant.draw, counts=counts)
        if slots is not None:
            tc.record(slots, tokens)
        return tokens

    def decode_step(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor]:
        """One decode step with sampling: ``(next token per request, logits [B, V])`` (``decode_tokens``, read
        back)."""
        tokens, logits = self.decode_tokens(seqs)
        return tokens.tolist(), logits

    @torch.inference_mode()
    def decode_tokens(self, seqs: list[Sequence], feed: TokenFeed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step with sampling: ``(next token per request [B] int64 on the device, not read back;
        logits [B, V])``. On CUDA the whole step — model and sampler — is one graph replay per batch bucket.
        ``feed``: the step in flight's tokens, for the requests whose last token is pending (async scheduling)."""
        if self.decoder is not None:
            return self.decoder.step(seqs, feed)
        logits = self.decode(seqs, feed)
        return self.sample_on_device(seqs, logits), logits

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], feed: TokenFeed | None = None) -> torch.Tensor:
        """Feed each request's last generated token (from ``feed`` where it is pending) at its position
        ``m = num_tokens - 1``. Returns logits ``[B, V]``."""
        if self.decoder is not None:
            return self.decoder.step(seqs, feed)[1]
        B = len(seqs)
        m = [s.num_tokens - 1 for s in seqs]
        ids = torch.tensor([[s.last_token_on_host] for s in seqs], dtype=torch.int64, device=self.device)
        if feed is not None:
            feed.write(ids, seqs)
        positions = torch.tensor(m, dtype=torch.int64, device=self.device)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.int64)
        if not self.paged_kv:
            with self.step(slots=slots, positions=positions):
                logits = self.run_model(ids, positions.view(B, 1))
            self.method.decoded(slots.tolist(), m)
            return logits
        lengths = [x + 1 for x in m]
        gather = self.blocks.gather_rows(seqs, lengths)                         # [B, T]
        write = torch.stack([self.blocks.rows(s, x, x + 1)[0] for s, x in zip(seqs, m)])
        T = gather.shape[1]
        mask = (torch.arange(T, device=self.device).view(1, T) <= positions.view(B, 1)).view(B, 1, 1, T)
        with self.step(slots=slots, positions=positions):
            logits = self.run_model(ids, positions.view(B, 1), mask, DecodeView(self.kv, write, gather))
        self.method.decoded(slots.tolist(), m)
        return logits


class PrefillIO:
    """What a whole-request prefill may do with request ``seq`` (A3's fused prefix): write prompt
    K/V into its paged rows and run the rest of its prompt through the bound model."""

    def __init__(self, executor: ModelExecutor, seq: Sequence) -> None:
        self._ex, self._seq = executor, seq

    @property
    def model(self):
        return self._ex.model

    @property
    def device(self) -> torch.device:
        return self._ex.device

    @property
    def has_fastmka(self) -> bool:
        return self._ex.mka_ctx is not None

    @torch.inference_mode()
    def fuse_prefix(self, prompt, config, store):
        """A3's fused prefix of ``prompt`` (``macattn.runtime.a3_assembly.fuse_prefix``, chunk K/V from
        ``store``): ``(k, v, stats)`` with ``k[l], v[l]`` ``[Hkv, P, d]`` post-RoPE, ``P`` = prefix length."""
        from macattn.runtime.a3_assembly import chunk_kv_source, fuse_prefix

        model = self._ex.model
        result = fuse_prefix(model, prompt, config, chunk_kv=chunk_kv_source(model, store))
        P = prompt.num_prefix
        return ([k[0, :, :P] for k in result.cache.k], [v[0, :, :P] for v in result.cache.v], result.stats)

    def prefill_plain(self) -> torch.Tensor:
        return self._ex.prefill_plain(self._seq)

    @torch.inference_mode()
    def run_last_prompt_token(self) -> torch.Tensor:
        """Run only the prompt's last token (position ``L - 1``) as a one-token call with the request's slot
        and position, for a method that keeps its own KV and has loaded the rest. Returns logits ``[V]``."""
        ex, seq = self._ex, self._seq
        if ex.paged_kv:
            raise ValueError("run_last_prompt_token is for methods that keep their own KV")
        m = len(seq.prompt) - 1
        ids = torch.tensor([[seq.prompt[-1]]], dtype=torch.int64, device=ex.device)
        pos = torch.tensor([m], dtype=torch.int64, device=ex.device)
        with ex.step(slots=torch.tensor([seq.slot], dtype=torch.int64), positions=pos):
            return ex.run_model(ids, pos.view(1, 1))[0]

    def write_kv(self, start: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Write post-RoPE ``k[l], v[l]`` ``[Hkv, n, d]`` of every layer at prompt positions ``start .. start+n-1``."""
        n = k[0].shape[1]
        rows = self._ex.blocks.rows(self._seq, start, start + n).to(self._ex.device)
        for layer in range(self._ex.num_layers):
            self._ex.kv.k[layer][rows] = k[layer].transpose(0, 1)
            self._ex.kv.v[layer][rows] = v[layer].transpose(0, 1)

    @torch.inference_mode()
    def continue_prefill(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Run ``ids [Q]`` at positions ``start .. start+Q-1`` over the prompt K/V already written
        (the method seeds the request's state from these tokens). Returns logits ``[V]``."""
        seq = self._seq
        if seq.prompt[start:start + ids.numel()] != ids.tolist():
            raise ValueError("continue_prefill runs the request's own prompt tokens")
        return self._ex._prefill_packed([PrefillChunk(seq, start, start + ids.numel())])[0][0]
