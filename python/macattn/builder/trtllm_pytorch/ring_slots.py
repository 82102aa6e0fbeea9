"""Ring-slot bookkeeping per TensorRT-LLM request id (pure Python; no ``tensorrt_llm``).

TensorRT-LLM's PyTorch executor names a request by ``LlmRequest.py_request_id`` (an int) and hands the
KV-cache manager ``prepare_resources(scheduled_batch)`` before a step and ``free_resources(request)`` when
the request ends (``pyexecutor/resource_manager.py``). Our rings are addressed by a *slot* (row ``s`` of
``qring[l] [S, Hq, K_l, d]`` etc., ``MacState``). :class:`RingSlotTable` is the map between the two over
any pool with the ``SlotPool`` protocol (``acquire() -> int`` resets and hands out a free slot,
``release(slot)`` resets and returns it), so a request's rows are empty when it gets them and when it gives
them back: no entry of one request is ever a match candidate for the next owner.

:func:`ring_bytes_per_request` / :func:`ring_bytes_per_token` size the rings for TensorRT-LLM's KV-cache
estimator (``MacKVCacheManager.get_cache_size_per_token``).
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from macattn.core.slot_pool import SlotStatePool
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.state import MacState

__all__ = ["SlotSource", "RingSlotTable", "SlotFreeList", "ring_bytes_per_request", "ring_bytes_per_token"]


def ring_bytes_per_request(cfg: MacConfig, *, num_layers: int, num_q_heads: int, head_dim: int,
                           query_dtype: torch.dtype) -> int:
    """Bytes of one ring slot over ``num_layers`` layers: exactly what ``MacState.allocate`` (all layers,
    ``qring [S, Hq, K_l, d]`` in ``query_dtype``, ``oring`` fp32, ``ring_lse`` fp32, ``ring_pos`` int64, the
    two-stage sketch ring where configured) allocates per slot. Measured on the ``meta`` device (nothing
    allocated)."""
    state = MacState.allocate(cfg, num_layers=num_layers, num_slots=1, num_q_heads=num_q_heads, head_dim=head_dim,
                              query_dtype=query_dtype, device="meta")
    rings = [*state.qring, *state.oring, *state.ring_lse, *state.ring_pos, *(s for s in state.sring if s is not None)]
    return sum(t.numel() * t.element_size() for t in rings)


def ring_bytes_per_token(cfg: MacConfig, *, num_layers: int, num_q_heads: int, head_dim: int,
                         query_dtype: torch.dtype, max_seq_len: int) -> int:
    """One ring slot's bytes spread over the ``max_seq_len`` tokens a request may hold (rounded up): what a
    per-token KV-cache estimator must add so that a pool sized for ``max_batch_size`` full-length requests
    also leaves room for their ``max_batch_size`` ring slots. ``ValueError`` naming ``max_seq_len`` if < 1."""
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be an int >= 1, got {max_seq_len!r}")
    per_request = ring_bytes_per_request(cfg, num_layers=num_layers, num_q_heads=num_q_heads, head_dim=head_dim,
                                         query_dtype=query_dtype)
    return -(-per_request // max_seq_len)


class SlotSource(Protocol):
    """What the table needs of a ring pool (``macattn.core.slot_pool.SlotPool``, e.g. ``MacState``)."""

    @property
    def num_slots(self) -> int: ...

    def acquire(self) -> int: ...

    def release(self, slot: int) -> None: ...


def _request_id(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"request_id must be an int >= 0 (LlmRequest.py_request_id), got {value!r}")
    return value


class RingSlotTable:
    """``request id -> ring slot`` over ``pool``.

    ``assign(rid)`` takes a slot for a new request (``ValueError`` if ``rid`` already has one,
    ``RuntimeError`` from the pool when all ``pool.num_slots`` are taken); ``ensure(rid)`` assigns only if
    needed (what ``prepare_resources`` calls for every scheduled request); ``free(rid)`` releases it (a
    request id never seen is ignored: upstream frees requests whose context step never ran); ``slot(rid)``
    looks one up (``KeyError`` naming the id); ``slots(rids)`` is the ``[G]`` int64 tensor of a batch's
    slots in the order given.
    """

    def __init__(self, pool: SlotSource) -> None:
        for name in ("acquire", "release", "num_slots"):
            if not hasattr(pool, name):
                raise TypeError(f"pool must have acquire(), release(slot) and num_slots (a SlotPool), "
                                f"{type(pool).__name__} lacks {name}")
        self.pool = pool
        self._slot_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, rid) -> bool:
        return rid in self._slot_of

    def assign(self, rid: int) -> int:
        rid = _request_id(rid)
        if rid in self._slot_of:
            raise ValueError(f"request {rid} already owns ring slot {self._slot_of[rid]}")
        slot = self.pool.acquire()
        self._slot_of[rid] = slot
        return slot

    def ensure(self, rid: int) -> int:
        rid = _request_id(rid)
        return self._slot_of[rid] if rid in self._slot_of else self.assign(rid)

    def free(self, rid: int) -> int | None:
        """Release ``rid``'s slot; returns it, or ``None`` when ``rid`` has none."""
        rid = _request_id(rid)
        slot = self._slot_of.pop(rid, None)
        if slot is not None:
            self.pool.release(slot)
        return slot

    def slot(self, rid: int) -> int:
        try:
            return self._slot_of[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} has no ring slot (prepare_resources did not see it)") from None

    def slots(self, rids: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """``[G]`` int64 slots of ``rids`` (in that order) on ``device``."""
        return torch.tensor([self.slot(r) for r in rids], dtype=torch.int64, device=device)


class SlotFreeList(SlotStatePool):
    """A ring-slot pool whose per-slot states arrive later (``macattn.core.slot_pool.SlotStatePool``):
    ``num_slots`` slots, handed out by ``acquire()`` and taken back by ``release(slot)``, each time calling
    ``reset(slot)`` on every state ``attach``-ed so far (e.g. a ``MacState`` allocated at a layer's first
    forward, when the query head count is known). A state attached while slots are in use is reset for
    those slots at once."""

    SLOT_KIND = "ring"

    @property
    def states(self) -> list:
        """The states attached so far, in order."""
        return self._attached
