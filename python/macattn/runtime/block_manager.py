"""Paged KV block manager: a pool of fixed-size blocks, per-request block tables, reference counts,
automatic prefix caching.

Position ``t`` of a request lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat row in the KV pool is ``block * block_size + offset``. The
block table is the source of truth: the model reads K/V only through it.

A request reserves blocks for ``prompt + max_new_tokens`` positions at admission, so a
running request never waits for memory and nothing is ever preempted. A fork of a request
(``n > 1``: ``allocate_fork``) shares its parent's full prompt blocks — nothing writes them after
the prompt's prefill — and owns the rest (the partially filled last prompt block is copied into
one of its own). A block's holders are the requests whose table has it (its reference count).

Prefix caching (a ``salt`` given; ``macattn.runtime.prefix_cache``): a full prompt block whose K/V is
written (``commit``) is registered under its hash-chain key; a later request whose prompt starts with
the same tokens takes the cached blocks (``lookup``, then ``allocate(seq, cached)``: held, not copied)
and prefills only the rest. A block no request holds returns to a free list: ``free_blocks`` when it
holds no cached prefix, ``evictable`` (least recently freed first) when it does — still found by
``lookup`` until an allocation runs out of plain free blocks and evicts it (its key is forgotten).
"""
from __future__ import annotations

from collections import OrderedDict, deque

import torch

from macattn.runtime.prefix_cache import PrefixCacheStats, block_hashes
from macattn.runtime.sequence import Sequence

__all__ = ["BlockManager"]


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` positions; ``salt``: the root of the prefix-cache hash chains
    (``prefix_cache.cache_salt``), None = no prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, *, salt: bytes | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))   # free, holding no cached prefix
        self.evictable: OrderedDict[int, None] = OrderedDict()    # free, holding a cached prefix; LRU first
        self.holders: dict[int, set[int]] = {}       # block id -> request ids holding it (its reference count)
        self.salt = salt
        self.cached: dict[bytes, int] = {}           # block key -> the block holding that prefix block's K/V
        self.block_key: dict[int, bytes] = {}        # the reverse: cached block -> its key
        self.stats = PrefixCacheStats()

    @property
    def caching(self) -> bool:
        """Whether prefix caching is on."""
        return self.salt is not None

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
        """Blocks no request holds (plain free ones and cached ones an allocation may evict)."""
        return len(self.free_blocks) + len(self.evictable)

    def ref_count(self, block: int) -> int:
        return len(self.holders.get(block, ()))

    def can_allocate(self, seq: Sequence, cached: list[int] = ()) -> bool:
        """Whether ``seq`` and its pending forks fit in the free blocks when ``seq`` starts with the
        ``cached`` blocks (``lookup``: those no request holds leave the free list too)."""
        taken = sum(1 for b in cached if b in self.evictable)
        return self.group_blocks_needed(seq) - len(cached) + taken <= self.num_free

    def _take(self, seq: Sequence, n: int) -> list[int]:
        """``n`` free blocks for ``seq``: plain free ones first, then cached ones, least recently freed first
        (evicted: their keys are forgotten)."""
        if n > self.num_free:
            raise RuntimeError(f"need {n} KV blocks, {self.num_free} free")
        blocks = [self.free_blocks.popleft() for _ in range(min(n, len(self.free_blocks)))]
        while len(blocks) < n:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_key.pop(b)]
            blocks.append(b)
        for b in blocks:
            self.holders[b] = {seq.request_id}
        return blocks

    def allocate(self, seq: Sequence, cached: list[int] = ()) -> None:
        """Give ``seq`` a block table covering ``seq.max_tokens`` positions that starts with the ``cached``
        blocks (``lookup``'s, held from now on; taken before any eviction) followed by blocks of its own."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id} already holds blocks")
        for b in cached:
            if b not in self.block_key:
                raise RuntimeError(f"block {b} holds no cached prefix")
            self.evictable.pop(b, None)
            self.holders.setdefault(b, set()).add(seq.request_id)
        seq.block_table = list(cached) + self._take(seq, self.blocks_needed(seq.max_tokens) - len(cached))

    # --- prefix caching ----------------------------------------------------------------------
    def prompt_keys(self, seq: Sequence) -> tuple[bytes, ...]:
        """The hash-chain keys of ``seq``'s full prompt blocks (computed once, kept in ``seq.block_hashes``)."""
        if seq.block_hashes is None:
            if self.salt is None:
                raise RuntimeError("prefix caching is off (BlockManager without a salt)")
            seq.block_hashes = block_hashes(seq.prompt, self.block_size, self.salt)
        return seq.block_hashes

    def lookup(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prompt prefix of at most ``max_tokens`` tokens (whole
        blocks, in order; empty when none). Reads only; ``allocate(seq, cached)`` takes them."""
        out = []
        for key in self.prompt_keys(seq)[:max(max_tokens, 0) // self.block_size]:
            b = self.cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """Register the full prompt blocks of ``seq`` that positions ``start .. end - 1`` completed (their
        K/V written by a prefill) under their keys. A block whose prefix another block already holds stays
        private (it returns to the plain free list when freed)."""
        keys = self.prompt_keys(seq)
        for i in range(start // self.block_size, min(end // self.block_size, len(keys))):
            b = seq.block_table[i]
            if b not in self.block_key and keys[i] not in self.cached:
                self.cached[keys[i]] = b
                self.block_key[b] = keys[i]

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
        """Drop ``seq``'s hold on its blocks; a block no request holds returns to a free list (``evictable``
        when it holds a cached prefix: last block first, so a prompt's tail is evicted before its head)."""
        for b in reversed(seq.block_table):
            held = self.holders.get(b)
            if held is None or seq.request_id not in held:
                raise RuntimeError(f"block {b} is not held by request {seq.request_id}")
            held.discard(seq.request_id)
            if not held:
                del self.holders[b]
                if b in self.block_key:
                    self.evictable[b] = None
                else:
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
