"""``FusedForward`` (Q/K/V and gate/up fused at load, RMSNorm with the residual add) computes what
the transformers forward computes: the engine's logits with ``RuntimeConfig(fused_weights=True)``
equal the unfused engine's (fp32, ≤ 1e-5) for LLaMA, Qwen2 (Q/K/V biases) and Mistral, MAC on and
off, prefill and in-flight decode."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.mac.config import MacConfig
from macattn.models.attention import patch_model
from macattn.models.builtin import FAMILIES, build_builtin_model
from macattn.models.fused import FusedForward
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(12, 30, (1,), generator=g)),), generator=g) for _ in range(n)]


def _logit_trace(family, mac, fused, ps):
    model = build_builtin_model(family, seed=3, **SMALL).float()
    eng = LLMEngine(model, mac, RuntimeConfig(max_batch_size=2, max_seq_len=64, fused_weights=fused))
    seqs, trace = [], []
    for p in ps:
        seq = eng.make_request(p, max_new_tokens=5)
        eng.submit(seq)
        seqs.append(seq)
    while eng.has_unfinished():                 # the engine's own schedule; record every logit row
        batch = eng.scheduler.decode_batch()
        if batch:
            tokens, logits = eng.executor.decode_step(batch)
            for s, token, row in zip(batch, tokens, logits):
                trace.append(row)
                eng._append(s, token, row)
        for s in eng.scheduler.admit():
            row = eng.executor.prefill(s)
            trace.append(row)
            eng._append(s, eng.executor.sample([s], row[None])[0], row)
    return torch.stack(trace), [s.output for s in seqs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mac", [None, MacConfig(window=8, band=2, tau=0.1)], ids=["mac-off", "mac-on"])
def test_fused_engine_equals_unfused(family, mac):
    ps = _prompts(3, seed=7)                    # 3 requests through 2 slots
    want, want_tokens = _logit_trace(family, mac, False, ps)
    got, got_tokens = _logit_trace(family, mac, True, ps)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_tokens == want_tokens


def test_fused_weights_are_the_concatenated_projections():
    model = build_builtin_model("qwen2", seed=0, **SMALL).float()
    patch_model(model, MacConfig())
    fused = FusedForward(model)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    layer = fused.layers[1]
    before = build_builtin_model("qwen2", seed=0, **SMALL).float().model.layers[1]
    a0, m0 = before.self_attn, before.mlp
    assert torch.equal(layer.qkv_weight, torch.cat([a0.q_proj.weight, a0.k_proj.weight, a0.v_proj.weight]))
    assert torch.equal(layer.qkv_bias, torch.cat([a0.q_proj.bias, a0.k_proj.bias, a0.v_proj.bias]))
    assert torch.equal(layer.gate_up_weight, torch.cat([m0.gate_proj.weight, m0.up_proj.weight]))
    for mod, ref in ((attn.q_proj, a0.q_proj), (attn.v_proj, a0.v_proj), (mlp.gate_proj, m0.gate_proj)):
        assert torch.equal(mod.weight, ref.weight)
    # one copy of the weights: the model's projections are views into the fused tensors
    assert attn.k_proj.weight.data_ptr() == layer.qkv_weight[attn.q_proj.out_features:].data_ptr()
    assert attn.v_proj.bias.data_ptr() == layer.qkv_bias[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == layer.gate_up_weight[mlp.gate_proj.out_features:].data_ptr()
    again = FusedForward(model).layers[1]     # a second engine on the same model: the same storage again
    assert again.qkv_weight.data_ptr() == layer.qkv_weight.data_ptr() and torch.equal(again.qkv_weight, layer.qkv_weight)
    assert again.qkv_bias.data_ptr() == layer.qkv_bias.data_ptr()
    assert again.gate_up_weight.data_ptr() == layer.gate_up_weight.data_ptr()


def test_fused_forward_needs_a_bound_model():
    model = build_builtin_model("llama", seed=0, **SMALL)
    with pytest.raises(ValueError, match="bound model"):
        FusedForward(model)(torch.zeros(1, 3, dtype=torch.int64), torch.arange(3)[None])
