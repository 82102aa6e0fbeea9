"""Loading a model directory that macattn cannot serve fails with a sentence naming the cause, before any
weights are read or anything is downloaded (issue 41, item 9)."""
import json

import pytest

from macattn.runtime.engine_args import EngineArgs


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel \(model_type gpt2\); "
                                         r"supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        EngineArgs(model=str(tmp_path)).load_model()       # config.json only: refused before weights are looked for


def test_a_missing_tokenizer_is_named_not_blamed_on_sentencepiece(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model directory .* holds no tokenizer .*--tokenizer") as info:
        EngineArgs(model=str(tmp_path)).load_model()
    assert "sentencepiece" not in str(info.value)
    model, tok = EngineArgs(model=str(tmp_path)).load_model(with_tokenizer=False)
    assert tok is None and model.config.vocab_size == 64


def test_a_hub_name_is_refused_before_any_network_access(monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("transformers was asked to load 'gpt2'")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    with pytest.raises(ValueError, match=r"model must be one of \['builtin', .*got 'gpt2' \(nothing is downloaded\)"):
        EngineArgs(model="gpt2").load_model()
