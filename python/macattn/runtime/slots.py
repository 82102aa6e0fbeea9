"""Per-request state slots: one registry, one acquire/release protocol for every kind of state.

A request owns one slot index from admission to finish. ``SlotStates`` hands slots out and calls
``reset(slot)`` on every registered per-slot state at both ends — the method's state (MAC rings,
retrieval-completion rows, …, from ``AttentionMethod.slot_states()``) and e.g. FastMKA's running
session summary (docs/spec.md §2: ``L2_t``, a causal prefix mean/EMA per layer). Nothing a request
leaves behind is visible to the slot's next owner.
"""
from __future__ import annotations

import torch

from macattn.core.slot_pool import SlotStatePool
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

    def copy(self, src: int, dst: int) -> None:
        self.data[dst].copy_(self.data[src])


class SlotStates(SlotStatePool):
    """The registry: named per-slot states (``states``), all with ``num_slots`` rows, over the one slot
    free list (``macattn.core.slot_pool.SlotStatePool``)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.states: dict[str, PerSlotState] = {}

    def register(self, name: str, state: PerSlotState) -> PerSlotState:
        if not isinstance(state, PerSlotState):
            raise TypeError(f"state {name!r} must have num_slots and reset(slot), got {type(state).__name__}")
        if name in self.states:
            raise ValueError(f"a per-slot state named {name!r} is already registered")
        self.states[name] = self.attach(state, name)
        return state

    def uncopyable(self) -> list[str]:
        """The registered states without ``copy(src, dst)``: a request with forks (``n > 1``) cannot run over
        them."""
        return [name for name, state in self.states.items() if not callable(getattr(state, "copy", None))]

    def copy(self, src: int, dst: int) -> None:
        """Copy every registered state's rows of held slot ``src`` into held slot ``dst`` (a fork's start:
        ``dst`` continues from where ``src``'s request is). ``NotImplementedError`` naming the states that
        cannot be copied."""
        missing = self.uncopyable()
        if missing:
            raise NotImplementedError(f"the per-slot states {missing} cannot be copied (no copy(src, dst))")
        for slot in (src, dst):
            if not self._held(slot):
                raise ValueError(f"slot {slot} is not in use")
        for state in self.states.values():
            state.copy(src, dst)
