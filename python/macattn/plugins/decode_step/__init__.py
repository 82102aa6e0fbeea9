"""The non-attention kernels of one decode step (issue: the decode step at the memory-bandwidth floor).

* ``add_rms_norm``: the residual add and the following RMSNorm in one pass;
* ``silu_mul``: ``silu(gate) * up`` of the fused gate/up projection's output;
* ``rope_append``: RoPE of the fused Q/K/V projection's query and key heads, the key and value
  heads written to their rows of the paged KV pool, the rotated query returned — one launch. The
  pre-RoPE query MAC matches on is the projection's output itself (no copy).

``reference.py`` holds the plain-torch versions (transformers' numerics, rounding included);
``kernel.py`` the Triton kernels, ``op.py`` their launchers. ``kernels_for(device)`` picks the
launchers on CUDA with triton, the references elsewhere. Importing this package needs only torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from macattn.plugins import HAVE_TRITON

from . import reference

__all__ = ["DecodeStepKernels", "kernels_for", "REFERENCE"]


@dataclass(frozen=True)
class DecodeStepKernels:
    """The three functions, with the signatures of ``reference.py``."""

    add_rms_norm: Callable
    silu_mul: Callable
    rope_append: Callable


REFERENCE = DecodeStepKernels(reference.add_rms_norm_reference, reference.silu_mul_reference,
                              reference.rope_append_reference)


def kernels_for(device: torch.device | str) -> DecodeStepKernels:
    """The Triton launchers on a CUDA ``device`` when triton imports, else ``REFERENCE``."""
    if torch.device(device).type != "cuda" or not HAVE_TRITON:
        return REFERENCE
    from . import op

    return DecodeStepKernels(op.add_rms_norm, op.silu_mul, op.rope_append)
