"""Launcher of the weight-only FP8 linear: the Triton GEMV for decode, a dense GEMM otherwise."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import HAVE_TRITON
from ..aot import destination
from .checks import check_fp8_linear
from .reference import dequantize_fp8_weight

if HAVE_TRITON:
    from ..triton_util import interpreting
    from .kernel import launch_fp8_gemv

__all__ = ["fp8_linear", "MAX_GEMV_ROWS"]

MAX_GEMV_ROWS = 16   # rows of x (batch size in decode) up to which the GEMV runs
_alloc = torch.empty  # the tests swap in a NaN-filling allocator to check every output element is written


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` fp32/fp16/bf16 times the FP8 weight ``wq [N, K]`` (torch.float8_e4m3fn) with the
    per-row ``scale [N]`` fp32 (``+ bias [N]``) -> ``[..., N]`` in x's dtype; the contract of
    ``reference.fp8_linear_reference`` up to fp32 summation order.

    * CUDA (or Triton's interpreter) and at most ``MAX_GEMV_ROWS`` rows ``M = x.numel() // K``: the
      Triton GEMV (``kernel.py``), reading the FP8 weight once. No host sync; CUDA-graph capturable
      once a first call per (rows 1 / 2-16, N, K, dtypes) has run the autotuner outside the capture.
      ``wq``, ``scale`` and ``bias`` must be contiguous; x is copied only if its last dim is strided.
    * otherwise (CPU, or prefill with M > 16 rows): ``F.linear`` with the weight dequantised to x's
      dtype (``dequantize_fp8_weight``: a temporary ``[N, K]`` weight in x's dtype every call; bias
      cast to x's dtype), i.e. cuBLAS / the CPU GEMM on bf16 weights.

    ``out``: optional destination, a contiguous ``[..., N]`` tensor of x's dtype on x's device
    (``ValueError`` naming ``out`` otherwise); it is returned.
    """
    check_fp8_linear(x, wq, scale, bias)
    N, K = wq.shape
    M = x.numel() // K
    shape = (*x.shape[:-1], N)
    interpret = HAVE_TRITON and interpreting()
    if not (HAVE_TRITON and (x.is_cuda or interpret) and M <= MAX_GEMV_ROWS):
        y = F.linear(x, dequantize_fp8_weight(wq, scale, x.dtype), None if bias is None else bias.to(x.dtype))
        return y if out is None else destination(out, "out", shape, x.dtype, x.device).copy_(y)
    for name, t in (("wq", wq), ("scale", scale), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the GEMV")
    out = destination(out, "out", shape, x.dtype, x.device, _alloc)
    if M:
        x2 = x.reshape(M, K)
        launch_fp8_gemv(x2 if x2.stride(1) == 1 else x2.contiguous(), wq, scale, bias, out.view(M, N),
                        interpret=interpret)
    return out
