"""Full attention as an ``AttentionMethod``: prefill is the model's own attention; decode is
softmax attention of each request's token over ``[0, m]`` — the plain-torch reference on the
CPU, the bucket's plans over the paged pool under the runtime on CUDA (the default ``decode_plans``,
``FullDecodePlans.attend_full``: ``MacDecodePlan.run_full``, the same split-KV kernel MAC's misses run)."""
from __future__ import annotations

from typing import ClassVar

import torch

from macattn.core.attention import check_no_padding, full_attention_reference
from macattn.methods.base import AttentionMethod, Capabilities
from macattn.methods.full.config import FullConfig

__all__ = ["FullAttention"]


class FullAttention(AttentionMethod):
    name: ClassVar[str] = "full"
    config_type: ClassVar[type] = FullConfig
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=True, cuda_graphs=True, head_sharded=True,
                                                        prefix_caching=True)

    def decode_in_full(self, positions) -> bool:
        return True

    def decode(self, module, layer, query, key, value, q_pre, attention_mask, scale, step, fallback, **kwargs):
        B = query.shape[0]
        if step.positions is None:
            check_no_padding(attention_mask)
            positions = torch.full((B,), key.shape[2] - 1, dtype=torch.int64, device=query.device)
        else:
            positions = step.positions.to(device=query.device, dtype=torch.int64)
        q = query[:, :, 0]
        if step.paged is not None:
            return step.paged.attend_full(q, key, value, positions).unsqueeze(1)
        return full_attention_reference(q, key, value, positions, scale=scale).to(query.dtype).unsqueeze(1)
