"""TensorRT plugin ``mac::route_fused`` (version "1"): shape/dtype inference and guarded registration.

The ONNX node ``macattn::RouteFusedAttention`` (``builder/onnx_ops_mka.py``) becomes this plugin:
same 14 inputs in the same order, attributes ``mode`` (int) and ``beta`` (float), 5 outputs
(k, v, lam, state_mean_out, state_count_out; the state outputs alias the state inputs in the
engine). Inference is a plain function over dims (``int`` or TensorRT's ``ShapeExpr``) and torch
dtypes, tested without TensorRT; ``register_tensorrt`` hands it to ``tensorrt.plugin`` with a JIT
impl that runs ``torch.ops.macattn.route_fused_attention`` (the Triton kernel) on the stream.
No AOT image yet (the engine then needs Python at run time, like the JIT path of the MAC plugins).

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the registered
functions' annotations as classes.
"""
import numbers
from typing import Any, Sequence, Tuple

import torch

from ..aot import check_input_ranks, same_dim

__all__ = ["PLUGIN_ID", "INPUTS", "OUTPUTS", "route_fused_output_specs", "register_tensorrt"]

PLUGIN_ID = "mac::route_fused"
INPUTS = ("x", "q", "w1", "b1", "w2", "b2", "gate", "state_mean", "state_count", "slots", "wk", "bk", "wv", "bv")
OUTPUTS = ("k", "v", "lam", "state_mean_out", "state_count_out")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_RANKS = (2, 2, 2, 1, 2, 1, 0, 2, 1, 1, 2, 1, 2, 1)


def _check_attrs(mode: int, beta: float) -> None:
    if isinstance(mode, bool) or not isinstance(mode, numbers.Integral) or mode not in (0, 1):
        raise ValueError(f"mode must be 0 (prefix mean) or 1 (EMA), got {mode!r}")
    if not isinstance(beta, numbers.Real) or (mode == 1 and not 0.0 < float(beta) < 1.0):
        raise ValueError(f"beta must be a float in (0, 1) for EMA, got {beta!r}")


def route_fused_output_specs(shapes: Sequence[Sequence[Any]], dtypes: Sequence[torch.dtype], *, mode: int,
                             beta: float) -> list:
    """Output ``(shape, dtype)`` of ``mac::route_fused`` from its 14 inputs' shapes and dtypes:
    ``[(B, Nk) x.dtype, (B, Nv) x.dtype, (B, 3) float32, (S, D) float32, (S,) int64]``.
    Raises ``ValueError``/``TypeError`` naming the input that does not fit."""
    _check_attrs(mode, beta)
    check_input_ranks("mac::route_fused", INPUTS, _RANKS, shapes, dtypes)
    x, q, w1, b1, w2, b2, gate, sm, sc, slots, wk, bk, wv, bv = shapes
    B, D = x
    Dq, R, S, Nk, Nv = q[1], w1[0], sm[0], wk[0], wv[0]
    checks = (("q", q, (B, Dq)), ("w1", w1, (R, Dq)), ("b1", b1, (R,)), ("w2", w2, (3, R)), ("b2", b2, (3,)),
              ("state_mean", sm, (S, D)), ("state_count", sc, (S,)), ("slots", slots, (B,)), ("wk", wk, (Nk, D)),
              ("bk", bk, (Nk,)), ("wv", wv, (Nv, D)), ("bv", bv, (Nv,)))
    for name, got, want in checks:
        if not all(same_dim(a, b) for a, b in zip(got, want)):
            raise ValueError(f"{name} shape {tuple(got)} does not fit {want} (x [B, D], q [B, Dq], w1 [R, Dq])")
    for name, dt in zip(INPUTS, dtypes):
        want = {"state_mean": (torch.float32,), "state_count": (torch.int64,), "slots": (torch.int64,)}.get(name, _FLOATS)
        if dt not in want:
            raise TypeError(f"{name} must be one of {want}, got {dt}")
    return [((B, Nk), dtypes[0]), ((B, Nv), dtypes[0]), ((B, 3), torch.float32), ((S, D), torch.float32),
            ((S,), torch.int64)]


def register_tensorrt(trtp, to_torch_dtype, to_trt_dtype) -> None:
    """Register ``mac::route_fused`` with ``tensorrt.plugin`` (``trtp``): descriptor and JIT impl."""
    from .op import route_fused_attention_triton

    TensorDesc = trtp.TensorDesc

    @trtp.register(PLUGIN_ID)
    def _desc(x: TensorDesc, q: TensorDesc, w1: TensorDesc, b1: TensorDesc, w2: TensorDesc, b2: TensorDesc,
              gate: TensorDesc, state_mean: TensorDesc, state_count: TensorDesc, slots: TensorDesc, wk: TensorDesc,
              bk: TensorDesc, wv: TensorDesc, bv: TensorDesc, mode: int, beta: float
              ) -> Tuple[TensorDesc, TensorDesc, TensorDesc, TensorDesc, TensorDesc]:
        ins = (x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv)
        specs = route_fused_output_specs([t.shape_expr for t in ins], [to_torch_dtype(t.dtype) for t in ins],
                                         mode=mode, beta=beta)
        outs = [trtp.from_shape_expr(tuple(shape), dtype=to_trt_dtype(dt)) for shape, dt in specs]
        outs[3] = state_mean.aliased()
        outs[4] = state_count.aliased()
        return tuple(outs)

    @trtp.impl(PLUGIN_ID)
    def _impl(x: trtp.Tensor, q: trtp.Tensor, w1: trtp.Tensor, b1: trtp.Tensor, w2: trtp.Tensor, b2: trtp.Tensor,
              gate: trtp.Tensor, state_mean: trtp.Tensor, state_count: trtp.Tensor, slots: trtp.Tensor,
              wk: trtp.Tensor, bk: trtp.Tensor, wv: trtp.Tensor, bv: trtp.Tensor, mode: int, beta: float,
              outputs: Tuple[trtp.Tensor], stream: int) -> None:
        t = [torch.as_tensor(a, device="cuda") for a in (x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots,
                                                         wk, bk, wv, bv)]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            k, v, lam = route_fused_attention_triton(*t, mode, beta)   # state updated in place (aliased)
            for i, r in enumerate((k, v, lam)):
                torch.as_tensor(outputs[i], device="cuda").copy_(r)

