"""``SlotPool``: the acquire / release / reset-on-both protocol shared by every per-request state
(``MacState`` rings, ``MkaState`` session summaries, ``CompletionState`` caches)."""
from __future__ import annotations

__all__ = ["SlotPool"]


class SlotPool:
    """Mixin for a state dataclass with fields ``in_use [S] bool`` and ``_free: list[int]`` (free
    slots, popped from the end). The subclass defines ``reset(slot)`` (empty every row of ``slot``)
    and ``SLOT_KIND`` (its name in error messages). A slot is reset when acquired and when
    released, so no request ever sees another's rows."""

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

    def acquire(self) -> int:
        """Take a free slot (reset) for a new request; raises ``RuntimeError`` if none is free."""
        if not self._free:
            raise RuntimeError(f"no free {self.SLOT_KIND} slot: all {self.num_slots} are in use")
        slot = self._free.pop()
        self.reset(slot)
        self.in_use[slot] = True
        return slot

    def release(self, slot: int) -> None:
        """Return ``slot``; its rows are reset so the next owner sees nothing of this request."""
        self._check_slot(slot)
        if not bool(self.in_use[slot]):
            raise ValueError(f"slot {slot} is not in use")
        self.reset(slot)
        self.in_use[slot] = False
        self._free.append(slot)

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots - 1}], got {slot!r}")
