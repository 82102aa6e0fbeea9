"""TensorRT plugin definitions without TensorRT: shape/dtype inference, attributes and I/O
order against the ONNX schemas, the AOT images compiled for sm_90 on this CPU machine, and
the import guard."""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from macattn.plugins.mac import attend_plugin
from macattn.plugins.mac import match_plugin

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64


class Dyn:
    """A dynamic TensorRT dim stand-in for the inference functions: not a build-time constant."""

    is_constant = False

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


B, S, T = Dyn("B"), Dyn("S"), Dyn("T")


def match_io(Hq=32, K=1024, d=128, dt=BF16):
    return [(B, Hq, d), (S, Hq, K, d), (S, Hq, K), (S, K), (B,), (B,)], [dt, dt, F32, I64, I64, I64]


def attend_io(Hq=32, Hkv=8, K=1024, d=128, dt=BF16):
    shapes = [(B, Hq, d), (B, Hq, d), (B, Hkv, T, d), (B, Hkv, T, d), (B,), (B, Hq), (B,),
              (S, Hq, K, d), (S, Hq, K, d), (S, Hq, K), (S, K)]
    return shapes, [dt, dt, dt, dt, I64, I64, I64, dt, F32, F32, I64]


def test_match_output_specs_keep_dynamic_dims():
    shapes, dtypes = match_io()
    (mp_shape, mp_dt), (d_shape, d_dt) = match_plugin.match_output_specs(shapes, dtypes, band=256, tau=0.45)
    assert mp_shape == (B, 32) and d_shape == (B, 32)
    assert mp_shape[0] is B
    assert (mp_dt, d_dt) == (I64, F32)


def test_attend_output_specs_alias_the_rings():
    shapes, dtypes = attend_io(Hq=28, Hkv=4)
    specs = attend_plugin.attend_output_specs(shapes, dtypes, band=256, scale=128 ** -0.5)
    assert [s.alias_of for s in specs] == [None, 7, 8, 9, 10]
    assert specs[0].shape == (B, 28, 128) and specs[0].dtype == BF16
    for s in specs[1:]:
        assert s.shape == tuple(shapes[s.alias_of]) and s.dtype == dtypes[s.alias_of]


@pytest.mark.parametrize("index,bad,match", [
    (1, (S, 16, 1024, 128), "qring"),               # Hq differs from q_pre
    (2, (S, 32, 512), "ring_lse"),                  # K differs
    (3, (S, 1024, 1), "ring_pos must have rank 2"),
    (4, (7,), None),                                # static 7 vs dynamic B: checked by TensorRT at run time
])
def test_match_rejects_misfit_shapes(index, bad, match):
    shapes, dtypes = match_io()
    shapes[index] = bad
    if match is None:
        match_plugin.match_output_specs(shapes, dtypes, band=1, tau=0.5)
        return
    with pytest.raises(ValueError, match=match):
        match_plugin.match_output_specs(shapes, dtypes, band=1, tau=0.5)


@pytest.mark.parametrize("index,dtype,match", [(0, I64, "q_pre"), (2, torch.float16, "ring_lse"),
                                               (3, torch.int32, "ring_pos"), (5, F32, "positions")])
def test_match_rejects_dtypes(index, dtype, match):
    shapes, dtypes = match_io()
    dtypes[index] = dtype
    with pytest.raises(TypeError, match=match):
        match_plugin.match_output_specs(shapes, dtypes, band=1, tau=0.5)


@pytest.mark.parametrize("kw,match", [({"band": -1, "tau": 0.5}, "band"), ({"band": 2, "tau": 1.0}, "tau"),
                                      ({"band": True, "tau": 0.5}, "band"), ({"band": 2, "tau": -0.1}, "tau")])
def test_match_rejects_attributes(kw, match):
    with pytest.raises(ValueError, match=match):
        match_plugin.match_output_specs(*match_io(), **kw)


