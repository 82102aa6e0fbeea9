"""Runs the patched transformers model over the paged KV cache: prefill one request,
decode a batch of requests of different lengths.

The model is patched in place (``macattn.builder.patch``) and its MAC context is put in
runtime mode: the runtime sets ``ctx.slots`` (ring rows) and, for decode, ``ctx.positions``
(per-request ``m``) before each call. Per-request RoPE comes from explicit
``position_ids``; K/V go through ``PrefillView`` / ``DecodeView`` into the paged pool.
On the CPU the MAC ops run their reference implementation; on CUDA, decode goes through
``PagedDecoder`` (the Triton plan over the paged pool, CUDA graphs per batch bucket), which
pads batches with a scratch ring slot and a scratch KV block reserved here.
"""
from __future__ import annotations

import torch

from macattn.builder.patch import patch_model
from macattn.config import MacConfig

from .block_manager import BlockManager
from .config import RuntimeConfig
from .kv_cache import DecodeView, PagedKVCache, PrefillView
from .sequence import Sequence

__all__ = ["ModelExecutor"]


class ModelExecutor:
    """model: a LLaMA / Qwen2 / Mistral ``*ForCausalLM`` (patched here, in place)."""

    def __init__(self, model, mac_config: MacConfig, config: RuntimeConfig) -> None:
        hf = model.config
        self.config = config
        self.device = torch.device(config.device)
        self.model = model.to(self.device).eval()
        gpu = self.device.type == "cuda"
        # on CUDA one extra ring slot and KV block are the padding rows' scratch (never a request's)
        self.ctx = patch_model(self.model, mac_config, num_slots=config.max_batch_size + gpu)
        self.ctx.runtime_slots = True
        self.scratch_slot = self.ctx.state.acquire() if gpu else None
        self.scratch_block = config.num_blocks if gpu else None
        self.num_layers = hf.num_hidden_layers
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.kv = PagedKVCache(num_layers=self.num_layers, num_blocks=config.num_blocks + gpu,
                               block_size=config.block_size, num_kv_heads=hf.num_key_value_heads,
                               head_dim=self.head_dim, dtype=self.dtype, device=self.device)
        # FastMKA (``macattn.mka_patch.patch_mka`` applied before): its per-request session summary
        # lives in runtime-owned slots, the rows of the MAC rings (registered with SlotStates)
        self.mka_ctx = getattr(self.model, "_mka_ctx", None)
        self.mka_state = None
        if self.mka_ctx is not None:
            from .mka_state import MkaState

            self.mka_state = MkaState.allocate(num_layers=self.num_layers, num_slots=self.ctx.state.num_slots,
                                               hidden_size=hf.hidden_size, device=self.device)
            self.mka_ctx.state = self.mka_state
        self.paged = None
        if gpu:
            from .paged_decode import PagedDecoder

            self.paged = PagedDecoder(self, use_cuda_graphs=config.use_cuda_graphs)

    def set_slots(self, slots: torch.Tensor | None) -> None:
        """The state rows of the requests in the next call (MAC rings and, if patched, FastMKA)."""
        self.ctx.slots = slots
        if self.mka_ctx is not None:
            self.mka_ctx.slots = None if slots is None else slots.to(self.device)

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Prefill ``seq``: an A3 fused prefill when it carries ``seq.rag``
        (``macattn.runtime.a3_assembly.runtime_prefill``), else ``prefill_plain``."""
        if seq.rag is not None:
            from .a3_assembly import runtime_prefill

            return runtime_prefill(self, seq)
        return self.prefill_plain(seq)

    @torch.inference_mode()
    def prefill_plain(self, seq: Sequence) -> torch.Tensor:
        """Run ``seq.prompt`` (positions ``0 .. L-1``), write its K/V, seed its rings.
        Returns the last position's logits ``[V]``."""
        L = len(seq.prompt)
        ids = torch.tensor([seq.prompt], dtype=torch.int64, device=self.device)
        pos = torch.arange(L, device=self.device).unsqueeze(0)
        mask = torch.ones(L, L, dtype=torch.bool, device=self.device).tril().view(1, 1, L, L)
        view = PrefillView(self.kv, self.blocks.rows(seq, 0, L))
        self.set_slots(torch.tensor([seq.slot], dtype=torch.int64))
        self.ctx.positions = None
        try:
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=view,
                             use_cache=True, logits_to_keep=1)
        finally:
            self.set_slots(None)
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each request's last generated token at its position ``m = num_tokens - 1``.
        Returns logits ``[B, V]``."""
        if self.paged is not None:
            return self.paged.decode(seqs)
        B = len(seqs)
        m = [s.num_tokens - 1 for s in seqs]
        ids = torch.tensor([[s.output[-1]] for s in seqs], dtype=torch.int64, device=self.device)
        positions = torch.tensor(m, dtype=torch.int64, device=self.device)
        lengths = [x + 1 for x in m]
        gather = self.blocks.gather_rows(seqs, lengths)                         # [B, T]
        write = torch.stack([self.blocks.rows(s, x, x + 1)[0] for s, x in zip(seqs, m)])
        T = gather.shape[1]
        mask = (torch.arange(T, device=self.device).view(1, T) <= positions.view(B, 1)).view(B, 1, 1, T)
        self.set_slots(torch.tensor([s.slot for s in seqs], dtype=torch.int64))
        self.ctx.positions = positions
        try:
            out = self.model(input_ids=ids, position_ids=positions.view(B, 1), attention_mask=mask,
                             past_key_values=DecodeView(self.kv, write, gather), use_cache=True,
                             logits_to_keep=1)
        finally:
            self.set_slots(None)
            self.ctx.positions = None
        return out.logits[:, -1]
