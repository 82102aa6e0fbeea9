"""A recorder standing in for TensorRT's compiled core (``tensorrt.so``), for tests only.

TensorRT cannot be installed here, but the PyPI wheel ``tensorrt-cu12-bindings`` ships
TensorRT's plugin layer ``tensorrt_bindings/plugin/`` as pure Python. That layer imports
``tensorrt`` (the compiled core, which cannot load without TensorRT's libraries) and touches
only a small part of it: dimension expressions and their builder, data types, plugin fields
and field collections, the creator registry, the plugin interface base classes, a few enums.
This module is exactly that part, recording what is done with it, so the tests can load
**upstream's** ``tensorrt.plugin`` unchanged and drive the macattn plugin definitions
through it in TensorRT's call order (``TrtDriver``).

It never ran TensorRT and proves nothing about TensorRT's builder or runtime. It lives in
``tests/`` only (it is not importable from the ``macattn`` package) and is installed as
``sys.modules["tensorrt"]`` only for the duration of a test (``installed``).
"""
from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import itertools
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing  # noqa: F401  (upstream reads np.typing, which numpy exposes once imported)

BINDINGS_VERSION = "11.4.0.106"   # the tensorrt-cu12-bindings wheel whose plugin layer the tests run


def require_bindings() -> None:
    """Skip the calling test (``pytest.skip``) when the ``tensorrt-cu12-bindings`` wheel is absent: for the GPU
    tests, whose machine may lack the ``test`` extra (the CPU tests need the wheel and fail without it)."""
    if upstream_plugin_dir() is None:
        import pytest

        pytest.skip(f"tensorrt-cu12-bindings=={BINDINGS_VERSION} is not installed (pip install -e '.[test]')")


