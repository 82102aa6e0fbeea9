"""The one slot free list: ``acquire`` hands out a free slot, ``release`` takes it back, and the slot is
reset on both, so no request ever sees another's rows.

* ``SlotPool`` — the protocol and its bookkeeping. As a mixin of a per-request state dataclass
  (``MacState`` rings, ``MkaState`` session summaries, ``CompletionState`` caches, ``OffloadedKV``) it
  keeps its ``in_use [S] bool`` tensor field and ``_free`` list, and ``reset(slot)`` empties the state.
* ``SlotStatePool`` — a pool over per-slot states attached to it (each with ``reset(slot)``), whose
  reset empties every one: the runtime's registry (``runtime.slots.SlotStates``) and the TensorRT-LLM
  backend's ring pool (``builder.trtllm_pytorch.ring_slots.SlotFreeList``, whose rings arrive later).
"""
from __future__ import annotations

from macattn.core.validation import check_int

__all__ = ["SlotPool", "SlotStatePool"]


class SlotPool:
    """Free slots in ``_free`` (popped from the end); who holds a slot is recorded by ``_hold`` and read
    by ``_held`` — by default in an ``in_use [S] bool`` tensor (a dataclass field of the state using the
    mixin). The subclass defines ``reset(slot)`` (empty every row of ``slot``) and ``SLOT_KIND`` (its name
    in error messages, ``"MAC"``: "no free MAC slot"; empty: "no free slot")."""

    SLOT_KIND = "state"
    in_use: "torch.Tensor"  # noqa: F821 - declared by the dataclass using the mixin
    _free: list

    @property
    def num_slots(self) -> int:
        return int(self.in_use.numel())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reset(self, slot: int) -> None:
        raise NotImplementedError

    def _hold(self, slot: int, held: bool) -> None:
        self.in_use[slot] = held

    def _held(self, slot: int) -> bool:
        return bool(self.in_use[slot])

    def _what(self) -> str:
        return f"{self.SLOT_KIND} slot" if self.SLOT_KIND else "slot"

    def acquire(self) -> int:
        """Take a free slot (reset) for a new request; raises ``RuntimeError`` if none is free."""
        if not self._free:
            raise RuntimeError(f"no free {self._what()}: all {self.num_slots} are in use")
        slot = self._free.pop()
        self.reset(slot)
        self._hold(slot, True)
        return slot

    def release(self, slot: int) -> None:
        """Return ``slot``; its rows are reset so the next owner sees nothing of this request."""
        self._check_slot(slot)
        if not self._held(slot):
            raise ValueError(f"{self._what()} {slot} is not in use")
        self.reset(slot)
        self._hold(slot, False)
        self._free.append(slot)

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots - 1}], got {slot!r}")


class SlotStatePool(SlotPool):
    """``num_slots`` slots over the per-slot states ``attach``-ed to it: a reset empties each of them. A
    state attached while slots are held is reset for those slots at once (it starts empty for their
    owners too). ``in_use``: the held slots, sorted."""

    SLOT_KIND = ""

    def __init__(self, num_slots: int) -> None:
        check_int("num_slots", num_slots, 1)
        self._num = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._holders: set[int] = set()
        self._attached: list = []

    @property
    def num_slots(self) -> int:
        return self._num

    @property
    def in_use(self) -> tuple[int, ...]:
        """The slots handed out (sorted)."""
        return tuple(sorted(self._holders))

    def _hold(self, slot: int, held: bool) -> None:
        (self._holders.add if held else self._holders.discard)(slot)

    def _held(self, slot: int) -> bool:
        return slot in self._holders

    def attach(self, state, name: str | None = None):
        """Add ``state`` (``reset(slot)``; ``num_slots``, if it has one, must be the pool's); ``name`` only
        for error messages. Returns ``state``."""
        label = "state" if name is None else f"state {name!r}"
        if not callable(getattr(state, "reset", None)):
            raise TypeError(f"{label} must have reset(slot), got {type(state).__name__}")
        if getattr(state, "num_slots", self._num) != self._num:
            raise ValueError(f"{label} has {state.num_slots} slots, the pool has {self._num}")
        self._attached.append(state)
        for slot in self._holders:
            state.reset(slot)
        return state

    def reset(self, slot: int) -> None:
        for state in self._attached:
            state.reset(slot)
