"""Per-request state slots: one registry, one acquire/release protocol for every kind of state.

A request owns one slot index from admission to finish. ``SlotStates`` hands slots out and calls
``reset(slot)`` on every registered per-slot state at both ends — the method's state (MAC rings,
retrieval-completion rows, …, from ``AttentionMethod.slot_states()``) and e.g. FastMKA's running
session summary (SPEC §2: ``L2_t``, a causal prefix mean/EMA per layer). Nothing a request
leaves behind is visible to the slot's next owner.
"""
from __future__ import annotations

import torch

from macattn.methods.base import PerSlotState

__all__ = ["PerSlotState", "TensorSlotState", "SlotStates"]


class TensorSlotState:
    """A ``[num_slots, *shape]`` tensor whose row ``slot`` is filled with ``fill`` on reset.

    Example (FastMKA session summary, per layer ``L`` and hidden size ``D``):
    ``TensorSlotState(num_slots, (L, D), torch.float32)`` plus a count ``(L,)``.
    """

    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", fill: float = 0.0) -> None:
        self.data = torch.full((num_slots, *shape), fill, dtype=dtype, device=device)
        self.fill = fill

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    def reset(self, slot: int) -> None:
        self.data[slot].fill_(self.fill)


class SlotStates:
    """The registry: named per-slot states, all with ``num_slots`` rows, and the free list."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.states: dict[str, PerSlotState] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._in_use: set[int] = set()

    def register(self, name: str, state: PerSlotState) -> PerSlotState:
        if not isinstance(state, PerSlotState):
            raise TypeError(f"state {name!r} must have num_slots and reset(slot), got {type(state).__name__}")
        if state.num_slots != self.num_slots:
            raise ValueError(f"state {name!r} has {state.num_slots} slots, registry has {self.num_slots}")
        if name in self.states:
            raise ValueError(f"a per-slot state named {name!r} is already registered")
        self.states[name] = state
        for slot in self._in_use:          # a new state starts empty for current owners too
            state.reset(slot)
        return state

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._in_use)

    @property
    def in_use(self) -> tuple[int, ...]:
        """The slots handed out (sorted)."""
        return tuple(sorted(self._in_use))

    def acquire(self) -> int:
        """A free slot with every registered state reset; raises ``RuntimeError`` if none is free."""
        if not self._free:
            raise RuntimeError(f"no free slot: all {self.num_slots} are in use")
        slot = self._free.pop()
        for state in self.states.values():
            state.reset(slot)
        self._in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Reset every state of ``slot`` and return it to the pool."""
        if slot not in self._in_use:
            raise ValueError(f"slot {slot} is not in use")
        for state in self.states.values():
            state.reset(slot)
        self._free.append(slot)
        self._in_use.discard(slot)
