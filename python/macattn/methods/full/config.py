"""Full attention has no parameters; its config type exists so that every method is built the
same way (``method_cls(config, dims, num_slots=...)``)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FullConfig"]


@dataclass(frozen=True)
class FullConfig:
    """No fields."""
