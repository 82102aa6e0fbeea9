"""The method registry: one line per method (name -> its ``AttentionMethod`` class)."""
from __future__ import annotations

from macattn.methods.a3.backend import A3Prefill
from macattn.methods.base import AttentionMethod
from macattn.methods.completion.backend import CompletionAttention
from macattn.methods.completion.offload_backend import OffloadedCompletion
from macattn.methods.full.backend import FullAttention
from macattn.methods.mac.backend import MacAttention
from macattn.methods.mka.backend import FastMka

__all__ = ["METHODS", "ATTENTION_METHODS", "method_class", "register", "build_method"]

METHODS: dict[str, type[AttentionMethod]] = {
    FullAttention.name: FullAttention,
    MacAttention.name: MacAttention,
    CompletionAttention.name: CompletionAttention,
    OffloadedCompletion.name: OffloadedCompletion,
    FastMka.name: FastMka,
    A3Prefill.name: A3Prefill,
}


def _computes_attention(cls: type[AttentionMethod]) -> bool:
    """A method that computes a layer's attention itself (not prefill-only, not composing with one)."""
    return not (cls.capabilities.prefill_only or cls.capabilities.composes)


ATTENTION_METHODS = tuple(n for n, c in METHODS.items() if _computes_attention(c))


def register(cls: type[AttentionMethod]) -> type[AttentionMethod]:
    """Add an attention method under ``cls.name`` (a class decorator), so the engine and every
    tensor-parallel rank build it by name. A process that spawns ranks registers it at import of a
    module the ranks import too (the main script, under ``spawn``). ``ValueError`` if the name is taken
    by another class."""
    global ATTENTION_METHODS
    if METHODS.get(cls.name, cls) is not cls:
        raise ValueError(f"method name {cls.name!r} is already registered to {METHODS[cls.name].__name__}")
    METHODS[cls.name] = cls
    if _computes_attention(cls) and cls.name not in ATTENTION_METHODS:
        ATTENTION_METHODS = (*ATTENTION_METHODS, cls.name)
    return cls


def method_class(name: str) -> type[AttentionMethod]:
    """The attention method registered as ``name`` (one that computes a layer's attention itself;
    ``a3`` and ``mka`` compose with one); ``ValueError`` naming the accepted ones otherwise."""
    if name not in ATTENTION_METHODS:
        raise ValueError(f"method must be one of {list(ATTENTION_METHODS)}, got {name!r}")
    return METHODS[name]


def build_method(name: str, dims, *, num_slots: int, config=None) -> AttentionMethod:
    """An instance of any registered method (``a3`` and ``mka`` included: the engine builds the prefill
    strategy and the composing method this way, without naming their classes) with ``config`` as the
    engine runs it (``engine_config``: None = the method's default)."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {name!r}")
    cls = METHODS[name]
    return cls(cls.engine_config(config), dims, num_slots=num_slots)
