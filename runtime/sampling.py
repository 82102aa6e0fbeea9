"""Per-request sampling parameters (TensorRT-LLM names) and the sampler.

Greedy iff ``top_k == 1`` or (``top_k == 0`` and ``top_p == 0``), as in TensorRT-LLM;
otherwise logits are divided by ``temperature``, cut to the ``top_k`` largest (0 = no cut)
and to the smallest set with cumulative probability ``>= top_p`` (0 = no cut), then one
token is drawn with the request's own ``torch.Generator`` (seeded by ``random_seed``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample_next"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: tokens to generate (>= 1). end_id: stop token (not emitted), None = none.
    temperature: > 0. top_k: int >= 0. top_p: float in [0, 1]. random_seed: int >= 0 or None."""

    max_new_tokens: int = 1
    end_id: int | None = None
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 0.0
    random_seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int >= 1, got {type(self.max_new_tokens).__name__} "
                            f"{self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens}")
        if self.end_id is not None and not _is_int(self.end_id):
            raise TypeError(f"end_id must be an int or None, got {type(self.end_id).__name__} {self.end_id!r}")
        if not _is_real(self.temperature):
            raise TypeError(f"temperature must be a float > 0, got {type(self.temperature).__name__} "
                            f"{self.temperature!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite float > 0, got {self.temperature}")
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int >= 0, got {type(self.top_k).__name__} {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no top-k cut), got {self.top_k}")
        if not _is_real(self.top_p):
            raise TypeError(f"top_p must be a float in [0, 1], got {type(self.top_p).__name__} {self.top_p!r}")
        if not (math.isfinite(self.top_p) and 0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be a float in [0, 1] (0 = no top-p cut), got {self.top_p}")
        if self.random_seed is not None and (not _is_int(self.random_seed) or self.random_seed < 0):
            raise ValueError(f"random_seed must be an int >= 0 or None, got {self.random_seed!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0)

    def make_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.random_seed if self.random_seed is not None else torch.seed())
        return g


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token id from ``logits [V]`` (any float dtype) under ``params``."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.detach().to("cpu", torch.float64) / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if 0.0 < params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p     # smallest prefix reaching top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
