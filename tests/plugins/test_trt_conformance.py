"""Our TensorRT plugin definitions driven through **upstream's** ``tensorrt.plugin`` (the pure-Python plugin
layer of the ``tensorrt-cu12-bindings`` wheel, pinned in the ``test`` extra) over a recorder of TensorRT's
compiled core (``trt_recorder``), in TensorRT's call order: registration, output dtypes on placeholder
shapes, output shapes on dim expressions, aliasing, format combinations, tactics, AOT launch parameters
and kernel, JIT serialized fields, and the ONNX parser's attribute handling.

What this proves: upstream's plugin-layer code accepts our definitions and returns what we declare.
What it does not: no TensorRT builder, parser or runtime ran (the recorder stands in for the compiled core).

Rows of issue 22 these tests pin (each failed on c459ac9): P1 version gate, P3 placeholder shapes,
P4 AOT with dynamic dims, P5 AOT/JIT choice from the ONNX node, P15 re-registration, P16 native/Python
namespace clash.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import onnx
import pytest
import torch

import trt_recorder as R
from triton_env import INTERPRET

ROOT = Path(__file__).resolve().parents[2]
B, S = R.Placeholder("B"), R.Placeholder("S")


@pytest.fixture()
def trt(monkeypatch):
    """(recorder, upstream tensorrt.plugin) with ``register_all`` done; fresh per test."""
    from macattn.plugins import tensorrt_plugins

    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    with R.installed() as (trt, trtp):
        ids = tensorrt_plugins.register_all()
        trt.ids, trt.trtp = ids, trtp
        yield trt


def _match_io(trt, dtype=None):
    dtype = dtype or trt.bfloat16
    return ([(B, 8, 64), (S, 8, 32, 64), (S, 8, 32), (S, 32), (B,), (B,)],
            [dtype, dtype, trt.float32, trt.int64, trt.int64, trt.int64])


def _attend_io(trt):
    return ([(B, 8, 64), (B, 8, 64), (B, 2, R.Placeholder("T"), 64), (B, 2, R.Placeholder("T"), 64), (B,), (B, 8),
             (B,), (S, 8, 32, 64), (S, 8, 32, 64), (S, 8, 32), (S, 32)],
            [trt.bfloat16] * 4 + [trt.int64] * 3 + [trt.bfloat16, trt.float32, trt.float32, trt.int64])


def test_the_pinned_wheel_is_what_runs():
    assert importlib.metadata.version("tensorrt-cu12-bindings") == R.BINDINGS_VERSION
    with R.installed() as (trt, trtp):
        assert Path(trtp.__file__).parent == Path(R.upstream_plugin_dir()) / "plugin"
        assert trtp.aot_impl and trtp.KernelLaunchParams and trt.__version__ == R.BINDINGS_VERSION


def test_p1_python_plugins_gate_tensorrt_10_9(monkeypatch):
    """aot_impl / KernelLaunchParams first ship in 10.9 (the 10.8.0.43 wheel has neither)."""
    from macattn.plugins import tensorrt_plugins
    from macattn.plugins.trt_compat import TensorRTVersionError

    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    with R.installed(version="10.8.0.43", with_plugin=False):
        with pytest.raises(TensorRTVersionError, match=r"tensorrt >= 10\.9; found tensorrt 10\.8\.0\.43"):
            tensorrt_plugins.register_all()
    with R.installed(version="10.9.0.34") as (trt, _):
        assert tensorrt_plugins.register_all()[0] == "mac_py::match"


def test_p2_every_plugin_registers_through_upstream(trt):
    from tensorrt.plugin import _lib

    assert trt.ids == ("mac_py::match", "mac_py::attend", "mac_py::route_fused", "mac_py::retrieval_completion",
                       "mac_py::completion_cache")
    reg = trt.get_plugin_registry()
    assert sorted(reg.creators) == sorted((i.split("::")[1], "1", "mac_py") for i in trt.ids)
    fields = {f.name: f.type for f in reg.get_creator("match", "1", "mac_py").field_names}
    assert fields == {"band": trt.PluginFieldType.INT64, "tau": trt.PluginFieldType.FLOAT64}
    for pid in trt.ids:
        d = _lib.QDP_REGISTRY[pid]
        assert d.impl_func is not None, pid
        assert (d.aot_impl_func is not None) == (pid.split("::")[1] in ("match", "attend")), pid


def test_p3_output_dtypes_on_placeholder_shapes(trt):
    """TensorRT asks output dtypes first, with fake shape expressions whose ``is_constant`` raises."""
    drv = R.TrtDriver(trt, "match", "mac_py")
    plugin = drv.create({"band": 8, "tau": 0.45}, aot_attr=0)
    shapes, dtypes = _match_io(trt)
    assert plugin.get_output_data_types(dtypes, [len(s) for s in shapes]) == [trt.int64, trt.float32]
    shapes, dtypes = _attend_io(trt)
    plugin = R.TrtDriver(trt, "attend", "mac_py").create({"band": 8, "scale": 0.125}, aot_attr=0)
    assert plugin.get_output_data_types(dtypes, [len(s) for s in shapes]) == [trt.bfloat16, trt.bfloat16,
                                                                              trt.float32, trt.float32, trt.int64]
    cache = R.TrtDriver(trt, "completion_cache", "mac_py").create({"n_sink": 2, "n_tail": 4})
    assert cache.get_output_data_types([trt.float32, trt.bfloat16, trt.int64], [4, 4, 1]) == [trt.float32] * 3
    with pytest.raises(TypeError, match="qring must be one of"):
        R.TrtDriver(trt, "match", "mac_py").create({"band": 8, "tau": 0.45}, aot_attr=0).get_output_data_types(
            [trt.bfloat16, trt.int32, trt.float32, trt.int64, trt.int64, trt.int64], [3, 4, 3, 2, 1, 1])


def test_jit_build_sequence_shapes_aliases_fields(trt):
    shapes, dtypes = _match_io(trt)
    drv = R.TrtDriver(trt, "match", "mac_py")
    rec = drv.build(drv.create({"band": 8, "tau": 0.45}, aot_attr=0), shapes, dtypes, concrete={"B": 2, "S": 3})
    assert rec["output_shapes"] == [("B", 8), ("B", 8)] and rec["aliases"] == [-1, -1]
    assert [t for t, _ in rec["formats"]] == dtypes + [trt.int64, trt.float32]
    assert set(rec["serialized_fields"]) == {"band", "tau"}
    assert rec["serialized_fields"]["band"][0] == 8 and abs(rec["serialized_fields"]["tau"][0] - 0.45) < 1e-7
    shapes, dtypes = _attend_io(trt)
    drv = R.TrtDriver(trt, "attend", "mac_py")
    rec = drv.build(drv.create({"band": 8, "scale": 0.125}, aot_attr=0), shapes, dtypes,
                    concrete={"B": 2, "S": 3, "T": 40})
    assert rec["aliases"] == [-1, 7, 8, 9, 10]               # the four rings update in place
    assert rec["output_shapes"] == [("B", 8, 64), ("S", 8, 32, 64), ("S", 8, 32, 64), ("S", 8, 32), ("S", 32)]
    x = [(B, 32), (B, 16), (4, 16), (4,), (3, 4), (3,), (), (S, 32), (S,), (B,), (12, 32), (12,), (8, 32), (8,)]
    dt = [trt.float32] * 7 + [trt.float32, trt.int64, trt.int64] + [trt.float32] * 4
    drv = R.TrtDriver(trt, "route_fused", "mac_py")
    rec = drv.build(drv.create({"mode": 1, "beta": 0.9}), x, dt, concrete={"B": 3, "S": 5})
    assert rec["aliases"] == [-1, -1, -1, 7, 8] and rec["output_shapes"][:3] == [("B", 12), ("B", 8), ("B", 3)]


@pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET: kernels are interpreted, not compiled")
def test_p4_aot_image_with_dynamic_batch(trt):
    """The AOT impl runs with ``ShapeExpr`` dims (unhashable: ``__eq__`` without ``__hash__``) in its grid."""
    shapes, dtypes = _match_io(trt)
    drv = R.TrtDriver(trt, "match", "mac_py")
    rec = drv.build(drv.create({"band": 8, "tau": 0.45}, aot_attr=1), shapes, dtypes, concrete={"B": 2, "S": 3})
    # item 10 of issue 36: B + (B == 0) programs, never an empty grid (B = 0: a TRT-LLM step without generation)
    assert rec["launch"] == {"grid_x": "(B SUM (B EQUAL 0))", "grid_y": 8, "grid_z": 1, "block_x": 128, "block_y": 1, "block_z": 1,
                             "shared_mem": rec["launch"]["shared_mem"]}
    assert rec["extra_args"] == ["B"] and rec["extra_arg_types"] == [trt.PluginArgDataType.INT32]
    name, ptx = rec["kernel"]
    assert name == "mac_match_onepass" and b".target sm_90" in ptx and b".entry mac_match_onepass" in ptx
    shapes, dtypes = _attend_io(trt)
    drv = R.TrtDriver(trt, "attend", "mac_py")
    rec = drv.build(drv.create({"band": 8, "scale": 0.125}, aot_attr=1), shapes, dtypes,
                    concrete={"B": 2, "S": 3, "T": 40})
    assert rec["aliases"] == [-1, 7, 8, 9, 10]
    assert (rec["launch"]["grid_x"], rec["launch"]["grid_y"]) == ("(B SUM (B EQUAL 0))", 2)
    assert rec["extra_args"] == ["B", "T"]
    assert rec["kernel"][0] == "mac_attend_onepass"


@pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET: kernels are interpreted, not compiled")
def test_p4_compile_image_takes_upstream_shape_exprs(trt):
    from macattn.plugins.mac.match_plugin import match_aot_image
    from tensorrt.plugin import ShapeExpr
    from tensorrt.plugin._tensor import SymIntExpr

    builder = trt.IExprBuilder()
    SymIntExpr._exprBuilder = builder
    try:
        b = ShapeExpr(trt.IDimensionExpr(name="B"))
        dims = [(b, ShapeExpr(8), ShapeExpr(64)), (ShapeExpr(3), 8, 32, 64), (3, 8, 32), (3, 32), (b,), (b,)]
        image = match_aot_image(dims, [torch.bfloat16, torch.bfloat16, torch.float32] + [torch.int64] * 3,
                                band=8, tau=0.45)
    finally:
        SymIntExpr._exprBuilder = None
    assert image.grid[0] is b and image.grid[1:] == (8, 1)


@pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET: kernels are interpreted, not compiled")
def test_item10_aot_launch_never_has_an_empty_grid():
    from types import SimpleNamespace

    from macattn.plugins.mac.match_plugin import match_aot_image
    from macattn.plugins.tensorrt_plugins import image_to_tensorrt

    trtp = SimpleNamespace(KernelLaunchParams=SimpleNamespace, SymIntExprs=lambda n: [None] * n, SymInt32=int)
    for B, programs in ((0, 1), (1, 1), (5, 5)):
        img = match_aot_image([(B, 8, 64), (3, 8, 32, 64), (3, 8, 32), (3, 32), (B,), (B,)],
                              [torch.bfloat16, torch.bfloat16, torch.float32] + [torch.int64] * 3, band=8, tau=0.45)
        _, _, launch, extra = image_to_tensorrt(trtp, img)
        assert (launch.grid_x, launch.grid_y, extra) == (programs, 8, [B])


def _trt_onnx(tmp_path, backend):
    from macattn.builder.onnx_ops import DOMAIN, MAC_MATCH
    from macattn.builder.tensorrt_build import to_tensorrt_onnx

    h = onnx.helper
    node = h.make_node(MAC_MATCH, ["q_pre", "qring", "ring_lse", "ring_pos", "slots", "positions"],
                       ["match_pos", "dist"], domain=DOMAIN, band=8, tau=0.45)
    graph = h.make_graph([node], "g", [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in node.input],
                         [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in node.output])
    src = tmp_path / "m.onnx"
    onnx.save_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)]), src)
    out = onnx.load(str(to_tensorrt_onnx(src, tmp_path / f"m.{backend}.trt.onnx", backend)))
    (n,) = out.graph.node
    return n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}


def test_p5_onnx_node_chooses_aot_for_the_python_plugins(trt, tmp_path):
    """Both impls defined: upstream refuses to choose unless the node says ``aot`` or the network prefers one."""
    op, attrs = _trt_onnx(tmp_path, "python")
    assert op == "match" and attrs["plugin_namespace"] == b"mac_py" and attrs["aot"] == 1
    drv = R.TrtDriver(trt, op, attrs["plugin_namespace"].decode(), attrs["plugin_version"].decode())
    with pytest.raises(ValueError, match="has both AOT and JIT implementations"):
        drv.create({k: v for k, v in attrs.items() if k != "aot"})       # what the parser hit before
    plugin = drv.create(attrs, aot_attr=attrs["aot"])
    assert type(plugin).__name__ == "_TemplateAOTPlugin"
    assert plugin.attrs == {"band": 8, "tau": pytest.approx(0.45)}     # aot / plugin_* are not fields
    assert type(drv.create(attrs, prefer_jit=True)).__name__ == "_TemplateJITPlugin"
    op, attrs = _trt_onnx(tmp_path, "native")
    assert attrs == {"band": 8, "tau": pytest.approx(0.45), "plugin_namespace": b"mac", "plugin_version": b"1"}


def test_network_flags_and_build_version_gates():
    from types import SimpleNamespace

    from macattn.builder.tensorrt_build import network_flags, require_tensorrt_build
    from macattn.plugins.trt_compat import TensorRTVersionError

    F = SimpleNamespace(STRONGLY_TYPED=1, PREFER_AOT_PYTHON_PLUGINS=2, PREFER_JIT_PYTHON_PLUGINS=3)
    P = SimpleNamespace(ALIASED_PLUGIN_IO_10_03=0)
    trt = lambda v: SimpleNamespace(__version__=v, NetworkDefinitionCreationFlag=F, PreviewFeature=P)  # noqa: E731
    assert network_flags(trt("10.9.0.34")) == 1 << 1
    assert network_flags(trt("10.9.0.34"), "python") == (1 << 1) | (1 << 2)
    assert network_flags(trt("11.4.0.106"), "python", aot=False) == 1 << 3     # strongly typed is always on in 11
    with pytest.raises(ValueError, match="backend must be one of"):
        network_flags(trt("11.4.0.106"), "onnx")
    assert require_tensorrt_build(trt("10.3.0"))[:2] == (10, 3)
    with pytest.raises(TensorRTVersionError, match=r"tensorrt >= 10\.3; found tensorrt 10\.2\.0"):
        require_tensorrt_build(trt("10.2.0"))
    with pytest.raises(TensorRTVersionError, match=r"tensorrt >= 10\.9; found tensorrt 10\.8\.0\.43"):
        require_tensorrt_build(trt("10.8.0.43"), "python")
    with pytest.raises(TensorRTVersionError, match="ALIASED_PLUGIN_IO_10_03"):
        require_tensorrt_build(SimpleNamespace(__version__="10.5.0", PreviewFeature=SimpleNamespace()))


def test_p15_register_all_again_after_a_failure(monkeypatch):
    """A first ``register_all`` that fails part way (here: the third plugin) must not block a retry."""
    from macattn.plugins import tensorrt_plugins
    from macattn.plugins.route_fused import plugin as route_plugin

    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    real = route_plugin.register_tensorrt

    def broken(binding):
        raise RuntimeError("injected: route_fused failed to register")

    with R.installed() as (trt, trtp):
        monkeypatch.setattr(route_plugin, "register_tensorrt", broken)
        with pytest.raises(RuntimeError, match="injected"):
            tensorrt_plugins.register_all()
        assert trtp.op.mac_py.match is not None        # match and attend are defined already
        monkeypatch.setattr(route_plugin, "register_tensorrt", real)
        ids = tensorrt_plugins.register_all()
        assert len(ids) == 5 and not trt.get_plugin_registry().refused
        monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)      # e.g. a reloaded module
        assert tensorrt_plugins.register_all() == ids


def test_p16_python_plugins_and_native_library_coexist(monkeypatch):
    """``libmacattn_trt.so`` registers match/attend in its namespace; the Python plugins must not collide."""
    from macattn.plugins import tensorrt_plugins
    from macattn.plugins.trt_compat import NATIVE_NAMESPACE, PYTHON_NAMESPACE

    header = (ROOT / "plugins" / "trt_plugin_common.h").read_text()
    assert re.search(r'kPluginNamespace\[\] = "([^"]+)"', header).group(1) == NATIVE_NAMESPACE != PYTHON_NAMESPACE
    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    with R.installed() as (trt, _):
        reg = trt.get_plugin_registry()
        native = {}
        for name in ("match", "attend"):        # what loading the native library registers
            native[name] = type("NativeCreator", (), {"name": name, "plugin_version": "1"})()
            assert reg.register_creator(native[name], NATIVE_NAMESPACE)
        tensorrt_plugins.register_all()
        assert reg.refused == []
        assert reg.get_creator("match", "1", NATIVE_NAMESPACE) is native["match"]
        assert reg.get_creator("match", "1", PYTHON_NAMESPACE) is not native["match"]


def test_recorder_is_not_importable_from_the_package():
    import macattn

    pkg = Path(macattn.__file__).resolve().parent
    assert not list(pkg.rglob("trt_recorder*"))
    assert "trt_recorder" not in "".join(p.read_text() for p in pkg.rglob("*.py"))


@pytest.fixture()
def trt_gpu(monkeypatch):
    """``trt`` for the GPU tests: skipped (not errored) where the bindings wheel is not installed."""
    R.require_bindings()
    from macattn.plugins import tensorrt_plugins

    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    with R.installed() as (trt, trtp):
        tensorrt_plugins.register_all()
        yield trt


def test_item9_gpu_tests_skip_without_the_bindings_wheel(monkeypatch):
    monkeypatch.setattr(R, "upstream_plugin_dir", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="tensorrt-cu12-bindings"):
        R.require_bindings()


def test_item9_parser_passes_fields_in_the_creators_order(trt, tmp_path):
    """The ONNX parser walks the creator's declared fields (``band``, ``tau``), not the node's attribute order; our
    exporter writes ``tau`` before ``band``. Upstream's AOT plugin takes the fields positionally, so a stand-in
    passing them in node order handed ``aot_impl`` band=0.45, tau=8."""
    from macattn.builder.onnx_ops import DOMAIN, MAC_MATCH
    from macattn.builder.tensorrt_build import to_tensorrt_onnx

    h = onnx.helper
    node = h.make_node(MAC_MATCH, ["q_pre", "qring", "ring_lse", "ring_pos", "slots", "positions"],
                       ["match_pos", "dist"], domain=DOMAIN)
    node.attribute.extend([h.make_attribute("tau", 0.45), h.make_attribute("band", 8)])    # the exporter's order
    graph = h.make_graph([node], "g", [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in node.input],
                         [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in node.output])
    src = tmp_path / "m.onnx"
    onnx.save_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)]), src)
    (n,) = onnx.load(str(to_tensorrt_onnx(src, tmp_path / "m.trt.onnx", "python"))).graph.node
    attrs = {a.name: h.get_attribute_value(a) for a in n.attribute}
    assert list(attrs)[:2] == ["tau", "band"]
    drv = R.TrtDriver(trt, n.op_type, "mac_py")
    plugin = drv.create(attrs, aot_attr=attrs["aot"])
    assert plugin.attrs == {"band": 8, "tau": pytest.approx(0.45)}
    assert isinstance(plugin.attrs["band"], int)
    if not INTERPRET:
        shapes, dtypes = _match_io(trt)
        rec = drv.build(plugin, shapes, dtypes, concrete={"B": 2, "S": 3})
        assert rec["kernel"][0] == "mac_match_onepass"


def test_item9_bf16_enqueue_memory_wrapper_on_the_cpu():
    """``PluginBinding.as_torch`` presents TensorRT's bf16 buffer (refused by ``__cuda_array_interface__``) as int16
    memory with byte strides and views it as bf16. The same interface read by numpy over CPU memory gives back the
    tensor, strides included (a transposed view)."""
    import numpy as np

    from macattn.plugins.tensorrt_plugins import _CudaMemory

    x = torch.randn(4, 6, dtype=torch.float32).to(torch.bfloat16).t()          # [6, 4], strides (1, 6)
    mem = _CudaMemory(x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.element_size())
    iface = dict(mem.__cuda_array_interface__)
    assert (iface["typestr"], iface["strides"], iface["shape"], iface["version"]) == ("<i2", (2, 12), (6, 4), 3)
    iface.pop("stream")
    arr = np.asarray(type("Host", (), {"__array_interface__": iface})())
    assert torch.equal(torch.from_numpy(arr.copy()).view(torch.bfloat16), x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_p6_jit_enqueue_bf16_through_upstream(trt_gpu):
    """Upstream's ``_TemplateJITPlugin.enqueue`` hands our impl ``tensorrt.plugin.Tensor``s whose
    ``__cuda_array_interface__`` refuses BF16; the impl must still run the launcher into TensorRT's buffers."""
    trt = trt_gpu
    from mac_problem import Problem, _mixed_kinds
    from macattn.plugins.mac.match_op import MacMatchLauncher

    g = torch.Generator().manual_seed(4)
    pr = Problem(B=2, Hq=4, Hkv=2, d=16, K=32, band=8, tau=0.45, positions=[40, 71], kinds=_mixed_kinds(2, 4, 2, g),
                 gen=g).to("cuda")
    ins = (pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions)
    assert pr.q_pre.dtype == torch.bfloat16
    dt = {torch.bfloat16: trt.bfloat16, torch.float32: trt.float32, torch.int64: trt.int64}
    drv = R.TrtDriver(trt, "match", "mac_py")
    plugin = drv.create({"band": 8, "tau": 0.45}, aot_attr=0)
    drv.build(plugin, [tuple(t.shape) for t in ins], [dt[t.dtype] for t in ins])
    outs = (torch.full((2, 4), -7, dtype=torch.int64, device="cuda"), torch.full((2, 4), float("nan"), device="cuda"))
    desc = lambda t: trt.PluginTensorDesc(trt.Dims(tuple(t.shape)), dt[t.dtype])  # noqa: E731
    stream = torch.cuda.Stream()
    plugin.enqueue([desc(t) for t in ins], [desc(t) for t in outs], [t.data_ptr() for t in ins],
                   [t.data_ptr() for t in outs], [trt.Dims(t.stride()) for t in ins],
                   [trt.Dims(t.stride()) for t in outs], stream.cuda_stream)
    stream.synchronize()
    want = MacMatchLauncher()(*ins, 8, 0.45)
    assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
    with pytest.raises(ValueError, match="BF16"):
        from tensorrt.plugin import Tensor

        t = Tensor()
        t.dtype = trt.bfloat16
        t.__cuda_array_interface__


@pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET: kernels are interpreted, not compiled")
def test_item8_aot_images_pin_triton_and_the_cu12_ptx_isa():
    """Issue 36 item 8: left to itself Triton 3.9.0 writes PTX ISA 9.4 (CUDA 13.4 drivers only); the images pin
    ISA 8.0 (sm_90a's minimum, CUDA 12.0+ drivers) and Triton's ptxas still assembles them."""
    import triton

    from macattn.plugins.aot import AOT_PTX_ISA, AOT_TRITON_VERSIONS, HIDDEN_PARAMS
    from macattn.plugins.mac.attend_plugin import attend_aot_image
    from macattn.plugins.mac.match_plugin import match_aot_image

    assert triton.__version__ in AOT_TRITON_VERSIONS and AOT_PTX_ISA == "8.0"
    img = match_aot_image([(2, 8, 64), (3, 8, 32, 64), (3, 8, 32), (3, 32), (2,), (2,)],
                          [torch.bfloat16, torch.bfloat16, torch.float32] + [torch.int64] * 3, band=8, tau=0.45)
    att = attend_aot_image([(2, 8, 64), (2, 8, 64), (2, 2, 40, 64), (2, 2, 40, 64), (2,), (2, 8), (2,),
                            (3, 8, 32, 64), (3, 8, 32, 64), (3, 8, 32), (3, 32)],
                           [torch.bfloat16] * 4 + [torch.int64] * 3 + [torch.bfloat16, torch.float32, torch.float32,
                                                                       torch.int64], band=8, scale=0.125)
    for image in (img, att):
        assert re.search(r"^\.version (\S+)", image.ptx, re.M).group(1) == "8.0" and ".target sm_90a" in image.ptx
        assert image.cubin                      # ptxas accepted the pinned ISA
    assert img.num_params == len(img.spec.signature) + HIDDEN_PARAMS


