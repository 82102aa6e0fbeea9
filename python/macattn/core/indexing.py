"""Indexed stores that work for every dtype the state tensors use, float8 included."""
from __future__ import annotations

import torch

__all__ = ["index_store_", "storage_view"]

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a float8 tensor its raw bytes (a ``uint8`` view of the same storage): what indexing,
    ``where`` and copies take on every device, bit for bit."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def index_store_(dst: torch.Tensor, index, value: torch.Tensor) -> None:
    """``dst[index] = value.to(dst.dtype)`` in place. Float8 tensors are written through their raw
    bytes (``storage_view``: a bit-exact copy of the rounded values), since not every device's indexing kernels
    take float8; no host synchronisation, so it can run inside a captured CUDA graph."""
    storage_view(dst)[index] = storage_view(value.to(dst.dtype))
