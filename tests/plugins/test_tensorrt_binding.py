"""``register_all`` against a stand-in for ``tensorrt.plugin`` (TensorRT cannot be installed here):
every plugin registers a descriptor and a JIT impl (the MAC ops an AOT impl too) whose signatures
follow ``tensorrt.plugin``'s rules (tensors, then attributes, then ``outputs, stream`` / ``outputs,
tactic``; annotations are classes; an AOT impl's return annotation names the four results), the
descriptors infer the outputs (aliased where the op writes an input in place), the AOT impl hands
back the compiled image, and — on a GPU — the JIT impls write TensorRT's output buffers on its
stream with the launchers' results.
"""
from __future__ import annotations

import inspect
import sys
import types
import typing

import pytest
import torch

pytest.importorskip("triton")

from triton_env import INTERPRET  # noqa: E402
from mac_problem import Problem, _mixed_kinds  # noqa: E402


class TensorDesc:
    def __init__(self, shape, dtype, alias_of=None):
        self.shape_expr, self.dtype, self.alias_of = tuple(shape), dtype, alias_of

    def aliased(self):
        return TensorDesc(self.shape_expr, self.dtype, alias_of=self)


class Tensor:
    """A ``tensorrt.plugin.Tensor`` as its impl sees it: ``data_ptr``, ``shape``, ``strides`` (elements),
    ``dtype``; like TensorRT's, ``__cuda_array_interface__`` refuses BF16 (so the binding must not need it)."""

    def __init__(self, t: torch.Tensor):
        self.data_ptr, self.shape, self.strides, self.dtype = t.data_ptr(), tuple(t.shape), t.stride(), TRT[t.dtype]
        self._t = t

    @property
    def __cuda_array_interface__(self):
        if self.dtype == "trt.bfloat16":
            raise ValueError("Handling DataType.BF16 via '__cuda_array_interface__' is not supported")
        return self._t.__cuda_array_interface__


class KernelLaunchParams:
    grid_x = grid_y = grid_z = block_x = block_y = block_z = shared_mem = None


class SymExprs(list):
    pass


class SymIntExprs(SymExprs):
    def __init__(self, n):
        super().__init__([None] * n)


def _fake_tensorrt():
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.9.0.34"
    for name in ("float32", "float16", "bfloat16", "int64", "int32"):
        setattr(trt, name, f"trt.{name}")
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.registry = {"register": {}, "impl": {}, "aot_impl": {}}

    def decorator(kind):
        def register(plugin_id):
            def add(fn):
                trtp.registry[kind][plugin_id] = fn
                return fn
            return add
        return register

    trtp.register, trtp.impl, trtp.aot_impl = (decorator(k) for k in ("register", "impl", "aot_impl"))
    trtp.TensorDesc, trtp.Tensor, trtp.KernelLaunchParams = TensorDesc, Tensor, KernelLaunchParams
    trtp.SymExprs, trtp.SymIntExprs, trtp.SymInt32 = SymExprs, SymIntExprs, lambda e: ("SymInt32", e)
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(shape, dtype)
    trt.plugin = trtp
    return trt, trtp


@pytest.fixture()
def trtp(monkeypatch):
    from macattn.plugins import tensorrt_plugins

    trt, plugin = _fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    assert tensorrt_plugins.register_all() == ("mac_py::match", "mac_py::attend", "mac_py::route_fused",
                                               "mac_py::retrieval_completion", "mac_py::completion_cache")
    return plugin


TRT = {torch.float32: "trt.float32", torch.bfloat16: "trt.bfloat16", torch.int64: "trt.int64",
       torch.int32: "trt.int32", torch.float16: "trt.float16"}


def _descs(*tensors):
    return [TensorDesc(t.shape, TRT[t.dtype]) for t in tensors]


def test_registered_signatures_follow_tensorrt_plugin(trtp):
    reg = trtp.registry
    assert set(reg["register"]) == set(reg["impl"]) and set(reg["aot_impl"]) == {"mac_py::match", "mac_py::attend"}
    for pid, desc in reg["register"].items():
        sig = inspect.signature(desc)
        kinds = [p.annotation for p in sig.parameters.values()]
        n_tensors = kinds.count(TensorDesc)
        assert kinds[:n_tensors] == [TensorDesc] * n_tensors, pid          # tensors first
        assert all(k in (int, float) for k in kinds[n_tensors:]), pid     # then serializable attributes
        ret = sig.return_annotation
        assert ret is TensorDesc or all(a is TensorDesc for a in typing.get_args(ret)), pid
        names = list(sig.parameters)
        impl = inspect.signature(reg["impl"][pid])
        assert list(impl.parameters) == names + ["outputs", "stream"], pid
        assert [p.annotation for p in list(impl.parameters.values())[:n_tensors]] == [Tensor] * n_tensors, pid
        assert typing.get_args(impl.parameters["outputs"].annotation) == (Tensor,), pid
        assert impl.return_annotation is None, pid
        if pid in reg["aot_impl"]:
            aot = inspect.signature(reg["aot_impl"][pid])
            assert list(aot.parameters) == names + ["outputs", "tactic"], pid
            ret = typing.get_args(aot.return_annotation)
            assert len(ret) == 4 and ret[2] is KernelLaunchParams and issubclass(ret[3], SymExprs), pid
            assert all(set(typing.get_args(r)) == {str, bytes} for r in ret[:2]), pid


def _mac_problem():
    g = torch.Generator().manual_seed(4)
    return Problem(B=2, Hq=4, Hkv=2, d=16, K=32, band=8, tau=0.45, positions=[40, 71],
                   kinds=_mixed_kinds(2, 4, 2, g), gen=g)


