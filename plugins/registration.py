"""Register the Triton launchers as the CUDA kernels of the ``macattn`` ops.

Imported by ``macattn.plugins`` only when triton is importable. The reference in
``macattn.ops`` stays the implementation for every other device.
"""
from __future__ import annotations

import torch

import macattn.ops  # noqa: F401  (defines the ops)

from .mac_attend.op import mac_attend_triton
from .mac_match.op import mac_match_triton

__all__ = ["REGISTERED"]

torch.library.register_kernel("macattn::mac_match", "cuda", mac_match_triton)
torch.library.register_kernel("macattn::mac_attend", "cuda", mac_attend_triton)

REGISTERED = ("macattn::mac_match", "macattn::mac_attend")