def test_attend_rejects_bad_inputs():
    shapes, dtypes = attend_io(Hq=30, Hkv=8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attend_plugin.attend_output_specs(shapes, dtypes, band=8, scale=0.1)
    shapes, dtypes = attend_io()
    dtypes[8] = BF16
    with pytest.raises(TypeError, match="oring"):
        attend_plugin.attend_output_specs(shapes, dtypes, band=8, scale=0.1)
    shapes, dtypes = attend_io()
    dtypes[2] = torch.float16
    with pytest.raises(TypeError, match="share a dtype"):
        attend_plugin.attend_output_specs(shapes, dtypes, band=8, scale=0.1)
    shapes, dtypes = attend_io()
    shapes[5] = (B, 16)
    with pytest.raises(ValueError, match="match_pos"):
        attend_plugin.attend_output_specs(shapes, dtypes, band=8, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        attend_plugin.attend_output_specs(*attend_io(), band=8, scale=float("nan"))


def test_plugin_io_and_attributes_match_the_onnx_schemas():
    from macattn.builder.onnx_ops import _schemas
    from macattn.builder.tensorrt_build import TRT_PLUGINS
    from macattn.plugins.trt_compat import python_id

    schemas = {s.name: s for s in _schemas()}
    for plugin, infer in ((match_plugin, match_plugin.match_output_specs),
                          (attend_plugin, attend_plugin.attend_output_specs)):
        onnx_name = next(k for k, name in TRT_PLUGINS.items() if python_id(name) == plugin.PLUGIN_ID)
        schema = schemas[onnx_name]
        assert tuple(p.name for p in schema.inputs) == plugin.INPUTS
        assert tuple(p.name for p in schema.outputs) == plugin.OUTPUTS
        kwonly = [n for n, p in inspect.signature(infer).parameters.items() if p.kind is p.KEYWORD_ONLY]
        assert sorted(kwonly) == sorted(schema.attributes)


def _entry_params(ptx: str, name: str) -> int:
    entry = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S)
    assert entry, f"no .entry {name} in the PTX"
    return entry.group(1).count(".param")


def test_match_aot_image_compiles_for_sm90():
    shapes, dtypes = match_io()
    image = match_plugin.match_aot_image(shapes, dtypes, band=256, tau=0.45)
    assert image.kernel_name == "mac_match_onepass"
    assert ".target sm_90" in image.ptx and image.cubin[:4] == b"\x7fELF"
    assert image.grid == (B, 32, 1) and image.grid[0] is B
    assert image.extra_args == (B,)
    assert image.block == (128, 1, 1)
    # inputs (6) + B + outputs (2) + Triton's two hidden scratch pointers
    assert image.num_params == 11 == _entry_params(image.ptx, image.kernel_name)
    consts = dict(image.spec.constexprs)
    assert consts["HQ"] == 32 and consts["K"] == 1024 and consts["D"] == 128 and consts["BAND"] == 256
    assert consts["THR"] == pytest.approx(16.0 * (1 - 0.45), rel=1e-6)


def test_attend_aot_image_compiles_for_sm90():
    shapes, dtypes = attend_io(Hq=28, Hkv=4)
    image = attend_plugin.attend_aot_image(shapes, dtypes, band=256, scale=128 ** -0.5)
    assert image.kernel_name == "mac_attend_onepass"
    assert image.grid == (B, 4, 1) and image.extra_args == (B, T)
    assert image.num_params == 11 + 2 + 5 + 2 == _entry_params(image.ptx, image.kernel_name)
    names = [n for n, _ in image.spec.signature]
    assert names[:11] == [f"{n}_ptr" for n in attend_plugin.INPUTS]
    assert names[11:13] == ["B", "T"]
    assert names[13:] == [f"{n}_ptr" for n in attend_plugin.OUTPUTS]
    assert 0 < image.shared_mem <= 48 * 1024


def test_aot_image_needs_static_heads_and_window():
    shapes, dtypes = match_io()
    shapes[0] = (B, Dyn("Hq"), 128)
    shapes[1] = (S, shapes[0][1], 1024, 128)
    shapes[2] = (S, shapes[0][1], 1024)
    with pytest.raises(ValueError, match="Hq"):
        match_plugin.match_kernel_spec(shapes, dtypes, band=1, tau=0.5)
    shapes, dtypes = match_io(d=96)
    with pytest.raises(ValueError, match="power of two"):
        match_plugin.match_kernel_spec(shapes, dtypes, band=1, tau=0.5)


def test_register_all_names_the_missing_package():
    pytest.importorskip("triton")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt is installed here")
    from macattn.plugins.tensorrt_plugins import register_all

    with pytest.raises(ImportError, match="`tensorrt` package"):
        register_all()
