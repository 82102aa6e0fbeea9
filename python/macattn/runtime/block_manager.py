"""Paged KV block manager: a pool of fixed-size blocks, per-request block tables.

Position ``t`` of a request lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat row in the KV pool is ``block * block_size + offset``. The
block table is the source of truth: the model reads K/V only through it.

A request reserves blocks for ``prompt + max_new_tokens`` positions at admission, so a
running request never waits for memory and nothing is ever preempted.
"""
from __future__ import annotations

from collections import deque

import torch

from macattn.runtime.sequence import Sequence

__all__ = ["BlockManager"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.owner: dict[int, int] = {}          # block id -> request id (for checks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq.max_tokens) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` a block table covering ``seq.max_tokens`` positions."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already holds blocks")
        n = self.blocks_needed(seq.max_tokens)
        if n > self.num_free:
            raise RuntimeError(f"need {n} KV blocks, {self.num_free} free")
        seq.block_table = [self.free_blocks.popleft() for _ in range(n)]
        for b in seq.block_table:
            self.owner[b] = seq.request_id

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            if self.owner.pop(b, None) != seq.request_id:
                raise RuntimeError(f"block {b} is not owned by request {seq.request_id}")
            self.free_blocks.append(b)
        seq.block_table = []

    def rows(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Flat pool rows ``[end - start]`` int64 of positions ``start .. end - 1`` of ``seq``."""
        if end > len(seq.block_table) * self.block_size:
            raise RuntimeError(f"position {end - 1} is past request {seq.request_id}'s blocks")
        t = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return table[t // self.block_size] * self.block_size + t % self.block_size

    def gather_rows(self, seqs: list[Sequence], lengths: list[int]) -> torch.Tensor:
        """``[B, T]`` int64 pool rows of positions ``0 .. lengths[b] - 1`` (``T = max(lengths)``);
        entries past a request's length point at row 0 and must be masked by the reader."""
        T = max(lengths)
        out = torch.zeros(len(seqs), T, dtype=torch.int64)
        for b, (seq, n) in enumerate(zip(seqs, lengths)):
            out[b, :n] = self.rows(seq, 0, n)
        return out
