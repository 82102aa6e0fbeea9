"""Export the decode step and the prefill of a patched model to ONNX (``docs/graph.md``).

``export_decode_onnx`` traces ``DecodeStepModule`` with ``torch.export`` (dynamic batch
``B``, context ``T`` and ring slot count ``S``), rewrites each in-place ``mac_attend``
call into the functional twin (``onnx_ops.replace_inplace_attend``; programs already
functionalised go through ``onnx_ops.replace_auto_functionalized``) and translates it with ``torch.onnx.export(dynamo=True)``: one ``macattn::MacMatch`` and
one ``macattn::MacAttend`` node per layer (one ``MacAttend`` only when MAC is disabled
for a layer). ``export_prefill_onnx`` does the same for ``PrefillStepModule`` (dynamic
``B``, prompt length ``L`` and ``S``; no custom node: full attention + seeding).
``check_onnx`` runs ``onnx.checker.check_model(full_check=True)`` and strict shape inference.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from macattn.models.attention import binding_of
from macattn.builder.export import (DecodeStepModule, PrefillStepModule, decode_io_names, model_dims,
                                    prefill_io_names)
from macattn.builder.onnx_ops_completion import (custom_translation_table_completion,
                                                 register_onnx_schemas_completion)
from macattn.builder.onnx_ops_mka import custom_translation_table_mka, register_onnx_schemas_mka
from macattn.builder.onnx_ops import (DOMAIN, DOMAIN_VERSION, custom_translation_table, register_onnx_schemas,
                                      replace_auto_functionalized, replace_inplace_attend)

__all__ = ["OnnxExport", "example_decode_inputs", "example_prefill_inputs", "export_decode_onnx",
           "export_prefill_onnx", "check_onnx", "count_custom_nodes"]

_EXTERNAL_DATA_BYTES = 1 << 30   # write weights as external data past 1 GiB (protobuf limit is 2 GiB)


@dataclass
class OnnxExport:
    """What one export wrote: path, input/output names, dynamic axes, custom node counts."""

    path: Path
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    custom_nodes: dict[str, int] = field(default_factory=dict)
    opset: dict[str, int] = field(default_factory=dict)


def _ring_tensors(model, num_slots: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty rings of every layer, flat ``[qring, oring, ring_lse, ring_pos] * N``."""
    dims = model_dims(model)
    cfg = binding_of(model).method.config
    out = []
    for l in range(dims["num_layers"]):
        K = cfg.for_layer(l).window
        shape = (num_slots, dims["num_q_heads"], K, dims["head_dim"])
        out += [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=torch.float32),
                torch.full(shape[:3], float("-inf")), torch.full((num_slots, K), -1, dtype=torch.int64)]
    return out


def _check_sizes(**sizes: int) -> None:
    for name, val in sizes.items():
        if isinstance(val, bool) or not isinstance(val, int) or val < 2:
            raise ValueError(f"{name} must be an int >= 2 (export example size), got {val!r}")


def example_decode_inputs(model, *, batch: int = 2, context: int = 5, num_slots: int = 3) -> tuple:
    """Example arguments of ``DecodeStepModule``: ``B=batch`` requests at position ``context``
    with ``T=context`` past keys each, rings of ``num_slots`` slots."""
    _check_sizes(batch=batch, context=context, num_slots=num_slots)
    if num_slots < batch:
        raise ValueError(f"num_slots must be >= batch={batch}, got {num_slots}")
    dims = model_dims(model)
    dtype = next(model.parameters()).dtype
    kv = (batch, dims["num_kv_heads"], context, dims["head_dim"])
    rings = _ring_tensors(model, num_slots, dtype)
    state = []
    for l in range(dims["num_layers"]):
        state += [torch.zeros(kv, dtype=dtype), torch.zeros(kv, dtype=dtype), *rings[4 * l: 4 * l + 4]]
    return (torch.zeros(batch, 1, dtype=torch.int64), torch.full((batch,), context, dtype=torch.int64),
            torch.arange(batch, dtype=torch.int64), *state)


def example_prefill_inputs(model, *, batch: int = 2, prompt: int = 7, num_slots: int = 3) -> tuple:
    """Example arguments of ``PrefillStepModule``: ``[batch, prompt]`` token ids, rings of ``num_slots``."""
    _check_sizes(batch=batch, prompt=prompt, num_slots=num_slots)
    if num_slots < batch:
        raise ValueError(f"num_slots must be >= batch={batch}, got {num_slots}")
    dtype = next(model.parameters()).dtype
    return (torch.zeros(batch, prompt, dtype=torch.int64), torch.arange(batch, dtype=torch.int64),
            *_ring_tensors(model, num_slots, dtype))


def _decode_dynamic(num_layers: int):
    B, T, S = (torch.export.Dim("batch", min=1), torch.export.Dim("context", min=1),
               torch.export.Dim("num_slots", min=1))
    state = []
    for _ in range(num_layers):
        state += [{0: B, 2: T}, {0: B, 2: T}, {0: S}, {0: S}, {0: S}, {0: S}]
    return ({0: B}, {0: B}, {0: B}, tuple(state))


