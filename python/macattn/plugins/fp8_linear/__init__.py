"""Weight-only FP8 (E4M3, one fp32 scale per output channel) linear layers for decode.

* ``reference.py`` — plain torch, any device: ``quantize_fp8_weight``, ``dequantize_fp8_weight``,
  ``fp8_linear_reference`` (the product in fp32).
* ``kernel.py`` — the Triton GEMV for 1-16 rows of x (needs triton).
* ``op.py`` — ``fp8_linear``: the GEMV on CUDA for up to 16 rows, the dequantised ``F.linear``
  otherwise (CPU, prefill).
* ``checks.py`` — the input contract shared by the reference and the launcher.

Importing this package needs only torch.
"""
from __future__ import annotations

from .op import MAX_GEMV_ROWS, fp8_linear
from .reference import FP8_MAX, dequantize_fp8_weight, fp8_linear_reference, quantize_fp8_weight

__all__ = ["quantize_fp8_weight", "dequantize_fp8_weight", "fp8_linear_reference", "fp8_linear", "FP8_MAX",
           "MAX_GEMV_ROWS"]
