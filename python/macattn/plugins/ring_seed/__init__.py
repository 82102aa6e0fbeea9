"""A fresh prompt's MAC ring rows written in one launch (issue 42: MAC's prefill seeding, ~15 small torch ops a
layer, made host-bound prefill slower).

``seed_rows_`` writes, per request ``b``, the whole ring row ``slots[b]`` of ``(qring, oring, ring_lse,
ring_pos)`` from the prompt's pre-RoPE queries and the rectified summaries of its last ``n = min(K, L)``
positions: column ``c`` holds the position ``t`` among them with ``t mod K == c``, a column without one is
empty (``q = 0, o = 0, lse = -inf, pos = -1``). It is ``methods.mac.seeding.seeded_ring_rows`` followed by
``seed_rings_``'s four ``index_copy_``, conversions included, for summaries already made.

``reference.py`` holds the plain-torch version, ``kernel.py`` the Triton kernel, ``op.py`` its launcher,
``checks.py`` the input contract both share. ``seed_rows_for(device)`` picks the launcher on CUDA with
triton, the reference elsewhere. Importing this package needs only torch.
"""
from __future__ import annotations

from typing import Callable

import torch

from macattn.plugins import HAVE_TRITON

from .reference import seed_rows_reference

__all__ = ["seed_rows_for", "seed_rows_reference"]


def seed_rows_for(device: torch.device | str) -> Callable:
    """``op.seed_rows_`` on a CUDA ``device`` when triton imports, else ``seed_rows_reference`` (same signature)."""
    if torch.device(device).type != "cuda" or not HAVE_TRITON:
        return seed_rows_reference
    from .op import seed_rows_

    return seed_rows_