def upstream_plugin_dir() -> str | None:
    """Folder of the wheel's ``tensorrt_bindings`` package (holding ``plugin/``), or None when the wheel is absent.
    Found without importing it (its ``__init__`` loads the compiled core)."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


# ---------------------------------------------------------------- enums and data types
class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10


float32, float16, bfloat16, int8, int32, int64 = (DataType.FLOAT, DataType.HALF, DataType.BF16, DataType.INT8,
                                                  DataType.INT32, DataType.INT64)
uint8, fp8, int4, fp4 = DataType.UINT8, DataType.FP8, DataType.INT4, DataType.FP4

_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.INT64: np.int64, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8}


def nptype(trt_type):
    if trt_type in _NP:
        return _NP[trt_type]
    raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")


PluginFieldType = enum.Enum("PluginFieldType", "FLOAT16 FLOAT32 FLOAT64 INT8 INT16 INT32 CHAR DIMS UNKNOWN BF16 "
                                               "INT64 FP8 INT4 FP4")
DimensionOperation = enum.Enum("DimensionOperation", "SUM PROD MAX MIN SUB EQUAL LESS FLOOR_DIV CEIL_DIV")
TensorFormat = enum.Enum("TensorFormat", "LINEAR CHW2 HWC8 CHW4 CHW16 CHW32 DHWC8 CDHW32 HWC DLA_LINEAR DLA_HWC4 "
                                         "HWC16 DHWC")
TensorRTPhase = enum.Enum("TensorRTPhase", "BUILD RUNTIME")
QuickPluginCreationRequest = enum.Enum("QuickPluginCreationRequest", "UNKNOWN PREFER_JIT PREFER_AOT STRICT_JIT "
                                                                     "STRICT_AOT")
PluginArgType = enum.Enum("PluginArgType", "INT")
PluginArgDataType = enum.Enum("PluginArgDataType", "INT8 INT16 INT32")


class Logger:
    WARNING, INFO, ERROR, VERBOSE = "WARNING", "INFO", "ERROR", "VERBOSE"

    def __init__(self, *args):
        self.messages: list = []

    def log(self, severity, msg):
        self.messages.append((severity, msg))


# ---------------------------------------------------------------- dimension expressions
class IDimensionExpr:
    """A build-time constant (``value``) or a symbol (``name``, e.g. the dynamic ``B``)."""

    def __init__(self, value: int | None = None, name: str | None = None):
        self.value, self.name = value, name

    def is_constant(self):
        return self.value is not None

    def get_constant_value(self):
        if self.value is None:
            raise RuntimeError(f"{self.name} is not a constant")
        return self.value

    def __repr__(self):
        return f"Dim({self.value if self.value is not None else self.name})"


_OPS = {DimensionOperation.SUM: lambda a, b: a + b, DimensionOperation.PROD: lambda a, b: a * b,
        DimensionOperation.MAX: max, DimensionOperation.MIN: min, DimensionOperation.SUB: lambda a, b: a - b,
        DimensionOperation.EQUAL: lambda a, b: int(a == b), DimensionOperation.LESS: lambda a, b: int(a < b),
        DimensionOperation.FLOOR_DIV: lambda a, b: a // b, DimensionOperation.CEIL_DIV: lambda a, b: -(-a // b)}


class IExprBuilder:
    def __init__(self):
        self.ops: list = []

    def constant(self, v):
        return IDimensionExpr(int(v))

    def operation(self, op, a, b):
        self.ops.append((op, a, b))
        if a.is_constant() and b.is_constant():
            return IDimensionExpr(_OPS[op](a.value, b.value))
        if (op, b.value) in ((DimensionOperation.SUM, 0), (DimensionOperation.PROD, 1)):
            return a            # TensorRT folds identities too (upstream's clone is ``x + 0``)
        return IDimensionExpr(name=f"({a.name or a.value} {op.name} {b.name or b.value})")

    def declare_size_tensor(self, index, opt, upper):
        return IDimensionExpr(name=f"size_tensor{index}")


class ISymExpr:
    def __init__(self):
        pass


class Dims(list):
    MAX_DIMS = 8

    def __init__(self, arg=()):
        super().__init__([0] * arg if isinstance(arg, int) else list(arg))


class DimsExprs(list):
    def __init__(self, n=0):
        super().__init__([None] * n)


@dataclass
class PluginTensorDesc:
    dims: Any = None
    type: Any = None
    format: Any = TensorFormat.LINEAR
    scale: float = 1.0


@dataclass
class DynamicPluginTensorDesc:
    desc: PluginTensorDesc
    min: Any = None
    max: Any = None
    opt: Any = None


class ITensor:
    pass


# ---------------------------------------------------------------- plugin fields and registry
class PluginField:
    """``data`` reads back as a numpy array, as TensorRT's binding returns it (bytes as int8)."""

    def __init__(self, name, data=None, type=PluginFieldType.UNKNOWN):
        self.name, self.type = name, type
        self.data = np.frombuffer(data, dtype=np.int8) if isinstance(data, (bytes, bytearray)) else data


class PluginFieldCollection(list):
    pass


class IPluginCreatorV3Quick:
    def __init__(self):
        pass


class IPluginV3:
    def __init__(self):
        pass


class IPluginV3QuickCore:
    def __init__(self):
        pass


class IPluginV3QuickBuild:
    def __init__(self):
        pass


class IPluginV3QuickRuntime:
    def __init__(self):
        pass


class IPluginV3QuickAOTBuild:
    def __init__(self):
        pass


@dataclass
class PluginRegistry:
    """``register_creator`` returns False (and keeps the first) when a creator with the same name, version and
    namespace is registered, as TensorRT's registry does; ``refused`` records those calls."""

    creators: dict = field(default_factory=dict)
    refused: list = field(default_factory=list)

    def register_creator(self, creator, namespace=""):
        key = (creator.name, creator.plugin_version, namespace)
        if key in self.creators:
            self.refused.append(key)
            return False
        self.creators[key] = creator
        return True

    def get_creator(self, name, version, namespace=""):
        return self.creators.get((name, version, namespace))

    @property
    def all_creators(self):
        return list(self.creators.values())


