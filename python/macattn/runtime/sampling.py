"""Per-request sampling parameters (TensorRT-LLM names) and the batched sampler.

Greedy iff ``top_k == 1`` or (``top_k == 0`` and ``top_p == 0``), as in TensorRT-LLM;
otherwise logits are divided by ``temperature``, cut to the ``top_k`` largest (0 = no cut)
and to the smallest set with cumulative probability ``>= top_p`` (0 = no cut; values tied with
the last kept one are kept), then one token is drawn.

``sample_tokens`` samples a whole batch on the logits' device with no host synchronisation, so
it runs inside the decode step's CUDA graph. The draw is the Gumbel-max trick over counter-based
uniforms: row ``b``'s noise is a hash of (its request's ``seed``, the position being generated,
the token id) — a request's tokens depend on its seed and its own logits only, never on the batch
it ran in, the device's RNG state or how many graphs were replayed before.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "SamplingBatch", "PAD_ROW", "sample_tokens"]


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

    def make_seed(self) -> int:
        """The request's sampling seed: ``random_seed``, or a fresh random one."""
        return self.random_seed if self.random_seed is not None else secrets.randbits(62)


PAD_ROW = (SamplingParams(), 0, 0)   # a padding row's (params, seed, position): greedy


@dataclass(frozen=True)
class SamplingBatch:
    """One step's per-row sampling inputs, ``[B]`` tensors on the logits' device: temperature fp32,
    top_k int64, top_p fp32, seed int64, position int64 (of the token being generated)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor

    @staticmethod
    def of(rows: list[tuple[SamplingParams, int, int]], device, pad_to: int | None = None) -> "SamplingBatch":
        """``rows``: ``(params, seed, position)`` per request; padded (``PAD_ROW``) to ``pad_to``."""
        n = len(rows) if pad_to is None else pad_to
        rows = list(rows) + [PAD_ROW] * (n - len(rows))
        cols = list(zip(*[(p.temperature, p.top_k, p.top_p, s, pos) for p, s, pos in rows])) or [()] * 5
        dtypes = (torch.float32, torch.int64, torch.float32, torch.int64, torch.int64)
        return SamplingBatch(*(torch.tensor(c, dtype=dt).to(device, non_blocking=True) for c, dt in zip(cols, dtypes)))



_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds) of int64 ``x`` in ``[0, 2^32)``; the
    multiplier is below 2^27 so no product overflows int64."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _uniforms(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` fp32 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    key = _mix32((seed & _M32) ^ _mix32(((seed >> 32) & _M32) ^ _mix32(position & _M32)))
    ids = _mix32(torch.arange(vocab, device=seed.device, dtype=torch.int64))
    bits = _mix32(key[:, None] ^ ids[None, :]) >> 8                     # 24 bits: exact in fp32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch, *, greedy_only: bool = False) -> torch.Tensor:
    """Next token ids ``[B]`` int64 from ``logits [B, V]`` (any float dtype) under each row's
    parameters. ``greedy_only``: every row is greedy (argmax only; the caller knows). No host sync."""
    best = logits.argmax(dim=-1)
    if greedy_only:
        return best
    V = logits.shape[-1]
    x = logits.float() / batch.temperature[:, None]
    ordered = x.sort(dim=-1, descending=True).values
    rank = torch.arange(V, device=x.device)
    k = torch.where(batch.top_k > 0, batch.top_k, V)
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    use_p = (batch.top_p > 0) & (batch.top_p < 1)
    keep &= ~use_p[:, None] | ((probs.cumsum(-1) - probs) < batch.top_p[:, None])
    last_kept = ordered.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    gumbel = -torch.log(-torch.log(_uniforms(batch.seed, batch.position, V)))
    drawn = (x.masked_fill(x < last_kept, float("-inf")) + gumbel).argmax(dim=-1)
    greedy = (batch.top_k == 1) | ((batch.top_k == 0) & (batch.top_p == 0))
    return torch.where(greedy, best, drawn)


