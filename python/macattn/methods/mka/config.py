"""FastMKA's settings (docs/spec.md §2), the same for every layer."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUMMARY_MODES", "MkaConfig"]

SUMMARY_MODES = ("mean", "ema")


@dataclass(frozen=True)
class MkaConfig:
    """FastMKA settings, the same for every layer.

    summary: ``"mean"`` (causal prefix mean) or ``"ema"``; ema_beta in ``(0, 1)`` for ``"ema"``.
    router_hidden: hidden width of the routing MLP (>= 1).
    l3: enable hashed chunk recall (full-sequence forward only; decode with a cache refuses it).
    l3_chunk: chunk length in tokens (>= 1); l3_bits: sign-hash bits (1..30).
    seed: seed of the router's initial weights and of the L3 hash hyperplanes.
    """

    summary: str = "mean"
    ema_beta: float = 0.9
    router_hidden: int = 64
    l3: bool = False
    l3_chunk: int = 32
    l3_bits: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.summary not in SUMMARY_MODES:
            raise ValueError(f"summary must be one of {SUMMARY_MODES}, got {self.summary!r}")
        if not 0.0 < float(self.ema_beta) < 1.0:
            raise ValueError(f"ema_beta must be in (0, 1), got {self.ema_beta}")
        if int(self.router_hidden) < 1:
            raise ValueError(f"router_hidden must be >= 1, got {self.router_hidden}")
        if int(self.l3_chunk) < 1:
            raise ValueError(f"l3_chunk must be >= 1, got {self.l3_chunk}")
        if not 1 <= int(self.l3_bits) <= 30:
            raise ValueError(f"l3_bits must be in [1, 30], got {self.l3_bits}")

    @property
    def mode(self) -> int:
        """The summary mode as the op's integer attribute: 0 mean, 1 EMA."""
        return SUMMARY_MODES.index(self.summary)
