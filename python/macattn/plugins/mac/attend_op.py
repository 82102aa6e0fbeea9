"""CUDA implementation of ``macattn::mac_attend`` (registered by
``macattn.methods.mac.ops.register_cuda_kernels``; the JIT impl of the ``mac::attend`` plugin).

Contiguous KV ``[B, Hkv, T, d]`` as the op's reference. The launcher owns one attend-only
``MacDecodePlan`` (scratch + launch parameters, no threshold) per shape bucket and stream; each call
writes a fresh output tensor, or the given ``out``.

As the JIT impl of ``mac_py::attend`` one launcher serves every layer and every TensorRT execution
context of the process. The bucket therefore leaves out the context length ``T`` (it changes every
decode step; the attend-only path's scratch and work split do not depend on it: only ``run_full``'s
static split does, which the launcher never runs), and includes the CUDA stream (two execution
contexts enqueue on different streams and must not share scratch; layers of one context run in
stream order and do). At most ``max_plans`` plans are kept (least recently used dropped). A plan
is still allocated at the first enqueue of its bucket (``tensorrt.plugin``'s JIT impl gets no
workspace from TensorRT).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..aot import destination
from .decode_plan import MacDecodePlan

__all__ = ["MacAttendLauncher"]


class MacAttendLauncher:
    """Callable with the op's contract; owns its plans, keyed by every argument that shapes them."""

    def __init__(self, max_plans: int = 16) -> None:
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValueError(f"max_plans must be an int >= 1, got {max_plans!r}")
        self.max_plans = max_plans
        self._plans: OrderedDict[tuple, MacDecodePlan] = OrderedDict()

    def plan_for(self, q: torch.Tensor, k: torch.Tensor, qring: torch.Tensor, band: int, scale: float) -> MacDecodePlan:
        """The plan of q ``[B, Hq, d]``, k ``[B, Hkv, T, d]`` (any ``T``), qring ``[S, Hq, K, d]``, band, scale,
        q's dtype and device and the current CUDA stream (made at the first call with them)."""
        B, Hq, d = q.shape
        stream = torch.cuda.current_stream(q.device).cuda_stream if q.device.type == "cuda" else None
        key = (q.device, stream, B, Hq, k.shape[1], d, qring.shape[2], band, float(scale), q.dtype)
        plan = self._plans.get(key)
        if plan is None:
            # max_context sizes only run_full's static split (never run here): 1 keeps the plan independent of T
            plan = MacDecodePlan(batch_size=B, max_context=1, num_q_heads=Hq, num_kv_heads=k.shape[1],
                                 head_dim=d, window=qring.shape[2], band=band, q_dtype=q.dtype, device=q.device,
                                 scale=scale)
            self._plans[key] = plan
            if len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def __call__(self, q: torch.Tensor, q_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor, match_pos: torch.Tensor, slots: torch.Tensor,
                 qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
                 band: int, scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as the ``macattn::mac_attend`` op: returns ``out [B, Hq, d]`` in ``q``'s dtype and
        appends ``(q_pre, entry, m)`` to slot ``m mod K`` of the rings. ``positions`` must lie in ``[0, T-1]``
        (not checked). ``out``: optional contiguous destination (TensorRT's output buffer), returned."""
        if q.dim() != 3:
            raise ValueError(f"q must be [B, Hq, d], got {tuple(q.shape)}")
        if k.dim() != 4:
            raise ValueError(f"k must be [B, Hkv, T, d], got {tuple(k.shape)}")
        out = destination(out, "out", q.shape, q.dtype, q.device)
        if q.shape[0] == 0:
            return out
        plan = self.plan_for(q, k, qring, band, scale)
        match_pos = match_pos if match_pos.stride(-1) == 1 else match_pos.contiguous()
        return plan.run_attend(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos,
                               out=out)
