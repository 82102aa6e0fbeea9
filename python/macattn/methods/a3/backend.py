"""A3 KV fusion (docs/spec.md §4) as an ``AttentionMethod``: it changes how a request's prompt KV is
built — the chunks' K/V reused from the chunk store, a question-aware share recomputed — not the
decode, which is the engine's attention method. ``prefill_request`` runs for requests that carry
a chunked prompt (``seq.rag = (RagPrompt, A3Config, store)``), through the executor's
``PrefillIO``: fuse the prefix, write it to the request's paged KV rows, then run the question as
a continued prefill (so MAC seeds the request's rings from the question tokens)."""
from __future__ import annotations

from typing import ClassVar

import torch

from macattn.methods.a3.config import A3Config, FusionMethod
from macattn.methods.base import AttentionMethod, Capabilities

__all__ = ["A3Prefill"]


class A3Prefill(AttentionMethod):
    name: ClassVar[str] = "a3"
    config_type: ClassVar[type] = A3Config
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=True, prefill_only=True)

    def prefill_request(self, io, seq) -> torch.Tensor:
        prompt, config, store = seq.rag
        if config.method is FusionMethod.FULL_RECOMPUTE:
            return io.prefill_plain()
        if io.has_fastmka:
            raise NotImplementedError("A3 fused prefill is not supported on FastMKA-patched models")
        k, v, stats = io.fuse_prefix(prompt, config, store)
        io.write_kv(0, k, v)
        logits = io.continue_prefill(prompt.question, prompt.num_prefix)
        seq.rag_stats = dict(stats)
        return logits
