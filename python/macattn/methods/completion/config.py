"""Retrieval-completion's settings (docs/spec.md §3), shared by all layers."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from macattn.core.validation import check_int
from macattn.methods.completion.gate import CompletionGate

__all__ = ["METHODS", "SELECTORS", "CompletionConfig"]

METHODS = ("full", "sink_tail", "selection", "completion")


SELECTORS = ("exact", "pages", "quest")


@dataclass(frozen=True)
class CompletionConfig:
    """Retrieval-completion settings shared by all layers.

    n_sink / n_tail: exact prefix / suffix of the prefill segment (>= 0).
    top_k: retrieved mid tokens per query head and step; or ``budget``: a fraction in (0, 1]
    of the mid region (exactly one of the two is set; ``budget_top_k`` resolves it).
    feature_dim: ``F``, features of φ_q / φ_k; hidden: inner width of the ReZero block.
    selector: ``"exact"`` (exhaustive Top-k), ``"pages"`` (page-summary upper bounds, then the exact
    Top-k inside the kept pages; the fp64 reference only) or ``"quest"`` (the GPU page selector: the
    ``ceil(top_k / page_size)`` pages per KV head of best Quest bound, every token of them retrieved,
    no token refinement; bounds kept in the state; ``macattn::page_retrieval_completion``);
    page_size / page_overfetch: pages of the ``"pages"`` / ``"quest"`` selectors (``"pages"`` keeps
    ``ceil(top_k / page_size) * page_overfetch``).
    gate: the per-layer gate of the completion term (``macattn.methods.completion.gate``): None (the term in
    every layer), a ``CompletionGate`` or the path of its JSON file (``macattn tune --completion``), read here.
    """

    n_sink: int = 16
    n_tail: int = 64
    top_k: int | None = 32
    budget: float | None = None
    feature_dim: int = 64
    hidden: int = 128
    selector: str = "exact"
    page_size: int = 16
    page_overfetch: int = 2
    gate: CompletionGate | None = None

    def __post_init__(self):
        if isinstance(self.gate, (str, os.PathLike)):
            object.__setattr__(self, "gate", CompletionGate.load(self.gate))
        if self.gate is not None and not isinstance(self.gate, CompletionGate):
            raise TypeError(f"gate must be a CompletionGate, its JSON file's path or None, got "
                            f"{type(self.gate).__name__}")
        check_int("n_sink", self.n_sink, 0)
        check_int("n_tail", self.n_tail, 0)
        if (self.top_k is None) == (self.budget is None):
            raise ValueError(f"give exactly one of top_k and budget, got top_k={self.top_k!r}, budget={self.budget!r}")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 0)
        if self.budget is not None and not (isinstance(self.budget, (int, float)) and 0.0 < self.budget <= 1.0):
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget!r}")
        check_int("feature_dim", self.feature_dim, 1)
        check_int("hidden", self.hidden, 1)
        if self.selector not in SELECTORS:
            raise ValueError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        check_int("page_size", self.page_size, 1)
        check_int("page_overfetch", self.page_overfetch, 1)

    def pages_for(self, k: int) -> int:
        """Pages per KV head of the ``"quest"`` selector for a Top-k of ``k`` tokens (``ceil(k / page_size)``)."""
        check_int("k", k, 0)
        return -(-k // self.page_size)

    def k_for(self, mid_len: int) -> int:
        """Retrieved tokens for a mid region of ``mid_len`` tokens (``min(top_k, mid_len)``)."""
        check_int("mid_len", mid_len, 0)
        if self.top_k is not None:
            return min(self.top_k, mid_len)
        return min(mid_len, max(1, math.ceil(self.budget * mid_len))) if mid_len else 0
