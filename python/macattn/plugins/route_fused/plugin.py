"""TensorRT plugin ``mac::route_fused`` (version "1"): shape/dtype inference and guarded registration.

The ONNX node ``macattn::RouteFusedAttention`` (``builder/onnx_ops_mka.py``) becomes this plugin:
same 14 inputs in the same order, attributes ``mode`` (int) and ``beta`` (float), 5 outputs
(k, v, lam, state_mean_out, state_count_out; the state outputs alias the state inputs in the
engine). Inference is a plain function over dims (``int`` or TensorRT's ``ShapeExpr``) and torch
dtypes, tested without TensorRT; ``register_tensorrt`` hands it to ``tensorrt.plugin`` with a JIT
impl that runs the op's Triton launcher on TensorRT's stream, into TensorRT's output buffers.
No AOT image yet (the engine then needs Python at run time, like the JIT path of the MAC plugins).

No ``from __future__ import annotations`` here: ``tensorrt.plugin`` reads the registered
functions' annotations as classes.
"""
import numbers
from typing import Any, Sequence, Tuple

import torch

from ..aot import FLOATS, check_dims_fit, check_dtypes, check_input_ranks
from ..trt_compat import python_id

__all__ = ["PLUGIN_ID", "INPUTS", "OUTPUTS", "ALIASES", "route_fused_output_specs", "register_tensorrt"]

PLUGIN_ID = python_id("route_fused")
INPUTS = ("x", "q", "w1", "b1", "w2", "b2", "gate", "state_mean", "state_count", "slots", "wk", "bk", "wv", "bv")
OUTPUTS = ("k", "v", "lam", "state_mean_out", "state_count_out")
_RANKS = (2, 2, 2, 1, 2, 1, 0, 2, 1, 1, 2, 1, 2, 1)
_DTYPES = {**dict.fromkeys(INPUTS, FLOATS), "state_mean": (torch.float32,), "state_count": (torch.int64,),
           "slots": (torch.int64,)}
# the engine binds each state output to its input's buffer: {output index: input index}
ALIASES = {OUTPUTS.index("state_mean_out"): INPUTS.index("state_mean"),
           OUTPUTS.index("state_count_out"): INPUTS.index("state_count")}


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
    check_dims_fit((("q", q, (B, Dq)), ("w1", w1, (R, Dq)), ("b1", b1, (R,)), ("w2", w2, (3, R)), ("b2", b2, (3,)),
                    ("state_mean", sm, (S, D)), ("state_count", sc, (S,)), ("slots", slots, (B,)),
                    ("wk", wk, (Nk, D)), ("bk", bk, (Nk,)), ("wv", wv, (Nv, D)), ("bv", bv, (Nv,))),
                   " (x [B, D], q [B, Dq], w1 [R, Dq])")
    check_dtypes(INPUTS, dtypes, _DTYPES)
    return [((B, Nk), dtypes[0]), ((B, Nv), dtypes[0]), ((B, 3), torch.float32), ((S, D), torch.float32),
            ((S,), torch.int64)]


def register_tensorrt(binding) -> None:
    """Register ``mac::route_fused`` with ``tensorrt.plugin`` through ``binding``
    (``tensorrt_plugins.PluginBinding``): descriptor (the state aliased) and JIT impl (the Triton launcher
    writing ``k``, ``v``, ``lam`` into TensorRT's outputs and the aliased state in place)."""
    from .op import route_fused_attention_triton

    trtp = binding.trtp
    TensorDesc, Tensor = trtp.TensorDesc, trtp.Tensor

    @binding.register(PLUGIN_ID)
    def _desc(x: TensorDesc, q: TensorDesc, w1: TensorDesc, b1: TensorDesc, w2: TensorDesc, b2: TensorDesc,
              gate: TensorDesc, state_mean: TensorDesc, state_count: TensorDesc, slots: TensorDesc, wk: TensorDesc,
              bk: TensorDesc, wv: TensorDesc, bv: TensorDesc, mode: int, beta: float
              ) -> Tuple[TensorDesc, TensorDesc, TensorDesc, TensorDesc, TensorDesc]:
        return binding.output_descs((x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv),
                                    route_fused_output_specs, aliases=ALIASES, mode=mode, beta=beta)

    @trtp.impl(PLUGIN_ID)
    def _impl(x: Tensor, q: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, gate: Tensor, state_mean: Tensor,
              state_count: Tensor, slots: Tensor, wk: Tensor, bk: Tensor, wv: Tensor, bv: Tensor, mode: int,
              beta: float, outputs: Tuple[Tensor], stream: int) -> None:
        binding.launch(stream, route_fused_attention_triton,
                       (x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv), (mode, beta),
                       outputs[:3])
