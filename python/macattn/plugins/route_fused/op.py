"""CUDA implementation of ``macattn::route_fused_attention`` (registered by
``macattn.methods.mka.ops.register_cuda_kernels``; the JIT impl of the ``mac::route_fused`` plugin)."""
from __future__ import annotations

import torch
import triton

from ..aot import destination
from .checks import check_route_fused_inputs
from .kernel import _project, _route_update_fuse

__all__ = ["route_fused_attention_triton"]

_alloc = torch.empty   # the tests swap in a NaN-filling allocator to check every output element is written


def route_fused_attention_triton(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv,
                                 mode: int, beta: float, *,
                                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """Same contract as ``macattn.methods.mka.ops.route_fused_attention``: ``(k [B, Nk], v [B, Nv])`` in x's
    dtype and ``lam [B, 3]`` fp32, the state rows updated in place; three launches, no host sync
    (CUDA-graph capturable). The projection reads each weight tile once per 8 requests (GEMV-bound
    decode). Values of ``slots`` are not range-checked. ``out``: optional contiguous destinations
    ``(k, v, lam)`` (TensorRT's output buffers), returned."""
    check_route_fused_inputs(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta)
    for name, t in (("state_mean", state_mean), ("state_count", state_count), ("b1", b1), ("b2", b2),
                    ("bk", bk), ("bv", bv), ("slots", slots)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    B, D = x.shape
    R = w1.shape[0]
    dev = x.device
    k_out, v_out, lam_out = (None, None, None) if out is None else out
    k = destination(k_out, "out[0] (k)", (B, wk.shape[0]), x.dtype, dev, _alloc)
    v = destination(v_out, "out[1] (v)", (B, wv.shape[0]), x.dtype, dev, _alloc)
    lam = destination(lam_out, "out[2] (lam)", (B, 3), torch.float32, dev, _alloc)
    if B == 0:
        return k, v, lam
    x, q, w1, w2, wk, wv = (t.contiguous() for t in (x, q, w1, w2, wk, wv))
    f = _alloc(B, D, dtype=torch.float32, device=dev)
    r_p = max(triton.next_power_of_2(R), 2)
    block_d = max(16, min(triton.next_power_of_2(max(D, q.shape[1])), max(16, 8192 // r_p), 256))
    _route_update_fuse[(B,)](x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, f, lam,
                             D, q.shape[1], R, float(beta), MODE=int(mode), R_P=r_p, BLOCK_D=block_d)
    block_b = min(triton.next_power_of_2(B), 8)
    for w, bias, dst in ((wk, bk, k), (wv, bv, v)):
        N = w.shape[0]
        block_n = 8
        _project[(triton.cdiv(B, block_b), triton.cdiv(N, block_n))](f, w, bias, dst, B, D, N, BLOCK_B=block_b,
                                                                    BLOCK_N=block_n, BLOCK_D=128)
    return k, v, lam
