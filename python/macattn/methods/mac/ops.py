"""The plugin ops as ``torch.library`` custom ops in namespace ``macattn``.

Each op is one node for ``torch.export`` / ``torch.compile`` and one node in the exported
ONNX graph (domain ``macattn``, see ``docs/graph.md``). The reference (``macattn.methods.mac.reference``)
is the implementation on every device that has no faster one registered;
``register_cuda_kernels`` (through ``macattn.methods.kernels.register_kernels``) registers the
Triton launchers as the CUDA implementation.

State tensors are explicit inputs; ``mac_attend`` mutates the rings in place (declared
in ``mutates_args`` so functionalization sees the writes).
"""
from __future__ import annotations

import torch

from macattn.methods.mac.reference import mac_attend_reference, mac_match_reference, ring_append_reference
from macattn.plugins import HAVE_TRITON
from macattn.plugins.cuda_kernels import register_cuda_launchers

__all__ = ["mac_match", "mac_attend", "register_cuda_kernels"]


@torch.library.custom_op("macattn::mac_match", mutates_args=())
def mac_match(q_pre: torch.Tensor, qring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
              slots: torch.Tensor, positions: torch.Tensor, band: int, tau: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest pre-RoPE query per (request, head): ``(match_pos [B, Hq] int64 (-1 miss), dist [B, Hq] fp32)``."""
    return mac_match_reference(q_pre, qring, ring_lse, ring_pos, slots, positions, band=band, tau=tau)


@mac_match.register_fake
def _(q_pre, qring, ring_lse, ring_pos, slots, positions, band, tau):
    B, H = q_pre.shape[:2]
    return (q_pre.new_empty((B, H), dtype=torch.int64), q_pre.new_empty((B, H), dtype=torch.float32))


@torch.library.custom_op("macattn::mac_attend", mutates_args=("qring", "oring", "ring_lse", "ring_pos"))
def mac_attend(q: torch.Tensor, q_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, match_pos: torch.Tensor, slots: torch.Tensor,
               qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor, ring_pos: torch.Tensor,
               band: int, scale: float) -> torch.Tensor:
    """Complete + amend + append. Returns ``out [B, Hq, d]`` in ``q``'s dtype; writes slot
    ``m mod K`` of ``qring/oring/ring_lse/ring_pos`` for each request."""
    out, entry = mac_attend_reference(q, k, v, positions, match_pos, oring, ring_lse, slots,
                                      band=band, scale=scale)
    ring_append_reference(qring, oring, ring_lse, ring_pos, slots, positions, q_pre, entry)
    return out.to(q.dtype)


@mac_attend.register_fake
def _(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos, band, scale):
    return torch.empty_like(q)


def register_cuda_kernels() -> tuple[str, ...]:
    """Register a ``MacMatchLauncher`` / ``MacAttendLauncher`` as the CUDA kernels of ``mac_match`` /
    ``mac_attend`` (idempotent; through ``macattn.methods.kernels.register_kernels``). Returns the op
    names; ``()`` without triton."""
    if not HAVE_TRITON:
        return ()
    from macattn.plugins.mac.attend_op import MacAttendLauncher
    from macattn.plugins.mac.match_op import MacMatchLauncher

    return register_cuda_launchers({"macattn::mac_match": MacMatchLauncher, "macattn::mac_attend": MacAttendLauncher})
