"""The kernel library: one folder per op with its Triton kernel(s), launcher and TensorRT plugin
definition, plus the launch plans and the AOT images.

* ``mac/`` — ``macattn::mac_match`` (nearest ring query, threshold, validity; ``two_stage.py``: the
  two-stage match over a sketch ring) and ``macattn::mac_attend`` (split-KV attention, merge, ring
  append); ``mac/decode_plan.MacDecodePlan`` plans once per batch bucket and runs per step (fused MAC
  step and the full-attention path), CUDA-graph capturable (FlashInfer's ``plan()/run()``).
* ``route_fused/`` — ``macattn::route_fused_attention`` (FastMKA decode step).
* ``retrieval_completion/`` — ``macattn::retrieval_completion`` (Top-k + completion decode step)
  and ``macattn::completion_cache`` (its prefill-time cache).
* ``page_select/`` — the offloaded decode's page selector (Quest bounds per KV head, radix select).
* ``page_fetch/`` — the offloaded decode's page gather from pinned host memory.
* ``decode_step/``, ``fp8_linear/`` — the decode step's norm / RoPE + KV append / SiLU·mul kernels and
  the weight-only FP8 GEMV.

The op families import none of each other (an import-linter contract), except the page variant of
``retrieval_completion`` running ``page_select`` first; shared pieces sit beside them:
``triton_util``, ``triton_softmax``, ``aot`` (AOT images), ``trt_compat`` / ``tensorrt_plugins`` (the
TensorRT plugin registry), ``cuda_kernels`` (the launchers registered as the ops' CUDA kernels).

Importing this package has no side effects: ``macattn.methods.kernels.register_kernels()``
registers the launchers as the ops' CUDA kernels (``cuda_kernels``). ``HAVE_TRITON`` says whether triton imports.
"""
from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

__all__ = ["HAVE_TRITON"]
