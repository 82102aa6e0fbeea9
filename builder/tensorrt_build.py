"""TensorRT engine build of ``decode.onnx`` / ``prefill.onnx`` (sm_90, TensorRT >= 10).

Only imported when ``import tensorrt`` works (``build.py``); nothing here is exercised on
the CPU CI. What it needs, exactly:

* ``tensorrt>=10`` Python package and a CUDA GPU of compute capability 9.0 (H100/H200);
* the plugin library holding the creators ``mac::match`` and ``mac::attend`` (name
  ``match`` / ``attend``, namespace ``mac``, version ``"1"``, fields ``band`` (int32/int64),
  ``tau`` / ``scale`` (float32)) at ``$MACATTN_TRT_PLUGIN_LIBRARY`` or
  ``<macattn.plugins>/libmacattn_trt.so``.

TensorRT's ONNX parser maps an unknown node to the plugin whose name is the node's
``op_type`` and whose namespace / version are the node attributes ``plugin_namespace`` /
``plugin_version``. The canonical graph says ``macattn::MacMatch``; ``to_tensorrt_onnx``
writes ``<name>.trt.onnx`` with ``op_type`` ``match`` / ``attend`` plus those two
attributes (``docs/graph.md`` records the mapping).
"""
from __future__ import annotations

from pathlib import Path

import onnx

from macattn.builder.onnx_ops import DOMAIN, MAC_ATTEND, MAC_MATCH

__all__ = ["TRT_PLUGINS", "to_tensorrt_onnx", "default_plugin_library", "build_tensorrt_engines"]

TRT_PLUGINS = {MAC_MATCH: ("match", "mac", "1"), MAC_ATTEND: ("attend", "mac", "1")}


def default_plugin_library() -> Path:
    import macattn.plugins

    return Path(macattn.plugins.__file__).parent / "libmacattn_trt.so"


def to_tensorrt_onnx(src: Path, dst: Path) -> Path:
    """Copy ``src`` to ``dst`` with the ``macattn`` nodes renamed to their TensorRT plugins."""
    model = onnx.load(str(src))
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type in TRT_PLUGINS:
            name, namespace, version = TRT_PLUGINS[node.op_type]
            node.op_type = name
            node.attribute.extend([onnx.helper.make_attribute("plugin_namespace", namespace),
                                   onnx.helper.make_attribute("plugin_version", version)])
    onnx.save_model(model, str(dst))
    return dst


def _profile_range(axis: str, max_batch: int, max_context: int) -> tuple[int, int, int]:
    return {"batch": (1, max(1, max_batch // 2), max_batch),
            "num_slots": (1, max_batch, max_batch),
            "context": (1, min(max_context, 4096), max_context),
            "prompt": (2, min(max_context, 1024), max_context)}[axis]


def build_tensorrt_engines(out: Path, dims: dict, *, max_batch: int, max_context: int,
                           plugin_library: str | None = None, log=print) -> dict:
    """Build ``decode.plan`` and ``prefill.plan`` in ``out``; returns a manifest entry."""
    import tensorrt as trt
    import torch

    if int(trt.__version__.split(".")[0]) < 10:
        return {"status": "skipped", "reason": f"tensorrt>=10 required, found {trt.__version__}"}
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return {"status": "skipped", "reason": "an sm_90 GPU (H100/H200) is required to build for sm_90"}
    lib = Path(plugin_library) if plugin_library else default_plugin_library()
    if not lib.is_file():
        reason = (f"plugin library {lib} not found: build the mac::match / mac::attend TensorRT plugins "
                  f"and point $MACATTN_TRT_PLUGIN_LIBRARY at the .so")
        log(reason)
        return {"status": "skipped", "reason": reason}
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    result = {"status": "built", "version": trt.__version__, "plugin_library": str(lib), "engines": {}}
    for name in ("decode", "prefill"):
        builder = trt.Builder(logger)
        builder.get_plugin_registry().load_library(str(lib))
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        trt_onnx = to_tensorrt_onnx(out / f"{name}.onnx", out / f"{name}.trt.onnx")
        if not parser.parse_from_file(str(trt_onnx)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT could not parse {trt_onnx}: {errors}")
        config = builder.create_builder_config()
        # mac::attend declares its four ring outputs aliased to its ring inputs (IPluginV3OneBuildV2::
        # getAliasedInput); TensorRT honours that only with this preview feature (10.3+), else each
        # step would copy every ring
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
        profile = builder.create_optimization_profile()
        graph = onnx.load(str(trt_onnx), load_external_data=False).graph
        axes = {vi.name: [d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in graph.input}
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            shape = list(tensor.shape)
            lo, opt, hi = list(shape), list(shape), list(shape)
            for ax, sym in enumerate(axes.get(tensor.name, [])):
                if sym:
                    lo[ax], opt[ax], hi[ax] = _profile_range(sym, max_batch, max_context)
            profile.set_shape(tensor.name, lo, opt, hi)
        config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise RuntimeError(f"TensorRT failed to build {name}.plan (see the log above)")
        (out / f"{name}.plan").write_bytes(bytes(plan))
        result["engines"][name] = f"{name}.plan"
    return result
