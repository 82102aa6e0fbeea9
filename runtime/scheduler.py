"""In-flight batching scheduler: requests join and leave between steps.

Each ``step`` of the engine asks for (1) the running requests that already have a first
token — decoded together as one batch of mixed lengths — and (2) newly admitted requests,
each prefilled on its own. Admission is FIFO and needs a free state slot (MAC rings +
other per-slot state, reset on acquire) and KV blocks for ``prompt + max_new_tokens``.
Finishing releases both (the slot's states are reset again).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from macattn.runtime.block_manager import BlockManager
from macattn.runtime.sequence import Sequence, SequenceStatus
from macattn.runtime.slots import SlotStates

__all__ = ["Scheduler"]


class Scheduler:
    """``on_finish(seq)``: called for a running request about to release its slot (its per-slot
    state is still there to read)."""

    def __init__(self, slots: SlotStates, blocks: BlockManager,
                 on_finish: Callable[[Sequence], None] | None = None) -> None:
        self.slots = slots
        self.blocks = blocks
        self.on_finish = on_finish
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"request {seq.request_id} is {seq.status.value}, not waiting")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def decode_batch(self) -> list[Sequence]:
        """Running requests with at least one generated token (their next step is a decode)."""
        return [s for s in self.running if s.prefilled]

    def prefilling(self) -> list[Sequence]:
        """Running requests whose prompt is not prefilled yet (admission order)."""
        return [s for s in self.running if not s.prefilled]

    def admit(self) -> list[Sequence]:
        """Move waiting requests (FIFO) into the running set while a slot and blocks are free."""
        admitted = []
        while self.waiting and self.slots.num_free and self.blocks.can_allocate(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.slot = self.slots.acquire()
            self.blocks.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release the request's slot (states reset) and KV blocks."""
        if seq.status is SequenceStatus.RUNNING:
            if self.on_finish is not None:
                self.on_finish(seq)
            self.slots.release(seq.slot)
            self.blocks.free(seq)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.slot = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
