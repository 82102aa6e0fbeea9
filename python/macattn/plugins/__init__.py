"""The kernel library: one folder per op with its Triton kernel(s), launcher and TensorRT plugin
definition, plus the launch plans and the AOT images.

* ``mac_match/``  — ``macattn::mac_match`` (nearest ring query, threshold, validity); ``two_stage.py``:
  the two-stage match over a sketch ring (not in the decode plan yet).
* ``mac_attend/`` — ``macattn::mac_attend`` (split-KV attention, merge, ring append).
* ``route_fused/`` — ``macattn::route_fused_attention`` (FastMKA decode step).
* ``retrieval_completion/`` — ``macattn::retrieval_completion`` (Top-k + completion decode step)
  and ``macattn::completion_cache`` (its prefill-time cache).
* ``page_select/`` — the offloaded decode's page selector (Quest bounds per KV head, radix select).
* ``decode_step/``, ``fp8_linear/`` — the decode step's norm / RoPE + KV append / SiLU·mul kernels and
  the weight-only FP8 GEMV.
* ``decode_plan.MacDecodePlan`` — plan once per batch bucket, run per step (fused MAC step and
  the full-attention path), CUDA-graph capturable (FlashInfer's ``plan()/run()``).

Importing this package has no side effects: ``macattn.methods.kernels.register_kernels()``
registers the launchers as the ops' CUDA kernels. ``HAVE_TRITON`` says whether triton imports.
"""
from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

__all__ = ["HAVE_TRITON"]
