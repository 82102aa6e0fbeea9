"""Decode-time FastMKA state owned by the runtime: the L2 session summary per layer and request slot.

``MkaState`` holds, per layer ``l`` (``S`` slots, hidden size ``D``):

===========  ===========  =====================================================
field        shape        dtype
===========  ===========  =====================================================
mean[l]      ``[S, D]``   fp32: running prefix mean (or EMA) of the layer input
count[l]     ``[S]``      int64: tokens summarised so far (0 = empty)
in_use       ``[S]``      bool
===========  ===========  =====================================================

``mean[l]`` / ``count[l]`` are exactly the ``state_mean`` / ``state_count`` inputs of
``macattn::route_fused_attention`` (rows picked by ``slots``), mutated in place by each
decode step. A request owns one slot from ``acquire()`` to ``release()``; both reset its rows
(zeros, count 0), so nothing of one request is visible to another. ``MkaState`` also
satisfies ``runtime.slots.PerSlotState`` and can be registered in a ``SlotStates`` registry
next to the MAC rings (the registry then owns acquisition and calls ``reset``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macattn.core.slot_pool import SlotPool

__all__ = ["MkaState"]


@dataclass
class MkaState(SlotPool):
    """L2 summaries of all layers and slots; see the module docstring for shapes and dtypes."""

    SLOT_KIND = "FastMKA"

    mean: list[torch.Tensor]
    count: list[torch.Tensor]
    in_use: torch.Tensor
    _free: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def allocate(cls, *, num_layers: int, num_slots: int, hidden_size: int,
                 device: torch.device | str = "cpu") -> "MkaState":
        for name, val in (("num_layers", num_layers), ("num_slots", num_slots), ("hidden_size", hidden_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        mean = [torch.zeros(num_slots, hidden_size, dtype=torch.float32, device=device) for _ in range(num_layers)]
        count = [torch.zeros(num_slots, dtype=torch.int64, device=device) for _ in range(num_layers)]
        return cls(mean, count, torch.zeros(num_slots, dtype=torch.bool), list(range(num_slots - 1, -1, -1)))

    @property
    def num_layers(self) -> int:
        return len(self.mean)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(state_mean [S, D], state_count [S])`` of layer ``i`` (the op's state inputs)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers - 1}], got {i!r}")
        return self.mean[i], self.count[i]

    def reset(self, slot: int) -> None:
        """Empty ``slot`` in every layer (mean 0, count 0)."""
        self._check_slot(slot)
        for m, c in zip(self.mean, self.count):
            m[slot].zero_()
            c[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        """Copy ``src``'s summaries into ``dst`` in every layer (a fork continues from them)."""
        self._check_slot(src)
        self._check_slot(dst)
        for m, c in zip(self.mean, self.count):
            m[dst].copy_(m[src])
            c[dst] = c[src]

    def seed(self, layer: int, slot: int, mean: torch.Tensor, count: int) -> None:
        """Set ``slot``'s state of ``layer`` after a prefill: ``mean [D]`` and ``count`` tokens."""
        self._check_slot(slot)
        m, c = self.layer(layer)
        if tuple(mean.shape) != (m.shape[1],):
            raise ValueError(f"mean must be [D={m.shape[1]}], got shape {tuple(mean.shape)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        m[slot] = mean.to(m)
        c[slot] = count
