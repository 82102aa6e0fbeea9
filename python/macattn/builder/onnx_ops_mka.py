"""ONNX lowering of ``macattn::route_fused_attention`` (FastMKA decode step, docs/spec.md §2).

* ``macattn::RouteFusedAttention`` (opset ``macattn`` v1) <- ``torch.ops.macattn.route_fused_attention_functional``,
  the functional twin of the in-place op (export only: it returns the updated L2 state as outputs
  ``state_mean_out`` / ``state_count_out``, which may alias the state inputs in the engine).

Inputs (in order): x ``[B, D]``, q ``[B, Dq]``, w1 ``[R, Dq]``, b1 ``[R]``, w2 ``[3, R]``, b2 ``[3]``,
gate ``[]``, state_mean ``[S, D]`` fp32, state_count ``[S]`` int64, slots ``[B]`` int64,
wk ``[Nk, D]``, bk ``[Nk]``, wv ``[Nv, D]``, bv ``[Nv]``. Attributes: ``mode`` (int, 0 prefix
mean / 1 EMA), ``beta`` (float). Outputs: k ``[B, Nk]`` and v ``[B, Nv]`` (x's dtype, pre-RoPE),
lam ``[B, 3]`` fp32, state_mean_out ``[S, D]`` fp32, state_count_out ``[S]`` int64.
Hooked like ``builder/onnx_ops.py``: ``register_onnx_schemas_mka()`` and
``custom_translation_table_mka()`` (merge into the exporter's table).
"""
from __future__ import annotations

import torch
from onnx.defs import OpSchema

from macattn.methods.mka import ops as ops_mka  # noqa: F401  (registers torch.ops.macattn.route_fused_attention)

from macattn.builder.onnx_ops import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, register_schemas

__all__ = ["ROUTE_FUSED", "INPUTS", "OUTPUTS", "route_fused_attention_functional", "register_onnx_schemas_mka",
           "custom_translation_table_mka"]

ROUTE_FUSED = "RouteFusedAttention"
INPUTS = ("x", "q", "w1", "b1", "w2", "b2", "gate", "state_mean", "state_count", "slots", "wk", "bk", "wv", "bv")
OUTPUTS = ("k", "v", "lam", "state_mean_out", "state_count_out")


@torch.library.custom_op("macattn::route_fused_attention_functional", mutates_args=())
def route_fused_attention_functional(x: torch.Tensor, q: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                                     w2: torch.Tensor, b2: torch.Tensor, gate: torch.Tensor,
                                     state_mean: torch.Tensor, state_count: torch.Tensor, slots: torch.Tensor,
                                     wk: torch.Tensor, bk: torch.Tensor, wv: torch.Tensor, bv: torch.Tensor,
                                     mode: int, beta: float
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``route_fused_attention`` on copies of the state: ``(k, v, lam, state_mean', state_count')``."""
    m, c = state_mean.clone(), state_count.clone()
    k, v, lam = torch.ops.macattn.route_fused_attention(x, q, w1, b1, w2, b2, gate, m, c, slots, wk, bk, wv, bv,
                                                        mode, beta)
    return k, v, lam, m, c


@route_fused_attention_functional.register_fake
def _(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv, mode, beta):
    B = x.shape[0]
    return (x.new_empty((B, wk.shape[0])), x.new_empty((B, wv.shape[0])), x.new_empty((B, 3), dtype=torch.float32),
            torch.empty_like(state_mean), torch.empty_like(state_count))


def _schema() -> OpSchema:
    p = OpSchema.FormalParameter
    shapes = ("[B, D]", "[B, Dq]", "[R, Dq]", "[R]", "[3, R]", "[3]", "[]", "[S, D]", "[S]", "[B]", "[Nk, D]", "[Nk]",
              "[Nv, D]", "[Nv]")
    types = ("T", "T", "TW", "TW", "TW", "TW", "TW", "tensor(float)", "tensor(int64)", "tensor(int64)", "TW", "TW",
             "TW", "TW")
    return OpSchema(
        ROUTE_FUSED, DOMAIN, DOMAIN_VERSION,
        doc="FastMKA decode step: routing MLP -> softmax -> gate, L2 session-summary update of rows `slots`, "
            "fused memory, K/V projection. State outputs may alias the state inputs (in place).",
        inputs=[p(n, t, s) for n, t, s in zip(INPUTS, types, shapes)],
        outputs=[p("k", "T", "[B, Nk] pre-RoPE"), p("v", "T", "[B, Nv]"), p("lam", "tensor(float)", "[B, 3]"),
                 p("state_mean_out", "tensor(float)", "[S, D]"), p("state_count_out", "tensor(int64)", "[S]")],
        type_constraints=[("T", FLOAT_TYPES, "activation dtype"), ("TW", FLOAT_TYPES, "weight dtype")],
        attributes=[OpSchema.Attribute("mode", OpSchema.AttrType.INT, "0 prefix mean, 1 EMA"),
                    OpSchema.Attribute("beta", OpSchema.AttrType.FLOAT, "EMA decay in (0, 1) (mode 1)")])


def register_onnx_schemas_mka() -> None:
    """Register ``macattn::RouteFusedAttention`` with ``onnx.defs`` (idempotent)."""
    register_schemas([_schema()])


def custom_translation_table_mka() -> dict:
    """``{torch op: onnxscript function}`` for ``torch.onnx.export(..., custom_translation_table=...)``."""
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def route_fused_onnx(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv,
                         mode: int, beta: float):
        return opset.RouteFusedAttention(x, q, w1, b1, w2, b2, gate, state_mean, state_count, slots, wk, bk, wv, bv,
                                         mode=mode, beta=beta, _num_outputs=5)

    return {torch.ops.macattn.route_fused_attention_functional.default: route_fused_onnx}
