"""In-flight batching scheduler: requests join and leave between steps.

``schedule()`` returns one ``ScheduledStep`` under one token budget (``max_num_batched_tokens``, the
Sarathi-Serve / vLLM v1 rule): every running request that already has a token decodes (one token
each), then admission, then prompt chunks of the requests being prefilled, in admission order, up to
the budget (``None``: whole prompts); a step with no decode (nothing waits on it) takes prompt tokens up to
``max_prefill_tokens`` instead. The step's first chunk takes the rest of its prompt whole where that rest fits
the budget, even if the step's decode rows leave less room (the step then exceeds the budget by at most its
decodes): a prompt is not split into a near-whole chunk and a remainder just because streams decode beside it.
A prompt the executor cannot split (``packs`` False: A3's chunked prompts, prefix-store loads, methods keeping
their own KV) is scheduled whole, alone if it exceeds the budget. A chunk that leaves part of its prompt is a
multiple of ``chunk_quantum`` tokens (``quantized_chunk``; CUDA: ``config.CUDA_CHUNK_QUANTUM``) and its step's first
chunk, so a long prompt is cut at the same points whatever the decodes or other prompts beside it: its chunks
over their history have the shapes whose cuDNN plans the server builds at start-up
(``ModelExecutor.prewarm_graphs``).
Admission is FIFO and needs a free state slot (MAC rings + other per-slot state, reset on
acquire) and KV blocks for ``prompt + max_new_tokens``. Finishing releases both (the slot's states are
reset again). A request sampled ``n`` times is admitted with its forks (``n`` slots; the forks' blocks
beyond the shared full prompt blocks); once its prompt is prefilled, ``fork`` starts them.

Prefix caching (``prefix_recompute`` set; ``runtime/block_manager.py``): at admission a request whose prompt
packs and needs no ``prompt_logprobs`` takes the longest cached prefix of whole blocks that leaves at least
``prefix_recompute(prompt length)`` prompt tokens to compute (the method's need, ``prefix_recompute_tokens``),
and starts with ``num_prefilled`` there: its prefill is a continued chunk over the cached K/V. ``commit`` registers
the full prompt blocks a prefill call wrote.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from macattn.core.validation import check_int
from macattn.runtime.block_manager import BlockManager
from macattn.runtime.config import quantized_chunk
from macattn.runtime.sequence import PrefillChunk, Sequence, SequenceStatus
from macattn.runtime.slots import SlotStates

__all__ = ["Scheduler", "ScheduledStep"]


@dataclass(frozen=True)
class ScheduledStep:
    """What one engine step runs: ``decodes`` (one token each, at ``num_tokens - 1``) and ``prefills``
    (prompt chunks; a chunk ending its prompt yields the request's first token)."""

    decodes: tuple[Sequence, ...] = ()
    prefills: tuple[PrefillChunk, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """``on_finish(seq)``: called for a running request about to release its slot (its per-slot
    state is still there to read)."""

    def __init__(self, slots: SlotStates, blocks: BlockManager,
                 on_finish: Callable[[Sequence], None] | None = None, *,
                 max_num_batched_tokens: int | None = None, max_prefill_tokens: int | None = None,
                 packs: Callable[[Sequence], bool] = lambda s: True,
                 prefix_recompute: Callable[[int], int] | None = None,
                 chunk_quantum: int = 1) -> None:
        self.slots = slots
        self.blocks = blocks
        self.on_finish = on_finish
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = max_num_batched_tokens if max_prefill_tokens is None else max_prefill_tokens
        if (self.max_prefill_tokens is None) != (max_num_batched_tokens is None):
            raise ValueError("max_prefill_tokens needs max_num_batched_tokens (both None: whole prompts)")
        self.packs = packs
        if prefix_recompute is not None and (not callable(prefix_recompute) or not blocks.caching):
            raise ValueError(f"prefix_recompute must be None or a callable (prompt length -> tokens >= 1 to "
                             f"recompute) over a caching BlockManager, got {prefix_recompute!r} "
                             f"(caching={blocks.caching})")
        self.prefix_recompute = prefix_recompute
        check_int("chunk_quantum", chunk_quantum, 1)
        self.chunk_quantum = chunk_quantum
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"request {seq.request_id} is {seq.status.value}, not waiting")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def decode_batch(self) -> list[Sequence]:
        """Running requests with at least one generated token and tokens left to generate (their next step is
        a decode; one whose pending token is its last finishes when the engine reads it)."""
        return [s for s in self.running if s.prefilled and s.num_generated < s.sampling.max_new_tokens]

    def prefilling(self) -> list[Sequence]:
        """Running requests whose prompt is not prefilled yet (admission order)."""
        return [s for s in self.running if not s.prefilled]

    def schedule(self) -> ScheduledStep:
        """The next step (module doc); admits waiting requests. Chunks are cut by ``num_prefilled``,
        which the executor advances when it runs them."""
        decodes = tuple(self.decode_batch())
        budget = self.max_num_batched_tokens if decodes else self.max_prefill_tokens
        left = None if budget is None else budget - len(decodes)
        self.admit()
        prefills: list[PrefillChunk] = []
        for seq in self.prefilling():
            if left is not None and left <= 0:
                break
            start, L = seq.num_prefilled, len(seq.prompt)
            if left is None:
                end = L
            elif not self.packs(seq):
                if start != 0:
                    raise RuntimeError(f"request {seq.request_id} cannot be split but is partly prefilled")
                if prefills and L > left:     # whole prompts in admission order: it waits for a step of its own
                    break
                end = L
            elif L - start <= left + (0 if prefills else len(decodes)):
                end = L           # the rest of the prompt, whole even where the step's decode rows leave less room
            elif prefills:        # a chunk that leaves part of its prompt is its step's first: the prompt waits
                break
            else:                 # a multiple of the quantum
                end = start + quantized_chunk(left, self.chunk_quantum)
            prefills.append(PrefillChunk(seq, start, end))
            if left is not None:
                left -= end - start
        return ScheduledStep(decodes, tuple(prefills))

    def admit(self) -> list[Sequence]:
        """Move waiting requests (FIFO) into the running set while slots and blocks are free (a request
        with forks: one slot each, and their blocks; the forks wait for the parent's prompt)."""
        admitted = []
        while self.waiting and self.slots.num_free >= 1 + len(self.waiting[0].forks):
            seq = self.waiting[0]
            looks = self._looks_up(seq)
            cached = (self.blocks.lookup(seq, len(seq.prompt) - self.prefix_recompute(len(seq.prompt)))
                      if looks else [])
            if not self.blocks.can_allocate(seq, cached):
                break
            self.waiting.popleft()
            seq.slot = self.slots.acquire()
            self.blocks.allocate(seq, cached)
            seq.num_prefilled = seq.num_cached_tokens = len(cached) * self.blocks.block_size
            if looks:
                self.blocks.stats.queries += len(seq.prompt)
                self.blocks.stats.hits += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            for child in seq.forks:
                child.slot = self.slots.acquire()
                self.blocks.allocate_fork(seq, child)
                child.status = SequenceStatus.FORK_PENDING
        return admitted

    def _looks_up(self, seq: Sequence) -> bool:
        """Whether ``seq`` may start from cached blocks: caching on, a prompt prefilled in packed chunks (a
        whole-prompt prefill writes all its KV itself) and no ``prompt_logprobs`` (every position's logits)."""
        return self.prefix_recompute is not None and self.packs(seq) and seq.sampling.prompt_logprobs is None

    def commit(self, chunk: PrefillChunk) -> None:
        """After ``chunk`` ran: register the full prompt blocks it completed with the prefix cache (a packed
        request still running whose ``num_prefilled`` advanced; nothing when caching is off)."""
        seq = chunk.seq
        if (self.prefix_recompute is not None and seq.status is SequenceStatus.RUNNING and self.packs(seq)
                and seq.num_prefilled > chunk.start):
            self.blocks.commit(seq, chunk.start, seq.num_prefilled)

    def fork(self, parent: Sequence, copy_kv: Callable[[Sequence, Sequence], None]) -> list[Sequence]:
        """Start ``parent``'s forks once its prompt is prefilled: each gets a copy of the parent's per-slot
        states (``SlotStates.copy``) and, through ``copy_kv(parent, child)``, of its partially filled last
        prompt block; they join the running set as prefilled. Returns them (in index order)."""
        if not parent.forks:
            return []
        if parent.num_prefilled != len(parent.prompt):
            raise RuntimeError(f"request {parent.request_id}'s prompt is not prefilled")
        children, parent.forks = parent.forks, []
        for child in children:
            if child.status is not SequenceStatus.FORK_PENDING:
                raise RuntimeError(f"fork {child.request_id} is {child.status.value}, not pending")
            self.slots.copy(parent.slot, child.slot)
            copy_kv(parent, child)
            child.num_prefilled = parent.num_prefilled
            child.prompt_logprobs = parent.prompt_logprobs
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release the request's slot (states reset) and KV blocks. A parent ending before its forks started
        ends them too (with the same reason); a fork ending before it started leaves its parent's group."""
        if seq.status is SequenceStatus.RUNNING:
            if self.on_finish is not None:
                self.on_finish(seq)
            self.slots.release(seq.slot)
            self.blocks.free(seq)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.FORK_PENDING:
            self.slots.release(seq.slot)
            self.blocks.free(seq)
        elif seq.status is SequenceStatus.WAITING and seq.parent is None:
            self.waiting.remove(seq)
        if seq.parent is not None and seq in seq.parent.forks:
            seq.parent.forks.remove(seq)
        seq.slot = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for child in list(seq.forks):       # each leaves ``seq.forks``
            self.finish(child, reason)
