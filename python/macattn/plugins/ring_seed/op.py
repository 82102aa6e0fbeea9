"""Launcher of ``seed_rows_`` (same signature and result as ``reference.seed_rows_reference``): one launch for
all the requests' rows, no host synchronisation (slots in a device tensor are read by the kernel),
CUDA-graph capturable. Every operand may be a strided view."""
from __future__ import annotations

import torch
import triton

from .checks import check_seed_rows
from .kernel import _seed_rows

__all__ = ["seed_rows_"]

# ring elements per program at most (BLOCK_K columns x BLOCK_D dims): 32 columns of d = 128, so a K = 1024 ring of
# 32 heads is 1,024 programs of 8 KB bf16 queries and 16 KB fp32 summaries each
_TILE = 4096


def seed_rows_(qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
               slots: torch.Tensor | int, q_pre: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """See ``reference.seed_rows_reference``: rows ``slots`` of the four rings written whole, one launch."""
    check_seed_rows(qring, oring, ring_lse, ring_pos, slots, q_pre, o, lse)
    B, Hq, L, d = q_pre.shape
    K = qring.shape[2]
    if B == 0:
        return
    from_ptr = isinstance(slots, torch.Tensor)
    block_d = triton.next_power_of_2(d)
    block_k = min(triton.next_power_of_2(K), max(1, _TILE // block_d))
    _seed_rows[(B * Hq, triton.cdiv(K, block_k))](
        q_pre, o, lse, slots if from_ptr else ring_pos, qring, oring, ring_lse, ring_pos, 0 if from_ptr else slots,
        Hq, K, d, L - K, (K - L % K) % K, K - min(K, L),
        *q_pre.stride(), *o.stride(), *lse.stride(), *qring.stride(), *oring.stride(), *ring_lse.stride(),
        *ring_pos.stride(), SLOT_PTR=from_ptr, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4)