def _route_fused_inputs(device):
    """x [3, 32], q [3, 16], router R=4, state S=5 rows, wk [12, 32], wv [8, 32] (``INPUTS`` order)."""
    g = torch.Generator().manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ins = (r(3, 32), r(3, 16), r(4, 16), r(4), r(3, 4), r(3), torch.tensor(0.5), r(5, 32),
           torch.randint(0, 9, (5,), generator=g), torch.tensor([4, 0, 2]), r(12, 32), r(12), r(8, 32), r(8))
    return tuple(t.to(device) for t in ins)


def test_descriptors_infer_and_alias(trtp):
    reg = trtp.registry["register"]
    pr = _mac_problem()
    match_pos = torch.zeros(2, 4, dtype=torch.int64)
    ins = _descs(pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions)
    mp, dist = reg["mac_py::match"](*ins, band=8, tau=0.45)
    assert (mp.shape_expr, mp.dtype, dist.shape_expr, dist.dtype) == ((2, 4), "trt.int64", (2, 4), "trt.float32")
    ins = _descs(pr.q, pr.q_pre, pr.k, pr.v, pr.positions, match_pos, pr.slots, *pr.rings())
    out, *rings = reg["mac_py::attend"](*ins, band=8, scale=0.25)
    assert (out.shape_expr, out.dtype, out.alias_of) == ((2, 4, 16), "trt.bfloat16", None)
    assert [r.alias_of for r in rings] == ins[7:]
    ins = _descs(*_route_fused_inputs("cpu"))
    k, v, lam, mean_out, count_out = reg["mac_py::route_fused"](*ins, mode=1, beta=0.9)
    assert [t.shape_expr for t in (k, v, lam)] == [(3, 12), (3, 8), (3, 3)]
    assert (mean_out.alias_of, count_out.alias_of) == (ins[7], ins[8])
    ins = _descs(torch.zeros(2, 5, 40, 8), torch.zeros(2, 5, 40, 16), torch.zeros(2, dtype=torch.int64))
    a, b, shift = reg["mac_py::completion_cache"](*ins, n_sink=2, n_tail=4)
    assert [t.shape_expr for t in (a, b, shift)] == [(2, 5, 8, 16), (2, 5, 8), (2, 5, 8)]
    with pytest.raises(TypeError, match="not supported by the macattn plugins"):
        reg["mac_py::completion_cache"](TensorDesc((2, 5, 40, 8), "trt.int8"), *ins[1:], n_sink=2, n_tail=4)


@pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET: kernels are interpreted, not compiled")
def test_aot_impl_returns_the_image(trtp):
    pr = _mac_problem()
    ins = _descs(pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions)
    name, ptx, launch, extra = trtp.registry["aot_impl"]["mac_py::match"](*ins, band=8, tau=0.45, outputs=(), tactic=0)
    assert name == "mac_match_onepass" and ".target sm_90" in ptx
    assert (launch.grid_x, launch.grid_y, launch.grid_z, launch.block_x) == (2, 4, 1, 128)
    assert list(extra) == [("SymInt32", 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_jit_impls_write_tensorrt_outputs_on_its_stream(trtp):
    from macattn.plugins.mac.attend_op import MacAttendLauncher
    from macattn.plugins.mac.match_op import MacMatchLauncher

    impl = trtp.registry["impl"]
    pr = _mac_problem().to("cuda")
    stream = torch.cuda.Stream()
    m_ins = (pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions)
    outs = (torch.full((2, 4), -7, dtype=torch.int64, device="cuda"), torch.full((2, 4), float("nan"), device="cuda"))
    impl["mac_py::match"](*map(Tensor, m_ins), 8, 0.45, outputs=tuple(map(Tensor, outs)), stream=stream.cuda_stream)
    stream.synchronize()
    want = MacMatchLauncher()(*m_ins, 8, 0.45)
    assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
    rings, ref_rings = pr.rings(), pr.rings()
    a_ins = (pr.q, pr.q_pre, pr.k, pr.v, pr.positions, want[0], pr.slots)
    out = torch.full((2, 4, 16), float("nan"), dtype=pr.q.dtype, device="cuda")
    impl["mac_py::attend"](*map(Tensor, a_ins + rings), 8, pr.scale, outputs=tuple(map(Tensor, (out, *rings))),
                        stream=stream.cuda_stream)
    stream.synchronize()
    ref = MacAttendLauncher()(*a_ins, *ref_rings, 8, pr.scale)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(rings, ref_rings))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_route_fused_impl_writes_outputs_and_aliased_state(trtp):
    from macattn.plugins.route_fused.op import route_fused_attention_triton

    ins, ref = _route_fused_inputs("cuda"), list(_route_fused_inputs("cuda"))
    outs = (torch.full((3, 12), float("nan"), device="cuda"), torch.full((3, 8), float("nan"), device="cuda"),
            torch.full((3, 3), float("nan"), device="cuda"))
    stream = torch.cuda.Stream()
    trtp.registry["impl"]["mac_py::route_fused"](*map(Tensor, ins), 1, 0.9,
                                              outputs=tuple(map(Tensor, (*outs, ins[7], ins[8]))),
                                              stream=stream.cuda_stream)
    stream.synchronize()
    want = route_fused_attention_triton(*ref, 1, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(outs, want))
    assert torch.equal(ins[7], ref[7]) and torch.equal(ins[8], ref[8])   # the state, updated in place
