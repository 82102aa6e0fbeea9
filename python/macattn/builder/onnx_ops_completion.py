"""ONNX lowering of retrieval-completion (docs/spec.md §3): two ``macattn``-domain nodes.

* ``macattn::RetrievalCompletion`` (opset ``macattn`` v1) <- ``torch.ops.macattn.retrieval_completion``
  (one decode step; becomes the TensorRT plugin ``mac::retrieval_completion``);
* ``macattn::CompletionCache`` <- ``torch.ops.macattn.completion_cache`` (the stable cache at
  prefill; plugin ``mac::completion_cache``).

Neither op mutates its inputs, so no functional twin is needed. Inputs, attributes and outputs
are those of ``macattn.methods.completion.ops`` (and of ``plugins/retrieval_completion/plugin.py``).
Hooked like ``builder/onnx_ops_mka.py``: ``register_onnx_schemas_completion()`` and
``custom_translation_table_completion()``; ``register_ort_ops_completion()`` binds both nodes
to the torch ops for ONNX Runtime (through onnxruntime-extensions, see ``builder/onnx_ort.py``).
"""
from __future__ import annotations

import numpy as np
import torch
from onnx.defs import OpSchema

from macattn.methods.completion import ops as ops_completion  # noqa: F401  (registers the torch ops)

from macattn.builder.onnx_ops import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, register_schemas

__all__ = ["RETRIEVAL_COMPLETION", "COMPLETION_CACHE", "register_onnx_schemas_completion",
           "custom_translation_table_completion", "register_ort_ops_completion"]

RETRIEVAL_COMPLETION = "RetrievalCompletion"
COMPLETION_CACHE = "CompletionCache"
_INTS = ["tensor(int32)", "tensor(int64)"]


def _schemas() -> list[OpSchema]:
    p = OpSchema.FormalParameter
    f32 = "tensor(float)"
    attr = OpSchema.Attribute
    ints = [attr("n_sink", OpSchema.AttrType.INT, "exact prefix of the prefill (>= 0)"),
            attr("n_tail", OpSchema.AttrType.INT, "exact suffix of the prefill (>= 0)")]
    step = OpSchema(
        RETRIEVAL_COMPLETION, DOMAIN, DOMAIN_VERSION,
        doc="Retrieval-completion decode step (docs/completion.md): exact attention over sink + tail + Top-k(mid) "
            "+ generated, completion of the rest of the mid from the stable cache, one normalisation.",
        inputs=[p("q", "T", "[B, Hq, d] post-RoPE"), p("k_cache", "TKV", "[B, Hkv, T, d]"),
                p("v_cache", "TKV", "[B, Hkv, T, d]"), p("seq_lens", "TI", "[B]"), p("n_prefill", "TI", "[B]"),
                p("log_phi_q", f32, "[B, Hq, F]"), p("log_phi_k", f32, "[B, Hkv, T, F]"),
                p("comp_A", f32, "[B, Hkv, F, d]"), p("comp_b", f32, "[B, Hkv, F]"),
                p("comp_shift", f32, "[B, Hkv, F]")],
        outputs=[p("out", "T", "[B, Hq, d]")],
        type_constraints=[("T", FLOAT_TYPES, "query dtype"), ("TKV", FLOAT_TYPES, "K/V dtype"),
                          ("TI", _INTS, "lengths")],
        attributes=ints + [attr("top_k", OpSchema.AttrType.INT, "retrieved mid tokens per query head (>= 0)"),
                           attr("scale", OpSchema.AttrType.FLOAT, "softmax scale, <= 0 for 1/sqrt(d)")])
    cache = OpSchema(
        COMPLETION_CACHE, DOMAIN, DOMAIN_VERSION,
        doc="Stable completion cache of each row's mid region (docs/completion.md), built once at prefill.",
        inputs=[p("log_phi_k", f32, "[B, Hkv, T, F]"), p("v_cache", "TKV", "[B, Hkv, T, d]"),
                p("n_prefill", "TI", "[B]")],
        outputs=[p("comp_A", f32, "[B, Hkv, F, d]"), p("comp_b", f32, "[B, Hkv, F]"),
                 p("comp_shift", f32, "[B, Hkv, F]")],
        type_constraints=[("TKV", FLOAT_TYPES, "V dtype"), ("TI", _INTS, "lengths")],
        attributes=ints)
    return [step, cache]


def register_onnx_schemas_completion() -> None:
    """Register both schemas with ``onnx.defs`` (idempotent)."""
    register_schemas(_schemas())


def custom_translation_table_completion() -> dict:
    """``{torch op: onnxscript function}`` for ``torch.onnx.export(..., custom_translation_table=...)``."""
    import onnxscript

    register_onnx_schemas_completion()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def step_onnx(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A, comp_b, comp_shift,
                  n_sink: int, n_tail: int, top_k: int, scale: float):
        return opset.RetrievalCompletion(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k, comp_A,
                                         comp_b, comp_shift, n_sink=n_sink, n_tail=n_tail, top_k=top_k, scale=scale)

    def cache_onnx(log_phi_k, v_cache, n_prefill, n_sink: int, n_tail: int):
        return opset.CompletionCache(log_phi_k, v_cache, n_prefill, n_sink=n_sink, n_tail=n_tail, _num_outputs=3)

    return {torch.ops.macattn.retrieval_completion.default: step_onnx,
            torch.ops.macattn.completion_cache.default: cache_onnx}


_ORT_REGISTERED = False


def register_ort_ops_completion() -> None:
    """Bind both nodes to the torch ops as onnxruntime-extensions Python ops (once per process;
    fp32 activations and int64 lengths, as Python ops cross the boundary as numpy arrays)."""
    global _ORT_REGISTERED
    if _ORT_REGISTERED:
        return
    from onnxruntime_extensions import PyCustomOpDef as D, onnx_op

    f, i = D.dt_float, D.dt_int64

    @onnx_op(op_type=RETRIEVAL_COMPLETION, inputs=[f, f, f, i, i, f, f, f, f, f], outputs=[f],
             attrs={"n_sink": D.dt_int64, "n_tail": D.dt_int64, "top_k": D.dt_int64, "scale": D.dt_float})
    def retrieval_completion(q, k_cache, v_cache, seq_lens, n_prefill, lpq, lpk, comp_A, comp_b, comp_shift,
                             n_sink, n_tail, top_k, scale):
        t = [torch.from_numpy(np.array(a)) for a in (q, k_cache, v_cache, seq_lens, n_prefill, lpq, lpk, comp_A,
                                                      comp_b, comp_shift)]
        return torch.ops.macattn.retrieval_completion(*t, int(n_sink), int(n_tail), int(top_k), float(scale)).numpy()

    @onnx_op(op_type=COMPLETION_CACHE, inputs=[f, f, i], outputs=[f, f, f],
             attrs={"n_sink": D.dt_int64, "n_tail": D.dt_int64})
    def completion_cache(log_phi_k, v_cache, n_prefill, n_sink, n_tail):
        t = [torch.from_numpy(np.array(a)) for a in (log_phi_k, v_cache, n_prefill)]
        return tuple(r.numpy() for r in torch.ops.macattn.completion_cache(*t, int(n_sink), int(n_tail)))

    _ORT_REGISTERED = True
