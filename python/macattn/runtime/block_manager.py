"""Paged KV block manager: a pool of fixed-size blocks, per-request block tables, reference counts.

Position ``t`` of a request lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat row in the KV pool is ``block * block_size + offset``. The
block table is the source of truth: the model reads K/V only through it.

A request reserves blocks for ``prompt + max_new_tokens`` positions at admission, so a
running request never waits for memory and nothing is ever preempted. A fork of a request
(``n > 1``: ``allocate_fork``) shares its parent's full prompt blocks — nothing writes them after
the prompt's prefill — and owns the rest (the partially filled last prompt block is copied into
one of its own). A block returns to the free list when its last holder frees it.
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
        self.holders: dict[int, set[int]] = {}       # block id -> request ids holding it (its reference count)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def shared_blocks(self, prompt_len: int) -> int:
        """Blocks a fork shares with its parent: the prompt's full blocks."""
        return prompt_len // self.block_size

    def group_blocks_needed(self, seq: Sequence, forks: int | None = None) -> int:
        """Blocks ``seq`` and its ``forks`` (default: ``len(seq.forks)``) take together."""
        forks = len(seq.forks) if forks is None else forks
        n = self.blocks_needed(seq.max_tokens)
        return n + forks * (n - self.shared_blocks(len(seq.prompt)))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def ref_count(self, block: int) -> int:
        return len(self.holders.get(block, ()))

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` and its pending forks fit in the free blocks."""
        return self.group_blocks_needed(seq) <= self.num_free

    def _take(self, seq: Sequence, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"need {n} KV blocks, {self.num_free} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.holders[b] = {seq.request_id}
        return blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` a block table covering ``seq.max_tokens`` positions."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already holds blocks")
        seq.block_table = self._take(seq, self.blocks_needed(seq.max_tokens))

    def allocate_fork(self, parent: Sequence, child: Sequence) -> None:
        """Give fork ``child`` a block table covering its ``max_tokens`` positions: ``parent``'s full prompt
        blocks (shared) then blocks of its own."""
        if child.block_table:
            raise RuntimeError(f"request {child.request_id} already holds blocks")
        if child.prompt != parent.prompt or not parent.block_table:
            raise RuntimeError(f"request {child.request_id} is not a fork of holding request {parent.request_id}")
        shared = parent.block_table[:self.shared_blocks(len(parent.prompt))]
        own = self._take(child, self.blocks_needed(child.max_tokens) - len(shared))
        for b in shared:
            self.holders[b].add(child.request_id)
        child.block_table = shared + own

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks; a block no request holds returns to the free list."""
        for b in seq.block_table:
            held = self.holders.get(b)
            if held is None or seq.request_id not in held:
                raise RuntimeError(f"block {b} is not held by request {seq.request_id}")
            held.discard(seq.request_id)
            if not held:
                del self.holders[b]
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
