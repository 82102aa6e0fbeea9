"""The transformers model families macattn integrates with, in one place."""
from __future__ import annotations

__all__ = ["SUPPORTED_ARCHITECTURES", "check_supported"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def check_supported(model) -> None:
    """Raise ``TypeError`` unless ``model`` is one of ``SUPPORTED_ARCHITECTURES`` and
    ``ValueError`` if it uses sliding-window layers (every method needs full causal layers)."""
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TypeError(f"model must be one of {SUPPORTED_ARCHITECTURES}, got {arch}")
    hf = model.config
    window = getattr(hf, "sliding_window", None)
    if window is not None and getattr(hf, "use_sliding_window", True):
        raise ValueError(f"sliding_window={window}: macattn's methods need full causal attention layers; "
                         "set config.sliding_window=None")
