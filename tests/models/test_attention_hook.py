"""Patched LLaMA / Qwen2 / Mistral vs the unpatched transformers models."""
import pytest
import torch

from macattn.models.attention import binding_of, patch_model, unpatch_model
from macattn.methods.mac.config import MacConfig
from macattn.models.builtin import FAMILIES, build_builtin_model
from macattn.models.transformers_api import CACHE_KWARG, returned_cache

SMALL = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=512)


def _generate(model, ids, steps):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mac_off_equals_unpatched_model(family):
    model = build_builtin_model(family, seed=3, **SMALL)
    ids = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(7))
    ref = _generate(model, ids, 64)
    patch_model(model, MacConfig(enabled=False, window=32, band=8))
    got = _generate(model, ids, 64)
    assert torch.equal(ref.sequences, got.sequences)
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, got.logits))
    assert worst <= 1e-5
    # the decode steps really went through the MAC ops (63 steps x 2 requests per layer)
    assert binding_of(model).method.state.diagnostics.steps[:, 0].tolist() == [126.0, 126.0]
    unpatch_model(model)
    again = _generate(model, ids, 4)
    assert torch.equal(again.sequences, ref.sequences[:, :100])


def test_prefill_seeds_rings_so_first_decode_step_can_hit():
    model = build_builtin_model("llama", seed=5, **SMALL)
    ctx = patch_model(model, MacConfig(tau=0.0, window=16, band=4), num_slots=2)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        pos = ctx.state.ring_pos[0][int(ctx.slots[0])]
        assert sorted(pos.tolist()) == list(range(24, 40))          # the last K prompt positions
        assert torch.isfinite(ctx.state.ring_lse[0][int(ctx.slots[0])]).all()   # all have t - r >= 0
        model(input_ids=out.logits[:, -1:].argmax(-1), **{CACHE_KWARG: returned_cache(out)}, use_cache=True)
    assert ctx.state.diagnostics.hits.sum() > 0   # tau=0 admits anything closer than sqrt(2d)


def test_patch_rejects_bad_arguments():
    model = build_builtin_model("llama", seed=0, **SMALL)
    with pytest.raises(TypeError, match="config must be a MacConfig"):
        patch_model(model, {"window": 4})
    with pytest.raises(TypeError, match="model must be one of"):
        patch_model(torch.nn.Linear(2, 2))
    patch_model(model)
    with pytest.raises(ValueError, match="already patched"):
        patch_model(model)
    sliding = build_builtin_model("mistral", seed=0, sliding_window=64, **SMALL)
    with pytest.raises(ValueError, match="sliding_window"):
        patch_model(sliding)


def test_padded_batch_is_refused_in_decode():
    model = build_builtin_model("llama", seed=0, **SMALL)
    patch_model(model, MacConfig(window=16, band=4))
    ids = torch.randint(1, 512, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(NotImplementedError, match="unpadded"):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
