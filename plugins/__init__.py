"""Plugin ops: one folder per op, each with its Triton kernel(s) and TensorRT plugin definition.

* ``mac_match/``  — ``macattn::mac_match`` (nearest ring query, threshold, validity).
* ``mac_attend/`` — ``macattn::mac_attend`` (split-KV attention, merge, ring append).
* ``route_fused/`` — ``macattn::route_fused_attention`` (FastMKA decode step).
* ``retrieval_completion/`` — ``macattn::retrieval_completion`` (Top-k + completion decode step)
  and ``macattn::completion_cache`` (its prefill-time cache).
* ``decode_plan.MacDecodePlan`` — plan once per batch bucket, run per step (fused MAC
  step and the full-attention path), CUDA-graph capturable.

Importing this package registers the Triton launchers as the ops' CUDA kernels when
``triton`` is importable; without triton (the CPU CI machine) it registers nothing and
``HAVE_TRITON`` is False.
"""
from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

REGISTERED: tuple[str, ...] = ()
if HAVE_TRITON:
    from .registration import REGISTERED  # noqa: F401,E402

__all__ = ["HAVE_TRITON", "REGISTERED"]
