"""Register the Triton launchers as the CUDA kernels of the ``macattn`` ops.

Imported by ``macattn.plugins`` only when triton is importable. The reference in
``macattn.methods.mac.ops`` stays the implementation for every other device.
"""
from __future__ import annotations

import torch

import macattn.methods.mac.ops  # noqa: F401  (defines the ops)
import macattn.methods.completion.ops  # noqa: F401  (defines macattn::retrieval_completion / completion_cache)
import macattn.methods.mka.ops  # noqa: F401  (defines macattn::route_fused_attention)

from .mac_attend.op import mac_attend_triton
from .mac_match.op import mac_match_triton
from .retrieval_completion.op import completion_cache_triton, retrieval_completion_triton
from .route_fused.op import route_fused_attention_triton

__all__ = ["REGISTERED"]

torch.library.register_kernel("macattn::mac_match", "cuda", mac_match_triton)
torch.library.register_kernel("macattn::mac_attend", "cuda", mac_attend_triton)
torch.library.register_kernel("macattn::route_fused_attention", "cuda", route_fused_attention_triton)
torch.library.register_kernel("macattn::retrieval_completion", "cuda", retrieval_completion_triton)
torch.library.register_kernel("macattn::completion_cache", "cuda", completion_cache_triton)

REGISTERED = ("macattn::mac_match", "macattn::mac_attend", "macattn::route_fused_attention",
              "macattn::retrieval_completion", "macattn::completion_cache")
