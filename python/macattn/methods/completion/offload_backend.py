"""Retrieval-completion with the prefill KV offloaded to host memory, as an ``AttentionMethod``
(``completion_offload``; ``LLM(method="completion", kv_offload="host")``): the request's tiers are an
``OffloadedKV`` (``offload.py``) and the method keeps no full KV rows anywhere on the device.

* prefill (one request): exact causal attention over the prompt; per layer the post-RoPE K/V and
  ``log φ_k`` go to the host pages, sinks and tail to the device anchors, the Quest bounds and the
  completion cache (``macattn::completion_cache``) to the device;
* decode: the token's K/V join the anchors, then ``OffloadedKV.decode`` (page selector, hot-page LRU,
  page gather from the host, exact + completion under one normalisation). No host synchronisation on
  CUDA: the runtime captures the whole step (``decode_capturable``);
* persisted prefixes (``prefill_request``): with a prefix ``store`` (``macattn.runtime.chunk_store.
  prefix_store``: A3's chunk store with its model identity, token ids, shapes and sha256 checks), a
  request that asks to reuse its prompt's KV (``Sequence.reuse_prefix``) loads it instead of running the
  prompt through the model — only its last token runs, exactly attending over the loaded prefix — and a
  prompt not found is prefilled and persisted. A tampered entry raises ``ChunkStoreIntegrityError``.

Requests are limited to ``OffloadConfig.max_prefill`` prompt and ``max_generated`` new tokens
(``check_request``, before anything is queued).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from macattn.methods.base import AttentionMethod, Capabilities, ModelDims
from macattn.methods.completion import ops  # noqa: F401  (defines the torch ops)
from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.feature_maps import CompletionFeatureMaps, fitted_maps
from macattn.methods.completion.offload import OffloadConfig, OffloadedKV

__all__ = ["OffloadedCompletion"]


class OffloadedCompletion(AttentionMethod):
    """maps: the distilled ``CompletionFeatureMaps``; max_seq_len: the runtime's (prompt + generated);
    offload: the tiers' sizes (default: ``max_prefill = max_seq_len - 1``, ``max_generated =
    min(1024, max_seq_len - 1)``); store: a prefix store (``prefix_store``) or None. ``config`` must use
    ``selector="quest"`` with a fixed ``top_k``."""

    name: ClassVar[str] = "completion_offload"
    config_type: ClassVar[type] = CompletionConfig
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=False, cuda_graphs=True)

    def __init__(self, config: CompletionConfig, dims: ModelDims, *, num_slots: int, maps: CompletionFeatureMaps,
                 max_seq_len: int, offload: OffloadConfig | None = None, store=None) -> None:
        super().__init__(config, dims, num_slots=num_slots)
        self.maps = fitted_maps(maps, dims)
        spec = self.maps.spec
        if offload is None:
            offload = OffloadConfig(max_prefill=max_seq_len - 1, max_generated=min(1024, max_seq_len - 1))
        if not isinstance(offload, OffloadConfig):
            raise TypeError(f"offload must be an OffloadConfig, got {type(offload).__name__}")
        self.offload = offload
        self.state = OffloadedKV.allocate(config, offload, num_layers=dims.num_layers, num_slots=num_slots,
                                          num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim,
                                          feature_dim=spec.feature_dim, dtype=dims.dtype, device=dims.device)
        self.store = store
        self.reused: set[int] = set()        # slots whose request's prompt KV came from the store
        self._exact_last: int | None = None  # slot whose last prompt token runs exactly over a loaded prefix

    def slot_states(self):
        return {"completion_offload": self.state}

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        off = self.offload
        if prompt_len > off.max_prefill:
            raise ValueError(f"input_ids too long for the offloaded tiers: {prompt_len} prompt tokens > "
                             f"max_prefill={off.max_prefill}")
        if max_new_tokens > off.max_generated:
            raise ValueError(f"max_new_tokens={max_new_tokens} > the offloaded tiers' max_generated={off.max_generated}")

    def _slots(self, step) -> torch.Tensor:
        if step.slots is None:
            raise RuntimeError("the offloaded retrieval-completion runs under the engine (StepContext.slots)")
        return step.slots.to(self.state.seq_len.device)

    # --- prefill ------------------------------------------------------------------------------
    def _admit(self, layer: int, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Layer ``layer`` of request ``slot`` from its prompt ``key / value [Hkv, N, d]`` (post-RoPE)."""
        cfg = self.config
        N = key.shape[1]
        with torch.no_grad():
            lpk = self.maps.log_phi_k(layer, key.transpose(0, 1)).transpose(0, 1)        # [Hkv, N, F]
        a, b, c = torch.ops.macattn.completion_cache(lpk[None], value[None], torch.tensor([N], device=lpk.device),
                                                     cfg.n_sink, cfg.n_tail)
        self.state.admit_layer(layer, slot, key, value, lpk, (a[0], b[0], c[0]))

    def prefill(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        slots = self._slots(step)
        if slots.numel() != 1 or key.shape[2] != query.shape[2]:
            raise ValueError("the offloaded retrieval-completion prefills one fresh request per call")
        if layer == 0:
            self.reused.discard(int(slots[0]))
        self._admit(layer, int(slots[0]), key[0], value[0])
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out.transpose(1, 2)

    def prefill_request(self, io, seq) -> torch.Tensor | None:
        """Reuse or persist ``seq``'s prompt KV through ``store`` (module docstring); None = the ordinary prefill
        (no store, or a request that does not ask for reuse)."""
        if self.store is None or not getattr(seq, "reuse_prefix", False):
            return None
        st, slot, N = self.state, seq.slot, len(seq.prompt)
        got = self.store.get(seq.prompt, self.dims.dtype)
        if got is None:                              # prefill, then persist from the host pages
            logits = io.prefill_plain()
            if self.dims.device.type == "cuda":      # the pages' device -> host copies are asynchronous
                torch.cuda.current_stream(self.dims.device).synchronize()
            unpaged = lambda x: x[slot].flatten(2, 3)[:, :, :N].transpose(1, 2)  # noqa: E731  [L, N, Hkv, d]
            self.store.put(seq.prompt, unpaged(st.host_k), unpaged(st.host_v))
            return logits
        k, v = got                                   # [L, N, Hkv, d]
        dev = self.dims.device
        for layer in range(self.dims.num_layers):
            self._admit(layer, slot, k[layer].transpose(0, 1).to(dev), v[layer].transpose(0, 1).to(dev))
        self.reused.add(slot)
        self._exact_last = slot
        try:                                         # the last prompt token, exact over the loaded prefix
            return io.run_last_prompt_token()
        finally:
            self._exact_last = None

    # --- decode ---------------------------------------------------------------------------------
    def decode_capturable(self) -> bool:
        return self.state.use_kernels

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        st = self.state
        slots = self._slots(step)
        B = query.shape[0]
        if step.positions is None or step.positions.shape != (B,):
            raise ValueError(f"the offloaded retrieval-completion decode needs StepContext.positions [B]={B}")
        pos = step.positions.to(slots.device)
        if self._exact_last is not None:
            return self._exact_over_prefix(layer, query, scale)
        rows = torch.arange(B, device=query.device)
        st.append(layer, slots, pos, key[rows, :, 0], value[rows, :, 0])
        S = st.num_slots
        lens = torch.ones(S, dtype=torch.int64, device=pos.device)
        lens[slots] = pos + 1
        npf = torch.zeros_like(lens)
        npf[slots] = st.n_prefill[slots]
        q = query[:, :, 0]
        q_all = q.new_zeros((S,) + tuple(q.shape[1:]))
        q_all[slots] = q
        with torch.no_grad():
            lpq = self.maps.log_phi_q(layer, q)
        lpq_all = lpq.new_zeros((S,) + tuple(lpq.shape[1:]))
        lpq_all[slots] = lpq
        return st.decode(layer, q_all, lpq_all, lens, npf, scale)[slots].unsqueeze(1)

    def _exact_over_prefix(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Exact attention of the last prompt token over the loaded prompt (its host pages of ``layer``)."""
        st, slot = self.state, self._exact_last
        N = int(st.n_prefill[slot])
        dev = query.device
        k = st.host_k[slot, layer].flatten(1, 2)[:, :N].to(dev, query.dtype)[None]
        v = st.host_v[slot, layer].flatten(1, 2)[:, :N].to(dev, query.dtype)[None]
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)

    def request_metrics(self, slot: int) -> dict[str, float]:
        st = self.state
        page_bytes = st.page_size * (2 * st.anchor_k[0].shape[3] * st.anchor_k[0].element_size()
                                     + st.cache_lpk[0].shape[3] * 4)
        fetched = int(st.misses[slot]) + int(st.prefetched[slot])
        return {"offload_hit_rate": st.hit_rate(slot), "offload_bytes_fetched": float(fetched * page_bytes),
                "prefix_reused": float(slot in self.reused)}
