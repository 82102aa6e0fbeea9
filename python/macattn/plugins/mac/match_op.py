"""CUDA implementation of ``macattn::mac_match`` (registered by
``macattn.methods.mac.ops.register_cuda_kernels``; the JIT impl of the ``mac::match`` plugin)."""
from __future__ import annotations

import torch

from macattn.core.threshold import match_threshold

from ..triton_util import default_pdl, num_sms
from ..aot import destination
from .match_kernel import check_match_inputs, launch_match, match_meta
from .two_stage import check_two_stage_inputs, launch_two_stage_match, two_stage_meta

__all__ = ["MacMatchLauncher", "TwoStageMatchLauncher"]


class MacMatchLauncher:
    """Callable with the op's contract; owns the launch scratch (partials ``[n]`` d2 / pos / lse and
    the ticket counter, left zero by every launch), one set per (device, size)."""

    def __init__(self) -> None:
        self._scratch: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _buffers(self, dev: torch.device, n: int) -> tuple[torch.Tensor, ...]:
        key = (dev, n)
        if key not in self._scratch:
            self._scratch[key] = (torch.empty(n, dtype=torch.float32, device=dev),
                                  torch.empty(n, dtype=torch.int64, device=dev),
                                  torch.empty(n, dtype=torch.float32, device=dev),
                                  torch.zeros(1, dtype=torch.int32, device=dev))
        return self._scratch[key]

    def __call__(self, q_pre: torch.Tensor, qring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor, band: int, tau: float, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as ``macattn.methods.mac.reference.mac_match_reference``:
        ``(match_pos [B, Hq] int64, dist [B, Hq] fp32)``; ``out``: optional destinations for the two
        (contiguous; TensorRT's output buffers), returned.

        One launch (partials over ring splits; the last program reduces them); no host sync, so it
        can be captured in a CUDA graph. Values of ``slots``/``positions`` are not range-checked.
        """
        check_match_inputs(q_pre, qring, ring_lse, ring_pos, slots, positions)
        B, Hq, d = q_pre.shape
        dev = q_pre.device
        mp_out, dist_out = (None, None) if out is None else out
        match_pos = destination(mp_out, "out[0] (match_pos)", (B, Hq), torch.int64, dev)
        dist = destination(dist_out, "out[1] (dist)", (B, Hq), torch.float32, dev)
        if B == 0:
            return match_pos, dist
        meta = match_meta(B, Hq, qring.shape[2], d, num_sms(dev))
        part_d2, part_pos, part_lse, counter = self._buffers(dev, B * Hq * meta.NS)
        launch_match(q_pre, qring, ring_pos, ring_lse, slots, positions, meta=meta, part_d2=part_d2,
                     part_pos=part_pos, part_lse=part_lse, counter=counter, match_pos=match_pos, dist=dist,
                     band=band, thr=match_threshold(d, tau), finish=True, pdl=default_pdl(dev))
        return match_pos, dist


class TwoStageMatchLauncher:
    """The two-stage match (``two_stage.py``) with the exact match's contract plus the sketches:
    ``(q_pre, proj, qring, sring, ring_lse, ring_pos, slots, positions, band, tau, candidates)``
    -> ``(match_pos [B, Hq] int64, dist [B, Hq] fp32, q_sketch [B, Hq, DS] fp32)``; owns the partials,
    one set per (device, size). The same function as
    ``macattn.methods.mac.reference.mac_match_two_stage_reference`` given the returned ``q_sketch``,
    when ``sring`` holds the sketches (``macattn.methods.mac.match_sketch``) of ``qring`` and ``proj``
    is ``sketch_projection`` of a projected sketch (None: E4M3 of the entry)."""

    def __init__(self) -> None:
        self._scratch: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _buffers(self, dev: torch.device, n: int) -> tuple[torch.Tensor, ...]:
        if (dev, n) not in self._scratch:
            self._scratch[(dev, n)] = (torch.empty(n, dtype=torch.float32, device=dev),
                                       torch.empty(n, dtype=torch.float32, device=dev),
                                       torch.empty(n, dtype=torch.int32, device=dev))
        return self._scratch[(dev, n)]

    def __call__(self, q_pre: torch.Tensor, proj: torch.Tensor | None, qring: torch.Tensor, sring: torch.Tensor,
                 ring_lse: torch.Tensor, ring_pos: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 band: int, tau: float, candidates: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_two_stage_inputs(q_pre, proj, qring, sring, ring_lse, ring_pos, slots, positions)
        B, Hq, d = q_pre.shape
        dev = q_pre.device
        match_pos = torch.empty(B, Hq, dtype=torch.int64, device=dev)
        dist = torch.empty(B, Hq, dtype=torch.float32, device=dev)
        q_sketch = torch.empty(B, Hq, sring.shape[3], dtype=torch.float32, device=dev)
        if B == 0:
            return match_pos, dist, q_sketch
        meta = two_stage_meta(B, Hq, qring.shape[2], d, candidates, num_sms(dev), sketch_dims=sring.shape[3],
                              sketch_itemsize=sring.element_size())
        part_a, part_e, part_k = self._buffers(dev, B * Hq * meta.NS * meta.C)
        launch_two_stage_match(q_pre, proj, qring, sring, ring_pos, ring_lse, slots, positions, meta=meta,
                               q_sketch=q_sketch, part_a=part_a, part_e=part_e, part_k=part_k, match_pos=match_pos,
                               dist=dist, band=band, thr=match_threshold(d, tau))
        return match_pos, dist, q_sketch