_REGISTRY = PluginRegistry()


def get_plugin_registry():
    return _REGISTRY


# ---------------------------------------------------------------- install / uninstall
def _recorder_module(version: str) -> types.ModuleType:
    mod = types.ModuleType("tensorrt", __doc__)
    for name, val in globals().items():
        if not name.startswith("_") and name not in ("installed", "upstream_plugin_dir", "require_bindings", "TrtDriver",
                                                     "Placeholder"):
            setattr(mod, name, val)
    mod.__version__ = version
    mod.bool = DataType.BOOL            # TensorRT's name for it
    mod.__path__ = [upstream_plugin_dir()]      # so that ``tensorrt.plugin`` is upstream's package
    mod.get_plugin_registry = lambda: mod._registry
    mod._registry = PluginRegistry()
    return mod


@contextlib.contextmanager
def installed(version: str = BINDINGS_VERSION, with_plugin: bool = True):
    """``sys.modules["tensorrt"]`` = a fresh recorder (version ``version``) and ``tensorrt.plugin`` = upstream's
    plugin layer loaded over it; both removed afterwards (with every ``tensorrt.*`` module loaded meanwhile).
    Yields ``(trt, trtp)`` (``trtp`` None when ``with_plugin`` is False)."""
    if upstream_plugin_dir() is None:
        raise RuntimeError("tensorrt-cu12-bindings is not installed (pip install -e '.[test]')")
    saved = {k: v for k, v in sys.modules.items() if k == "tensorrt" or k.startswith("tensorrt.")}
    for k in saved:
        del sys.modules[k]
    trt = _recorder_module(version)
    sys.modules["tensorrt"] = trt
    try:
        trtp = importlib.import_module("tensorrt.plugin") if with_plugin else None
        yield trt, trtp
    finally:
        for k in [k for k in sys.modules if k == "tensorrt" or k.startswith("tensorrt.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# ---------------------------------------------------------------- TensorRT's call order
class Placeholder:
    """A dynamic dimension (``name``) of a network input."""

    def __init__(self, name: str):
        self.name = name


_counter = itertools.count()


class TrtDriver:
    """Drives one plugin through upstream's plugin layer in the order TensorRT's builder calls it.

    ``create``: the ONNX parser's path (``onnx-tensorrt`` ``importFallbackPluginImporter`` / ``createPlugin``):
    fields = the node attributes the creator declares, in the creator's declared field order (ONNX INT -> INT32,
    FLOAT -> FLOAT32), the request from the
    node's ``aot`` attribute if present, else from the network's PREFER_AOT / PREFER_JIT flags.
    ``build``: ``get_output_data_types`` (placeholder shapes), ``get_output_shapes`` (dim expressions),
    ``get_aliased_input``, ``get_supported_format_combinations``, ``configure_plugin``, ``get_valid_tactics``,
    ``set_tactic``, then for an AOT plugin ``get_launch_params`` + ``get_kernel``.
    """

    def __init__(self, trt, name: str, namespace: str, version: str = "1"):
        self.trt = trt
        self.creator = trt.get_plugin_registry().get_creator(name, version, namespace)
        if self.creator is None:
            raise LookupError(f"no creator {namespace}::{name} v{version} in the registry")
        self.name, self.namespace = name, namespace

    def create(self, attributes: dict, *, aot_attr=None, prefer_aot=False, prefer_jit=False):
        trt = self.trt
        fields = []
        # the parser walks the creator's declared fields, in their order, and takes each from the node's
        # attributes (whatever their order on the node); attributes the creator does not declare are not passed
        for declared in self.creator.field_names:
            key = declared.name
            if key not in attributes:
                continue
            val = attributes[key]
            if isinstance(val, float):
                fields.append(trt.PluginField(key, np.array([val], dtype=np.float32), trt.PluginFieldType.FLOAT32))
            elif isinstance(val, int):
                fields.append(trt.PluginField(key, np.array([val], dtype=np.int32), trt.PluginFieldType.INT32))
            else:
                fields.append(trt.PluginField(key, str(val).encode(), trt.PluginFieldType.CHAR))
        Q = trt.QuickPluginCreationRequest
        if aot_attr is not None:
            request = Q.STRICT_AOT if aot_attr else Q.STRICT_JIT
        elif prefer_aot and prefer_jit:
            raise ValueError("PREFER_AOT_PYTHON_PLUGINS and PREFER_JIT_PYTHON_PLUGINS both set")
        else:
            request = Q.PREFER_JIT if prefer_jit else (Q.PREFER_AOT if prefer_aot else Q.UNKNOWN)
        return self.creator.create_plugin(self.name, self.namespace, trt.PluginFieldCollection(fields),
                                          trt.TensorRTPhase.BUILD, request)

    def build(self, plugin, shapes, dtypes, *, concrete=None, tactic=0):
        """Returns a record dict: ``dtypes``, ``shapes`` (ints or symbol names), ``aliases``, ``kernel`` (AOT)."""
        trt = self.trt
        rec = {"output_dtypes": plugin.get_output_data_types(list(dtypes), [len(s) for s in shapes])}
        builder = trt.IExprBuilder()
        exprs = []
        for shape in shapes:
            d = trt.DimsExprs(len(shape))
            for j, x in enumerate(shape):
                d[j] = trt.IDimensionExpr(name=x.name) if isinstance(x, Placeholder) else builder.constant(x)
            exprs.append(d)
        out_exprs = plugin.get_output_shapes(exprs, [], builder)
        rec["output_shapes"] = [tuple(e.value if e.is_constant() else e.name for e in o) for o in out_exprs]
        n_out = plugin.get_num_outputs()
        rec["aliases"] = [plugin.get_aliased_input(i) for i in range(n_out)]
        concrete = concrete or {}
        conc = [[concrete[x.name] if isinstance(x, Placeholder) else x for x in s] for s in shapes]
        out_conc = [[concrete.get(x, x) if isinstance(x, str) else x for x in s] for s in rec["output_shapes"]]
        in_out = [trt.DynamicPluginTensorDesc(trt.PluginTensorDesc(trt.Dims(s), t)) for s, t in
                  zip(conc + out_conc, list(dtypes) + list(rec["output_dtypes"]))]
        combos = plugin.get_supported_format_combinations(in_out, len(shapes))
        rec["formats"] = [(c.type, c.format) for c in combos]
        plugin.configure_plugin(in_out[:len(shapes)], in_out[len(shapes):])
        rec["tactics"] = plugin.get_valid_tactics()
        plugin.set_tactic(tactic)
        if hasattr(plugin, "get_launch_params"):
            class _Launch:
                pass

            class _Setter(list):
                nbSymExprs = 0

                def __setitem__(self, i, v):
                    while len(self) <= i:
                        self.append(None)
                    list.__setitem__(self, i, v)

            launch, setter = _Launch(), _Setter()
            plugin.get_launch_params(exprs, in_out, len(shapes), launch, setter, builder)
            val = lambda s: s.expr.value if s.expr.is_constant() else s.expr.name  # noqa: E731
            rec["launch"] = {k: (v.value if v.is_constant() else v.name) for k, v in
                             ((k, getattr(launch, k).expr) for k in ("grid_x", "grid_y", "grid_z", "block_x",
                                                                      "block_y", "block_z", "shared_mem"))}
            rec["extra_args"] = [val(s) for s in setter]
            rec["extra_arg_types"] = [s.dtype for s in setter]
            name, ptx = plugin.get_kernel([d.desc for d in in_out[:len(shapes)]],
                                          [d.desc for d in in_out[len(shapes):]])
            rec["kernel"] = (name, ptx)
        else:
            rec["serialized_fields"] = {f.name: f.data for f in plugin.get_fields_to_serialize()}
        return rec
