"""The model names every command accepts, in one place and free of torch / transformers, so the command
line reads them without loading a framework.

``BUILTIN_MODEL`` (``"builtin"``) is the packaged trained checkpoint (``macattn.models.checkpoint``);
``BUILTIN_NAMES`` are its accepted spellings (``"trained"`` and ``"tiny-llama"`` are aliases).
``FAMILIES`` are the architectures of the random-weight built-in models (``macattn.models.builtin``).
"""
from __future__ import annotations

__all__ = ["BUILTIN_MODEL", "BUILTIN_NAMES", "FAMILIES", "canonical_model"]

BUILTIN_MODEL = "builtin"
BUILTIN_NAMES = (BUILTIN_MODEL, "trained", "tiny-llama")   # the packaged trained checkpoint: one model, three names
FAMILIES = ("llama", "qwen2", "mistral")


def canonical_model(name: str) -> str:
    """``BUILTIN_MODEL`` for any of ``BUILTIN_NAMES``, ``name`` unchanged otherwise (a family or a directory)."""
    return BUILTIN_MODEL if name in BUILTIN_NAMES else name
