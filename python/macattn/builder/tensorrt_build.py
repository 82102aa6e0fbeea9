"""TensorRT engine build of ``decode.onnx`` / ``prefill.onnx`` (sm_90, TensorRT >= 10.3; >= 10.9 for the
Python plugins).

Only imported when ``import tensorrt`` works (``build.py``); its pure parts (``to_tensorrt_onnx``,
``network_flags``, the version gate) are tested on the CPU, the build itself never ran. What it needs:

* ``tensorrt>=10.3`` (``>=10.9`` with ``backend="python"``) and a CUDA GPU of compute capability 9.0 (H100/H200);
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
from macattn.plugins.trt_compat import (MIN_PYTHON_PLUGINS, MIN_TENSORRT, NATIVE_NAMESPACE, PLUGIN_VERSION,
                                        PYTHON_NAMESPACE, TensorRTVersionError, load_plugin_library, parse_version,
                                        require_version)

__all__ = ["BACKENDS", "TRT_PLUGINS", "TRT_PLUGINS_DOMAIN", "to_tensorrt_onnx", "network_flags",
           "default_plugin_library", "build_tensorrt_engines", "require_tensorrt_build"]

BACKENDS = ("native", "python")
# ONNX op -> plugin name; the namespace is the backend's (trt_compat), the version PLUGIN_VERSION
TRT_PLUGINS = {MAC_MATCH: "match", MAC_ATTEND: "attend"}
# Python plugins with both a JIT and an AOT impl: without a choice TensorRT's plugin layer refuses to create them
_AOT_PLUGINS = ("match", "attend")


def default_plugin_library() -> Path:
    import macattn.plugins

    return Path(macattn.plugins.__file__).parent / "libmacattn_trt.so"


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


TRT_PLUGINS_DOMAIN = "trt.plugins"     # the domain ONNX Runtime's TensorRT provider and ModelOpt expect plugins in


def to_tensorrt_onnx(src: Path, dst: Path, backend: str = "native", aot: bool = True,
                     domain: str | None = None) -> Path:
    """Copy ``src`` to ``dst`` with the ``macattn`` nodes renamed to their TensorRT plugins.

    ``op_type`` = plugin name, attributes ``plugin_namespace`` (``mac`` for the native library,
    ``mac_py`` for the ``tensorrt.plugin`` definitions) and ``plugin_version``. For ``backend="python"``
    each ``match`` / ``attend`` node also gets the int attribute ``aot`` (1: the AOT impl, 0: the JIT impl):
    they define both, and the ONNX parser turns ``aot`` into a strict creation request; without it the
    network must set ``PREFER_AOT_PYTHON_PLUGINS`` / ``PREFER_JIT_PYTHON_PLUGINS`` or creation fails.
    The parser passes a creator only the fields it declares, so these attributes never reach the plugin.
    ``domain``: None keeps the nodes' ``macattn`` domain (TensorRT's parser maps by ``op_type``);
    ``TRT_PLUGINS_DOMAIN`` (``"trt.plugins"``) moves them there and declares it in the opset imports, for ONNX
    Runtime's TensorRT execution provider and ModelOpt. ``ValueError`` naming ``domain`` otherwise."""
    namespace = NATIVE_NAMESPACE if _check_backend(backend) == "native" else PYTHON_NAMESPACE
    if domain not in (None, TRT_PLUGINS_DOMAIN):
        raise ValueError(f"domain must be None or {TRT_PLUGINS_DOMAIN!r}, got {domain!r}")
    model = onnx.load(str(src))
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type in TRT_PLUGINS:
            node.op_type = TRT_PLUGINS[node.op_type]
            attrs = [onnx.helper.make_attribute("plugin_namespace", namespace),
                     onnx.helper.make_attribute("plugin_version", PLUGIN_VERSION)]
            if backend == "python" and node.op_type in _AOT_PLUGINS:
                attrs.append(onnx.helper.make_attribute("aot", int(bool(aot))))
            node.attribute.extend(attrs)
            if domain is not None:
                node.domain = domain
    if domain is not None and all(o.domain != domain for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    onnx.save_model(model, str(dst))
    return dst


def network_flags(trt, backend: str = "native", aot: bool = True) -> int:
    """``create_network`` flags: ``STRONGLY_TYPED`` (TensorRT 10; always on and deprecated in 11, so not
    set there) — the graph's own dtypes are kept, no precision pass inserts a cast in front of an aliased
    ring — and, for the Python plugins, ``PREFER_AOT_PYTHON_PLUGINS`` (or ``..._JIT_...``) as the
    network-level choice for nodes without an ``aot`` attribute."""
    F = trt.NetworkDefinitionCreationFlag
    flags = 0
    if parse_version(trt.__version__)[0] < 11:
        flags |= 1 << int(F.STRONGLY_TYPED)
    if _check_backend(backend) == "python":
        flags |= 1 << int(F.PREFER_AOT_PYTHON_PLUGINS if aot else F.PREFER_JIT_PYTHON_PLUGINS)
    return flags


def _profile_range(axis: str, max_batch: int, max_context: int) -> tuple[int, int, int]:
    return {"batch": (1, max(1, max_batch // 2), max_batch),
            "num_slots": (1, max_batch, max_batch),
            "context": (1, min(max_context, 4096), max_context),
            "prompt": (2, min(max_context, 1024), max_context)}[axis]


def require_tensorrt_build(trt, backend: str = "native") -> tuple[int, ...]:
    """The TensorRT version tuple if ``trt`` can build this project's engines with ``backend``, else
    ``TensorRTVersionError`` naming what is missing: aliased plugin I/O (the rings) needs >= 10.3 and the
    preview feature ``ALIASED_PLUGIN_IO_10_03``; the Python plugins (AOT impls) need >= 10.9."""
    minimum = MIN_PYTHON_PLUGINS if _check_backend(backend) == "python" else MIN_TENSORRT
    have = require_version("tensorrt", trt.__version__, minimum,
                           f"the macattn engine build ({backend} plugins, aliased ring I/O)")
    if not hasattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03"):
        raise TensorRTVersionError(f"tensorrt {trt.__version__} has no PreviewFeature.ALIASED_PLUGIN_IO_10_03, "
                                   f"which the aliased ring I/O of mac::attend needs")
    return have


def build_tensorrt_engines(out: Path, dims: dict, *, max_batch: int, max_context: int,
                           plugin_library: str | None = None, backend: str = "native", aot: bool = True,
                           log=print) -> dict:
    """Build ``decode.plan`` and ``prefill.plan`` in ``out``; returns a manifest entry.

    ``backend``: ``"native"`` loads ``libmacattn_trt.so`` (``plugin_library``), ``"python"`` registers the
    ``tensorrt.plugin`` definitions (``aot``: their AOT impls, else JIT). Raises ``TensorRTVersionError``
    for a TensorRT too old for ``backend`` (``require_tensorrt_build``)."""
    import tensorrt as trt
    import torch

    require_tensorrt_build(trt, backend)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return {"status": "skipped", "reason": "an sm_90 GPU (H100/H200) is required to build for sm_90"}
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    lib = None
    if backend == "native":
        lib = Path(plugin_library) if plugin_library else default_plugin_library()
        if not lib.is_file():
            reason = (f"plugin library {lib} not found: build the mac::match / mac::attend TensorRT plugins "
                      f"and point $MACATTN_TRT_PLUGIN_LIBRARY at the .so")
            log(reason)
            return {"status": "skipped", "reason": reason}
    else:
        from macattn.plugins.tensorrt_plugins import register_all

        register_all()
    result = {"status": "built", "version": trt.__version__, "backend": backend,
              "plugin_library": str(lib) if lib else None, "engines": {}}
    if lib is not None:
        load_plugin_library(trt.get_plugin_registry(), lib)      # once per process, not per Builder
    for name in ("decode", "prefill"):
        builder = trt.Builder(logger)
        network = builder.create_network(network_flags(trt, backend, aot))
        parser = trt.OnnxParser(network, logger)
        trt_onnx = to_tensorrt_onnx(out / f"{name}.onnx", out / f"{name}.trt.onnx", backend, aot)
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