def test_item10_plugin_library_loads_once_per_process(monkeypatch, tmp_path):
    """TensorRT's registry is a process singleton and refuses a second load of one library: one load per process,
    whatever the number of Builders / plans; a refusal names the library."""
    from macattn.plugins import trt_compat

    monkeypatch.setattr(trt_compat, "_LOADED_LIBRARIES", {})
    lib = tmp_path / "libmacattn_trt.so"
    calls = []
    registry = type("Registry", (), {"load_library": lambda self, p: calls.append(p) or "handle"})()
    assert trt_compat.load_plugin_library(registry, lib) == "handle"
    assert trt_compat.load_plugin_library(registry, str(lib)) == "handle" and len(calls) == 1
    refusing = type("Registry", (), {"load_library": lambda self, p: None})()
    with pytest.raises(RuntimeError, match="libother.so"):
        trt_compat.load_plugin_library(refusing, tmp_path / "libother.so")


def test_item10_export_into_the_trt_plugins_domain(tmp_path):
    """ONNX Runtime's TensorRT execution provider and ModelOpt look for plugin nodes in the ``trt.plugins`` domain."""
    from macattn.builder.tensorrt_build import TRT_PLUGINS_DOMAIN, to_tensorrt_onnx

    _trt_onnx(tmp_path, "native")                    # writes m.onnx
    out = onnx.load(str(to_tensorrt_onnx(tmp_path / "m.onnx", tmp_path / "d.onnx", "python",
                                         domain=TRT_PLUGINS_DOMAIN)))
    (n,) = out.graph.node
    assert (n.domain, n.op_type) == ("trt.plugins", "match")
    assert ("trt.plugins", 1) in [(o.domain, o.version) for o in out.opset_import]
    (n,) = onnx.load(str(to_tensorrt_onnx(tmp_path / "m.onnx", tmp_path / "k.onnx", "native"))).graph.node
    assert n.domain == "macattn"                     # default unchanged
    with pytest.raises(ValueError, match="domain"):
        to_tensorrt_onnx(tmp_path / "m.onnx", tmp_path / "x.onnx", "native", domain="ai.onnx")
