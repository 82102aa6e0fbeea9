"""Issue 36 item 1: ``MacAttention.forward`` (the TensorRT-LLM engine path, <= 1.2.x) run over mocked
``tensorrt`` / ``tensorrt_llm`` modules.

The mocks are test-only stand-ins (nothing of TensorRT ran): symbolic tensors that accept every graph op
``_mac_merge`` uses, a network that records ``add_plugin_v3`` / ``add_scatter`` / marked outputs, and creators
keyed the way ``trtllm_build.install_patch`` keys them (``MATCH_ID`` / ``ATTEND_ID``, the ids ``register_all``
registers). Before the fix the forward looked the plugins up as ``"mac::match"``: ``KeyError`` on the first
MAC layer.
"""
from __future__ import annotations

import sys
import types

import pytest

from macattn.builder import trtllm_attention as ta
from macattn.methods.mac.config import MacConfig


class _Sym:
    """A symbolic network tensor: every op returns a new one."""

    def __init__(self, dtype="bf16"):
        self.dtype, self.trt_tensor, self.marked = dtype, self, None

    def view(self, *a, **k):
        return _Sym(self.dtype)

    def rank(self):
        return 2

    def mark_output(self, name, dtype):
        self.marked = (name, dtype)

    def __mul__(self, other):
        return _Sym(self.dtype)

    __add__ = __rmul__ = __radd__ = __mul__


class _Layer:
    def __init__(self, n):
        self.num_outputs = n

    def get_output(self, i):
        return _Sym()


class _Net:
    def __init__(self):
        self.plugins, self.scatters, self._inputs = [], [], []
        self.plugin_config = types.SimpleNamespace(gpt_attention_plugin="bfloat16", paged_kv_cache=False,
                                                   kv_cache_type="continuous")

    def get_inputs(self):
        return self._inputs

    def add_plugin_v3(self, inputs, shape_inputs, plugin):
        self.plugins.append((plugin, len(inputs)))
        return _Layer(2 if plugin["name"] == "match" else 5)

    def add_scatter(self, data, idx, upd, mode):
        self.scatters.append(mode)
        return _Layer(1)


def _fake_modules(net):
    trt = types.ModuleType("tensorrt")

    class Creator:
        pass

    trt.IPluginCreatorV3Quick = Creator
    trt.QuickPluginCreationRequest = types.SimpleNamespace(STRICT_AOT="STRICT_AOT", STRICT_JIT="STRICT_JIT")
    trt.TensorRTPhase = types.SimpleNamespace(BUILD="BUILD")
    trt.PluginFieldType = types.SimpleNamespace(INT32="INT32", FLOAT32="FLOAT32")
    trt.PluginField = lambda name, data, kind: (name, data.item(), kind)
    trt.PluginFieldCollection = list
    trt.ScatterMode = types.SimpleNamespace(ND="ND")
    for name in ("float32", "float16", "bfloat16", "int32", "int64"):
        setattr(trt, name, {"bfloat16": "bf16"}.get(name, name))

    F = types.ModuleType("tensorrt_llm.functional")
    F.Tensor = lambda name, dtype, shape, dim_range: _Sym(dtype)
    F._create_tensor = lambda t, layer: t
    F.split = lambda t, sizes, dim=0: [_Sym(t.dtype), _Sym(t.dtype)]
    F.cast = lambda t, dtype: _Sym("bf16" if dtype == "bf16" else dtype)
    for op in ("concat", "shape", "index_select", "slice", "constant", "unsqueeze"):
        setattr(F, op, lambda *a, **k: _Sym())
    common = types.ModuleType("tensorrt_llm._common")
    common.default_net = lambda: net
    common.default_trtnet = lambda: net
    attention = types.ModuleType("tensorrt_llm.layers.attention")
    attention.gpt_attention = lambda *a, **k: (_Sym("bf16"), _Sym("bf16"))
    layers = types.ModuleType("tensorrt_llm.layers")
    layers.attention = attention
    root = types.ModuleType("tensorrt_llm")
    root.functional, root._common, root.layers = F, common, layers
    return {"tensorrt": trt, "tensorrt_llm": root, "tensorrt_llm.functional": F, "tensorrt_llm._common": common,
            "tensorrt_llm.layers": layers, "tensorrt_llm.layers.attention": attention}, Creator


class _Attention:
    """TensorRT-LLM's ``Attention`` as far as ``MacAttention`` reads it: ``forward`` computes ``qkv`` and calls
    the module-level ``gpt_attention(qkv=..., ...)``, then ``dense`` (here: returns the context)."""

    def __init__(self, local_layer_idx):
        self.local_layer_idx = local_layer_idx
        self.num_attention_heads, self.num_attention_kv_heads, self.attention_head_size = 8, 2, 64
        self.max_position_embeddings, self.rotary_embedding_base = 4096, 10000.0
        self.rotary_embedding_scale, self.rotary_embedding_scale_type = 1.0, "RotaryScalingType.none"
        self.rotary_embedding_dim, self.q_scaling = 64, 1
        self.position_embedding_type = types.SimpleNamespace(is_rope=lambda: True)
        self.quant_mode = types.SimpleNamespace(has_kv_cache_quant=lambda: False)

    def forward(self, hidden_states):
        attention = sys.modules["tensorrt_llm.layers.attention"]
        context, _present = attention.gpt_attention(qkv=_Sym("bf16"), past_key_value=None)
        return context


def test_item1_mac_layer_forward_finds_the_registered_plugin_ids(monkeypatch):
    net = _Net()
    mods, Creator = _fake_modules(net)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)

    class QuickCreator(Creator):
        def create_plugin(self, name, namespace, fields, phase, request):
            return {"name": name, "namespace": namespace, "fields": fields, "request": request}

    creators = {ta.MATCH_ID: QuickCreator(), ta.ATTEND_ID: QuickCreator()}
    cfg = MacConfig(window=32, band=8, tau=0.45, layer_overrides={1: {"enabled": False}})
    MacAttention = ta.make_mac_attention(_Attention, cfg, creators, max_batch=4)
    MacAttention(0).forward(_Sym())            # KeyError 'mac::match' before the fix
    (match, n_match), (attend, n_attend) = net.plugins
    assert (match["namespace"], match["name"], n_match) == ("mac_py", "match", 6)
    assert (attend["namespace"], attend["name"], n_attend) == ("mac_py", "attend", 11)
    assert [f[:2] for f in match["fields"]] == [("band", 8), ("tau", pytest.approx(0.45))]
    assert [f[:2] for f in attend["fields"]] == [("band", 8), ("scale", 0.125)]
    assert match["request"] == attend["request"] == "STRICT_AOT" and net.scatters == ["ND"]
    net.plugins.clear()
    MacAttention(1).forward(_Sym())            # MAC disabled: TensorRT-LLM's forward only
    assert net.plugins == []
