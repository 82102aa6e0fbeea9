"""The tool commands' configurations, free of torch: the command line (``macattn.cli``) reads their defaults
for ``--help`` without loading a framework, and the tools validate their runs with them.

``FinetuneConfig`` (``macattn finetune-mka``), ``LossConfig`` / ``DistillConfig`` (``macattn
distill-completion``), ``THRESHOLD_MODES`` (the threshold rules ``macattn tune`` tries).
"""
from __future__ import annotations

from dataclasses import dataclass

from macattn.core.validation import check_choice, check_float, check_int

__all__ = ["FinetuneConfig", "LossConfig", "DistillConfig", "THRESHOLD_MODES"]

THRESHOLD_MODES = ("paper", "calibrated", "both")   # the threshold rules the agreement search tries


@dataclass(frozen=True)
class FinetuneConfig:
    """steps >= 1, batch >= 1, seq_len >= 2, lr > 0, eval_batches >= 1, dtype "bf16"|"fp32"."""

    steps: int = 60
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-2
    eval_batches: int = 8
    save_every: int = 20
    seed: int = 0
    dtype: str = "bf16"

    def __post_init__(self):
        for name, lo in (("steps", 1), ("batch", 1), ("seq_len", 2), ("eval_batches", 1), ("save_every", 1)):
            check_int(name, getattr(self, name), lo)
        check_float("lr", self.lr, 0.0, lo_open=True)
        check_choice("dtype", self.dtype, ("bf16", "fp32"))


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of ``distill_loss`` (see the module docstring for the formula)."""

    temperature: float = 2.0
    delta: float = 1.0
    top_band: float = 2.0
    far: float = 6.0
    aux_weight: float = 1.0
    w_top: float = 1.0
    w_far: float = 1.0
    w_logz: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "delta", "top_band"):
            check_float(name, getattr(self, name), 0.0, lo_open=True)
        check_float("far", self.far, self.top_band)
        for name in ("aux_weight", "w_top", "w_far", "w_logz"):
            check_float(name, getattr(self, name), 0.0)


@dataclass(frozen=True)
class DistillConfig:
    """steps >= 1, batch >= 1, seq_len > n_sink + n_tail + n_queries, lr > 0."""

    steps: int = 200
    batch: int = 4
    seq_len: int = 512
    n_queries: int = 16
    n_sink: int = 16
    n_tail: int = 64
    lr: float = 3e-3
    save_every: int = 50
    seed: int = 0
    calibrate_windows: int = 4

    def __post_init__(self):
        for name, lo in (("steps", 1), ("batch", 1), ("n_queries", 1), ("n_sink", 0), ("n_tail", 0),
                         ("save_every", 1), ("calibrate_windows", 0)):
            check_int(name, getattr(self, name), lo)
        if self.seq_len <= self.n_sink + self.n_tail + self.n_queries:
            raise ValueError(f"seq_len must be > n_sink + n_tail + n_queries = "
                             f"{self.n_sink + self.n_tail + self.n_queries}, got {self.seq_len}")
        check_float("lr", self.lr, 0.0, lo_open=True)

    @property
    def mid(self) -> tuple[int, int]:
        n = self.seq_len - self.n_queries
        return self.n_sink, n - self.n_tail