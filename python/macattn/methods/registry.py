"""The method registry: one line per method (name -> its ``AttentionMethod`` class)."""
from __future__ import annotations

from macattn.methods.base import AttentionMethod
from macattn.methods.full.backend import FullAttention
from macattn.methods.mac.backend import MacAttention

__all__ = ["METHODS", "method_class"]

METHODS: dict[str, type[AttentionMethod]] = {
    FullAttention.name: FullAttention,
    MacAttention.name: MacAttention,
}


def method_class(name: str) -> type[AttentionMethod]:
    """The class registered as ``name``; ``ValueError`` naming the registered ones otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {name!r}") from None
