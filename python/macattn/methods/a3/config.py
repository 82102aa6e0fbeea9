"""A3 KV fusion's settings (docs/spec.md §4)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["FusionMethod", "A3Config"]


class FusionMethod(str, enum.Enum):
    FULL_RECOMPUTE = "full_recompute"
    FULL_REUSE = "full_reuse"
    A3 = "a3"
    CACHEBLEND = "cacheblend"
    SINK = "sink"


@dataclass(frozen=True)
class A3Config:
    """rho: recompute ratio in ``[0, 1]`` (ignored by ``FULL_RECOMPUTE`` / ``FULL_REUSE``).
    method: a ``FusionMethod`` (or its string value).
    store_dir: directory of the chunk KV store (``macattn.runtime.chunk_store``); None keeps
    chunk KV in memory for the call only.
    store_max_bytes: LRU bound of the store in bytes (None = unbounded)."""

    rho: float = 0.2
    method: FusionMethod = FusionMethod.A3
    store_dir: str | None = None
    store_max_bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", FusionMethod(self.method))
        except ValueError:
            raise ValueError(f"method must be one of {[m.value for m in FusionMethod]}, got {self.method!r}") from None
        if isinstance(self.rho, bool) or not isinstance(self.rho, (int, float)) or not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"rho must be a number in [0, 1], got {self.rho!r}")
        if self.store_max_bytes is not None and (isinstance(self.store_max_bytes, bool)
                                                 or not isinstance(self.store_max_bytes, int)
                                                 or self.store_max_bytes <= 0):
            raise ValueError(f"store_max_bytes must be a positive int or None, got {self.store_max_bytes!r}")
        if self.store_dir is not None:
            object.__setattr__(self, "store_dir", str(self.store_dir))
