"""Indexed stores that work for every dtype the state tensors use, float8 included."""
from __future__ import annotations

import torch

__all__ = ["index_store_"]

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def index_store_(dst: torch.Tensor, index, value: torch.Tensor) -> None:
    """``dst[index] = value.to(dst.dtype)`` in place. Float8 tensors are written through their raw
    bytes (a bit-exact copy of the rounded values), since not every device's indexing kernels take
    float8; no host synchronisation, so it can run inside a captured CUDA graph."""
    v = value.to(dst.dtype)
    if dst.dtype in _FLOAT8:
        dst.view(torch.uint8)[index] = v.view(torch.uint8)
    else:
        dst[index] = v