def _prefill_dynamic(num_layers: int):
    B, L, S = (torch.export.Dim("batch", min=1), torch.export.Dim("prompt", min=2),
               torch.export.Dim("num_slots", min=1))
    return ({0: B, 1: L}, {0: B}, tuple({0: S} for _ in range(4 * num_layers)))


def _axes(names: list[str], kind: str) -> dict[str, dict[int, str]]:
    """Symbolic axes of each graph input/output by name."""
    axes = {}
    for n in names:
        base = n.split(".")[0]
        if n in ("input_ids",):
            axes[n] = {0: "batch"} if kind == "decode" else {0: "batch", 1: "prompt"}
        elif n in ("positions", "slots", "logits") or base == "match_pos":
            axes[n] = {0: "batch"}
        elif base in ("key", "value"):
            axes[n] = {0: "batch"} if n.endswith(".new") else ({0: "batch", 2: "context"} if kind == "decode"
                                                              else {0: "batch", 2: "prompt"})
        elif base in ("qring", "oring", "ring_lse", "ring_pos"):
            axes[n] = {0: "num_slots"}
    return axes


def _rename_dims(model: onnx.ModelProto, axes: dict[str, dict[int, str]]) -> None:
    """Give graph inputs/outputs the symbolic dim names of ``axes`` (the exporter's are s0, s1, ...)."""
    mapping = {}
    for vi in list(model.graph.input) + list(model.graph.output):
        for ax, name in axes.get(vi.name, {}).items():
            dim = vi.type.tensor_type.shape.dim[ax]
            if dim.dim_param:
                mapping.setdefault(dim.dim_param, name)
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param in mapping:
                dim.dim_param = mapping[dim.dim_param]


def _translate(program, path: Path, names: tuple[list[str], list[str]], kind: str,
               dynamic_shapes=None, args=None) -> OnnxExport:
    ins, outs = names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        onnx_program = torch.onnx.export(program, args, dynamo=True, input_names=ins, output_names=outs,
                                         custom_translation_table={**custom_translation_table(),
                                                                   **custom_translation_table_mka(),
                                                                   **custom_translation_table_completion()},
                                         dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
                                         report=False)
    proto = onnx_program.model_proto
    axes = _axes(ins + outs, kind)
    _rename_dims(proto, axes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    big = proto.ByteSize() > _EXTERNAL_DATA_BYTES
    onnx.save_model(proto, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=path.name + ".data" if big else None)
    return OnnxExport(path, ins, outs, axes, count_custom_nodes(proto),
                      {imp.domain or "ai.onnx": imp.version for imp in proto.opset_import})


def _export_step(module: torch.nn.Module, args: tuple, kind: str, path: str | Path) -> OnnxExport:
    """Write the ``kind`` ("decode" | "prefill") step ``module`` (in eval mode) to ``path`` as ONNX:
    ``torch.export`` on its example ``args`` (no grad, non-strict, that kind's dynamic shapes), for
    decode the in-place ``mac_attend`` calls made functional, then ``_translate``."""
    N = module.num_layers
    dynamic, names = {"decode": (_decode_dynamic, decode_io_names),
                      "prefill": (_prefill_dynamic, prefill_io_names)}[kind]
    with torch.no_grad():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic(N), strict=False)
    if kind == "decode" and replace_inplace_attend(ep) == 0:     # already functional (auto_functionalized) programs
        replace_auto_functionalized(ep)
    return _translate(ep, Path(path), names(N), kind)


def export_decode_onnx(model, path: str | Path, *, batch: int = 2, context: int = 5,
                       num_slots: int = 3) -> OnnxExport:
    """Write the decode step of patched ``model`` to ``path``; see the module docstring."""
    module = DecodeStepModule(model).eval()
    return _export_step(module, example_decode_inputs(model, batch=batch, context=context, num_slots=num_slots),
                        "decode", path)


def export_prefill_onnx(model, path: str | Path, *, batch: int = 2, prompt: int = 7,
                        num_slots: int = 3) -> OnnxExport:
    """Write the prefill of patched ``model`` to ``path``; see the module docstring."""
    module = PrefillStepModule(model).eval()
    return _export_step(module, example_prefill_inputs(model, batch=batch, prompt=prompt, num_slots=num_slots),
                        "prefill", path)


def count_custom_nodes(model: onnx.ModelProto) -> dict[str, int]:
    """``{op_type: count}`` of the ``macattn``-domain nodes of the main graph."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def check_onnx(path: str | Path) -> onnx.ModelProto:
    """``onnx.checker.check_model(full_check=True)`` and ``infer_shapes(strict_mode=True)``
    with the ``macattn`` schemas registered; returns the shape-inferred model."""
    register_onnx_schemas()
    register_onnx_schemas_mka()
    register_onnx_schemas_completion()
    path = Path(path)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)

