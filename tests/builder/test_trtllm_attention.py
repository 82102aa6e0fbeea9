"""CPU tests of the pure half of builder/trtllm_attention.py: extra network I/O, dim ranges, RoPE tables."""
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from macattn.builder import trtllm_attention as ta
from macattn.methods.mac.config import MacConfig
from macattn.plugins.mac import attend_plugin
from macattn.plugins.mac import match_plugin


def _cfg():
    return MacConfig(window=16, band=4, tau=0.5, layer_overrides={1: {"window": 8}, 2: {"enabled": False}})


def test_network_io_names_dtypes_shapes():
    io = ta.mac_network_io(_cfg(), 4, max_batch=8, num_heads=6, head_dim=32, dtype=torch.bfloat16, max_slots=12)
    assert [(t.name, t.dtype, t.shape) for t in io.step_inputs] == [
        ("mac_rows", torch.int32, (-1,)), ("mac_positions", torch.int64, (-1,)), ("mac_slots", torch.int64, (-1,))]
    assert all(t.ranges == ((0, 4, 8),) for t in io.step_inputs)
    assert sorted({r.layer for r in io.rings}) == [0, 1, 3]          # layer 2 has MAC disabled: no rings
    l1 = io.layer_rings(1)
    assert list(l1) == list(ta.RING_NAMES)
    want = {"qring": (torch.bfloat16, (-1, 6, 8, 32)), "oring": (torch.float32, (-1, 6, 8, 32)),
            "ring_lse": (torch.float32, (-1, 6, 8)), "ring_pos": (torch.int64, (-1, 8))}
    for name, (dt, shape) in want.items():
        r = l1[name]
        assert (r.inp.name, r.out.name) == (f"{name}.1", f"{name}.1.out")
        assert r.inp.dtype == r.out.dtype == dt and r.inp.shape == r.out.shape == shape
        assert r.inp.dims[0] == "num_slots" and r.inp.ranges[0] == (1, 8, 12)
        assert all(rng == (n, n, n) for n, rng in zip(shape[1:], r.inp.ranges[1:]))
    assert io.layer_rings(0)["qring"].inp.shape == (-1, 6, 16, 32)
    assert len(io.inputs) == 3 + 4 * 3 and len(io.outputs) == 4 * 3
    assert len({t.name for t in io.inputs + io.outputs}) == len(io.inputs) + len(io.outputs)


@pytest.mark.parametrize("hq,hkv,d,dtype",
                         [(8, 2, 64, torch.bfloat16), (4, 4, 32, torch.float16), (6, 1, 16, torch.float32)])
def test_network_io_fits_plugin_shape_inference(hq, hkv, d, dtype):
    """Concrete sizes in the declared ranges go through both plugins' own inference; the
    attend ring outputs alias exactly the declared ring inputs, with the declared shapes."""
    cfg = MacConfig(window=5, band=1, tau=0.3)
    io = ta.mac_network_io(cfg, 2, max_batch=4, num_heads=hq, head_dim=d, dtype=dtype, max_slots=6)
    G, S, T = 3, 6, 11
    rings = io.layer_rings(1)
    ring_shapes = [tuple(S if n == -1 else n for n in rings[name].inp.shape) for name in ta.RING_NAMES]
    ring_dtypes = [rings[name].inp.dtype for name in ta.RING_NAMES]
    step = {t.name: t for t in io.step_inputs}
    assert step["mac_positions"].dtype == step["mac_slots"].dtype == torch.int64
    m_shapes = [(G, hq, d), ring_shapes[0], ring_shapes[2], ring_shapes[3], (G,), (G,)]
    m_dtypes = [dtype, ring_dtypes[0], ring_dtypes[2], ring_dtypes[3], torch.int64, torch.int64]
    f = {"band": cfg.band, "tau": cfg.tau}
    (mp_shape, mp_dtype), _ = match_plugin.match_output_specs(m_shapes, m_dtypes, **f)
    a_shapes = [(G, hq, d), (G, hq, d), (G, hkv, T, d), (G, hkv, T, d), (G,), mp_shape, (G,), *ring_shapes]
    a_dtypes = [dtype, dtype, dtype, dtype, torch.int64, mp_dtype, torch.int64, *ring_dtypes]
    specs = attend_plugin.attend_output_specs(a_shapes, a_dtypes, band=cfg.band, scale=d ** -0.5)
    assert specs[0].shape == (G, hq, d) and specs[0].dtype == dtype
    for name, spec in zip(ta.RING_NAMES, specs[1:]):
        assert attend_plugin.INPUTS[spec.alias_of] == name
        out = rings[name].out
        assert spec.shape == tuple(S if n == -1 else n for n in out.shape) and spec.dtype == out.dtype


def test_network_io_validation():
    cfg = _cfg()
    kw = dict(max_batch=4, num_heads=4, head_dim=32, dtype=torch.float16)
    for name in ("max_batch", "num_heads", "head_dim"):
        with pytest.raises(ValueError, match=name):
            ta.mac_network_io(cfg, 2, **{**kw, name: 0})
    with pytest.raises(ValueError, match="num_layers"):
        ta.mac_network_io(cfg, 0, **kw)
    with pytest.raises(ValueError, match="max_slots"):
        ta.mac_network_io(cfg, 2, **kw, max_slots=3)
    with pytest.raises(TypeError, match="dtype"):
        ta.mac_network_io(cfg, 2, **{**kw, "dtype": torch.int8})
    with pytest.raises(TypeError, match="cfg"):
        ta.mac_network_io({"window": 4}, 2, **kw)


