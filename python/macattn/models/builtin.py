"""The small built-in models: LLaMA / Qwen2 / Mistral architectures with fixed-seed random weights.

They exist so every command and test runs on a fresh CPU machine with no download. The
config (``BUILTIN``) is GQA 4:1 with RoPE and full causal attention:

    vocab 2048, hidden 256, 4 layers, 8 query heads, 2 KV heads, head_dim 32,
    intermediate 512, max positions 16384, rope_theta 10000, fp32.
"""
from __future__ import annotations

import torch

from macattn.models.names import FAMILIES

__all__ = ["FAMILIES", "BUILTIN", "builtin_config", "build_builtin_model"]

BUILTIN = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
               rope_theta=10000.0, tie_word_embeddings=False)


def builtin_config(family: str = "llama", **overrides):
    """A transformers config of ``family`` with the ``BUILTIN`` sizes (``overrides`` replace fields)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    fields = {**BUILTIN, **overrides}
    if family == "llama":
        return LlamaConfig(**fields)
    if family == "qwen2":
        return Qwen2Config(**{"use_sliding_window": False, "sliding_window": None, **fields})
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **fields})
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def build_builtin_model(family: str = "llama", *, seed: int = 0, **overrides):
    """Instantiate the built-in ``family`` model with weights drawn from ``seed`` (eval mode, fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    config = builtin_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval()
