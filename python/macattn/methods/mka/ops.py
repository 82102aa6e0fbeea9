"""``macattn::route_fused_attention``: one FastMKA decode step as a ``torch.library`` op.

Fuses routing (MLP -> softmax -> gate), the L2 session-summary update and the K/V
projection of the fused memory (docs/spec.md §2, L3 off). The caller applies RoPE to ``k``, appends
``k``/``v`` to its KV cache and runs ordinary attention. The reference
(``macattn.methods.mka.reference.route_fused_decode_reference``, fp32) is the implementation on every device
without a faster one; ``register_cuda_kernels`` registers the Triton kernels for CUDA.

The L2 state (``state_mean [S, D]`` fp32, ``state_count [S]`` int64, one row per request slot)
is carried by the runtime between steps (``macattn.methods.mka.state.MkaState``) and
mutated in place (declared in ``mutates_args``). ``slots`` of one call must be distinct.
"""
from __future__ import annotations

import torch

from macattn.methods.mka.reference import route_fused_decode_reference
from macattn.plugins import HAVE_TRITON
from macattn.plugins.cuda_kernels import register_cuda_launchers
from macattn.plugins.route_fused.checks import check_route_fused_inputs

__all__ = ["route_fused_attention", "register_cuda_kernels"]


@torch.library.custom_op("macattn::route_fused_attention", mutates_args=("state_mean", "state_count"))
def route_fused_attention(x: torch.Tensor, q: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                          b2: torch.Tensor, gate: torch.Tensor, state_mean: torch.Tensor, state_count: torch.Tensor,
                          slots: torch.Tensor, wk: torch.Tensor, bk: torch.Tensor, wv: torch.Tensor, bv: torch.Tensor,
                          mode: int, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k [B, Nk], v [B, Nv])`` in ``x``'s dtype (pre-RoPE) and ``lam [B, 3]`` fp32.

    x ``[B, D]`` attention input, q ``[B, Dq]`` pre-RoPE query, router w1 ``[R, Dq]`` b1 ``[R]``
    w2 ``[3, R]`` b2 ``[3]`` gate ``[]``, state rows ``slots [B]`` of ``state_mean [S, D]`` /
    ``state_count [S]`` (updated), wk/wv ``[N, D]`` with biases ``[N]`` (zeros when the model
    has none); mode 0 prefix mean, 1 EMA with ``beta``.
    """
    check_route_fused_inputs(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta)
    k, v, lam = route_fused_decode_reference(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots,
                                             wk, bk, wv, bv, mode, beta)
    return k.to(x.dtype), v.to(x.dtype), lam.float()


@route_fused_attention.register_fake
def _(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta):
    B = x.shape[0]
    return (x.new_empty((B, wk.shape[0])), x.new_empty((B, wv.shape[0])),
            x.new_empty((B, 3), dtype=torch.float32))


def register_cuda_kernels() -> tuple[str, ...]:
    """Register the Triton launcher as the CUDA kernel of ``route_fused_attention`` (idempotent; through
    ``macattn.methods.kernels.register_kernels``). Returns the op name; ``()`` without triton."""
    if not HAVE_TRITON:
        return ()
    from macattn.plugins.route_fused.op import route_fused_attention_triton

    return register_cuda_launchers({"macattn::route_fused_attention": lambda: route_fused_attention_triton})
