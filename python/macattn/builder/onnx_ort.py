"""Run the exported graphs on the CPU with ONNX Runtime; the ``macattn`` nodes execute the
reference (``macattn.methods.mac.reference``) through onnxruntime-extensions Python custom ops.

onnxruntime-extensions registers Python ops only in its own domain
(``onnxruntime_extensions.default_opset_domain()``, ``ai.onnx.contrib``), so
``ort_session`` loads the model and moves the ``macattn`` nodes (and the opset import)
into that domain in memory; the file on disk keeps domain ``macattn``. Data crosses the
Python boundary as numpy arrays (fp32 / int64).

bf16 graphs (``macattn build --dtype bf16``, the default for TensorRT): ONNX Runtime's CPU provider
(1.32) has bf16 kernels only for data movement (``Cast``, ``Concat``, ``Transpose``, ...), none for
``MatMul``, ``Mul``, ``Add``, ``Sqrt``, ``Sigmoid``, ``ReduceMean``, ``Cos`` / ``Sin`` (checked by
``tests/builder/test_export_bf16.py``), so ``ort_session`` runs a bf16 graph as its fp32 widening
(``widen_bf16``): every bf16 tensor, initializer and cast target becomes fp32. Weights stored in bf16
are exact in fp32; what differs from a bf16 engine is only the rounding of intermediate results. This is
the fp32 reference of the bf16 graph, not bf16 execution.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from macattn.builder.onnx_ops import DOMAIN, MAC_ATTEND, MAC_MATCH
from macattn.builder.onnx_ops_completion import register_ort_ops_completion

__all__ = ["ort_session", "run_session", "register_python_ops", "widen_bf16", "bf16_tensor_names"]

_REGISTERED = False


def register_python_ops() -> None:
    """Register ``MacMatch`` / ``MacAttend`` as onnxruntime-extensions Python ops (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from onnxruntime_extensions import PyCustomOpDef as D, onnx_op

    f, i = D.dt_float, D.dt_int64

    @onnx_op(op_type=MAC_MATCH, inputs=[f, f, f, i, i, i], outputs=[i, f],
             attrs={"band": D.dt_int64, "tau": D.dt_float})
    def mac_match(q_pre, qring, ring_lse, ring_pos, slots, positions, band, tau):
        t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q_pre, qring, ring_lse, ring_pos, slots, positions)]
        match_pos, dist = torch.ops.macattn.mac_match(*t, int(band), float(tau))
        return match_pos.numpy(), dist.numpy()

    @onnx_op(op_type=MAC_ATTEND, inputs=[f, f, f, f, i, i, i, f, f, f, i], outputs=[f, f, f, f, i],
             attrs={"band": D.dt_int64, "scale": D.dt_float})
    def mac_attend(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos, band, scale):
        t = [torch.from_numpy(np.array(a)) for a in (q, q_pre, k, v, positions, match_pos, slots,
                                                      qring, oring, ring_lse, ring_pos)]
        out = torch.ops.macattn.mac_attend(*t, int(band), float(scale))
        return (out.numpy(), *(r.numpy() for r in t[7:]))

    _REGISTERED = True


def _retarget_domain(model: onnx.ModelProto, domain: str) -> None:
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.domain = domain
    imports = [imp for imp in model.opset_import if imp.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    if not any(imp.domain == domain for imp in imports):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))


def bf16_tensor_names(model: onnx.ModelProto) -> list[str]:
    """Graph inputs, outputs, value infos and initializers of ``model`` typed bfloat16 (names)."""
    bf16 = onnx.TensorProto.BFLOAT16
    g = model.graph
    names = [v.name for v in (*g.input, *g.output, *g.value_info) if v.type.tensor_type.elem_type == bf16]
    return names + [t.name for t in g.initializer if t.data_type == bf16]


def _widen_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    from onnx import numpy_helper

    arr = numpy_helper.to_array(t).astype(np.float32)
    out = numpy_helper.from_array(arr, t.name)
    return out


def widen_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every bfloat16 tensor as float32: graph inputs / outputs / value infos,
    initializers, ``Constant`` values and ``Cast(to=BFLOAT16)`` targets (see the module docstring)."""
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for v in (*g.input, *g.output, *g.value_info):
        if v.type.tensor_type.elem_type == bf16:
            v.type.tensor_type.elem_type = f32
    for i, t in enumerate(g.initializer):
        if t.data_type == bf16:
            g.initializer[i].CopyFrom(_widen_tensor(t))
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == bf16:
                a.i = f32
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == bf16:
                a.t.CopyFrom(_widen_tensor(a.t))
    return m


def ort_session(path: str | Path):
    """An ``onnxruntime.InferenceSession`` (CPU) of ``path`` with the ``macattn`` ops bound to the reference;
    a graph holding bf16 tensors runs as its fp32 widening (``widen_bf16``)."""
    import onnxruntime as ort
    from onnxruntime_extensions import default_opset_domain, get_library_path

    register_python_ops()
    register_ort_ops_completion()
    model = onnx.load(str(path))
    if bf16_tensor_names(model):
        model = widen_bf16(model)
    _retarget_domain(model, default_opset_domain())
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(get_library_path())
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run_session(session, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run with torch tensors in, ``{output name: torch tensor}`` out."""
    names = [o.name for o in session.get_outputs()]
    np_feeds = {k: v.detach().cpu().numpy() for k, v in feeds.items()}
    return dict(zip(names, (torch.from_numpy(np.asarray(a)) for a in session.run(names, np_feeds))))