def test_dim_range_per_profile():
    io = ta.mac_network_io(MacConfig(window=4), 1, max_batch=2, num_heads=3, head_dim=16, dtype=torch.float16)
    qring = io.layer_rings(0)["qring"].inp
    dr = ta.dim_range(qring, 2)
    l = qring.name.split(".")[1]
    assert list(dr) == ["num_slots", f"heads.{l}", f"window.{l}", f"head_dim.{l}"]
    assert dr["num_slots"] == [[1, 2, 2], [1, 2, 2]] and dr[f"heads.{l}"] == [3, 3] and dr[f"window.{l}"] == [4, 4]
    assert ta.dim_range(io.step_inputs[0], 1) == {"mac_tokens": [[0, 1, 2]]}
    with pytest.raises(ValueError, match="num_profiles"):
        ta.dim_range(qring, 0)


@pytest.mark.parametrize("scaling", [None, 2.0])
def test_rope_tables_equal_transformers_rope(scaling):
    d, heads, P, base = 32, 3, 64, 10000.0
    hf = LlamaConfig(hidden_size=d * heads, num_attention_heads=heads, num_key_value_heads=heads, head_dim=d,
                     max_position_embeddings=P, rope_theta=base,
                     rope_scaling=None if scaling is None else {"rope_type": "linear", "factor": scaling})
    rot = LlamaRotaryEmbedding(hf)
    gen = torch.Generator().manual_seed(0)
    pos = torch.tensor([[0, 1, 7, 33, 63]])
    q = torch.randn(1, heads, pos.shape[1], d, generator=gen)
    cos_hf, sin_hf = rot(q, pos)
    want, _ = apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
    cos, sin_s = ta.rope_tables(d, P, base, 1.0 if scaling is None else scaling)
    c, s = torch.from_numpy(cos)[pos[0]], torch.from_numpy(sin_s)[pos[0]]
    swapped = torch.cat([q[..., d // 2:], q[..., : d // 2]], dim=-1)
    got = q * c + swapped * s
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_rope_tables_validation():
    assert ta.rope_tables(16, 4, 500000.0)[0].dtype == np.float32
    with pytest.raises(ValueError, match="head_dim"):
        ta.rope_tables(15, 4, 10000.0)
    with pytest.raises(ValueError, match="base"):
        ta.rope_tables(16, 4, math.inf)
    with pytest.raises(ValueError, match="scale"):
        ta.rope_tables(16, 4, 10000.0, 0.5)


def test_make_mac_attention_needs_max_batch():
    with pytest.raises(ValueError, match="max_batch"):
        ta.make_mac_attention(object, MacConfig(), {}, max_batch=0)


def test_t3_dim_names_are_per_layer_when_layers_differ():
    """TRT-LLM keeps one range per dimension name: per-layer windows must not share a name."""
    from macattn.builder.trtllm_attention import mac_network_io

    cfg = MacConfig(window=16, band=4, layer_overrides={1: {"window": 32}})
    io = mac_network_io(cfg, 2, max_batch=4, num_heads=4, head_dim=32, dtype=torch.bfloat16)
    ranges = {}
    for t in io.inputs + io.outputs:
        for name, rng in zip(t.dims, t.ranges):
            assert ranges.setdefault(name, rng) == rng, name
    assert ranges["window.0"] == (16, 16, 16) and ranges["window.1"] == (32, 32, 32)


def test_t4_global_layer_index_under_pipeline_parallelism():
    from macattn.builder.trtllm_attention import global_layer_index

    assert global_layer_index(0, 16) == 16 and global_layer_index(3, 0) == 3
    with pytest.raises(ValueError, match="first_layer must be an int >= 0"):
        global_layer_index(1, -1)


def test_t1_create_plugin_through_upstream_quick_creator(monkeypatch):
    """After ``register_all`` the registry holds upstream's quick creators: (name, namespace, fc, phase, request)."""
    import sys as _sys
    _sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "plugins"))
    import trt_recorder as R

    from macattn.builder.trtllm_attention import create_plugin
    from macattn.builder.trtllm_build import ATTEND_ID, MATCH_ID, layer_plugin_fields
    from macattn.plugins import tensorrt_plugins

    monkeypatch.setattr(tensorrt_plugins, "_REGISTERED", False)
    fields = layer_plugin_fields(MacConfig(window=16, band=4, tau=0.3), 1, 64)[0]
    with R.installed() as (trt, _):
        tensorrt_plugins.register_all()
        reg = trt.get_plugin_registry()
        for pid in (MATCH_ID, ATTEND_ID):
            ns, name = pid.split("::")
            plugin = create_plugin(trt, reg.get_creator(name, "1", ns), pid, fields[pid], aot=True)
            assert type(plugin).__name__ == "_TemplateAOTPlugin" and list(plugin.attrs) == list(fields[pid])
        jit = create_plugin(trt, reg.get_creator("match", "1", "mac_py"), MATCH_ID, fields[MATCH_ID], aot=False)
        assert type(jit).__name__ == "_TemplateJITPlugin"
