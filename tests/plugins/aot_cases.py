"""Plugin-order arguments of the AOT images for a ``mac_problem.Problem`` (shared by the
interpreter test and the device tests of the images and the C library)."""
from __future__ import annotations

import torch

from macattn.plugins.mac.attend_plugin import attend_aot_image, attend_kernel_spec
from macattn.plugins.mac.match_plugin import match_aot_image, match_kernel_spec

I64 = torch.int64


def match_inputs(pr) -> list[torch.Tensor]:
    return [pr.q_pre, pr.qring, pr.ring_lse, pr.ring_pos, pr.slots, pr.positions]


def match_image(pr, compiled=True):
    """The compiled ``AotImage`` (``compiled``) or just its ``KernelSpec``."""
    ins = match_inputs(pr)
    make = match_aot_image if compiled else match_kernel_spec
    return make([tuple(t.shape) for t in ins], [t.dtype for t in ins], band=pr.band, tau=pr.tau)


def match_outputs(pr, poison) -> list[torch.Tensor]:
    dev = pr.q.device
    return [poison(pr.B, pr.Hq, dtype=I64, device=dev), poison(pr.B, pr.Hq, dtype=torch.float32, device=dev)]


def attend_inputs(pr, match_pos, rings) -> list[torch.Tensor]:
    return [pr.q, pr.q_pre, pr.k, pr.v, pr.positions, match_pos, pr.slots, *rings]


def attend_image(pr, match_pos, rings, compiled=True):
    ins = attend_inputs(pr, match_pos, rings)
    make = attend_aot_image if compiled else attend_kernel_spec
    return make([tuple(t.shape) for t in ins], [t.dtype for t in ins], band=pr.band, scale=pr.scale)


def attend_outputs(pr, rings, poison) -> list[torch.Tensor]:
    """``out`` (poisoned) and the four rings themselves (aliased outputs: written in place)."""
    return [poison(pr.B, pr.Hq, pr.d, dtype=pr.q.dtype, device=pr.q.device), *rings]


def run_case_with(launch, pr, poison, compiled=True):
    """Run match then attend through ``launch(image_or_spec, args)``; returns ``(match_pos, dist, out, rings)``."""
    m_img = match_image(pr, compiled)
    match_pos, dist = match_outputs(pr, poison)
    launch(m_img, [*match_inputs(pr), pr.B, match_pos, dist])
    rings = list(pr.rings())
    a_img = attend_image(pr, match_pos, rings, compiled)
    out, *ring_outs = attend_outputs(pr, rings, poison)
    launch(a_img, [*attend_inputs(pr, match_pos, rings), pr.B, pr.T, out, *ring_outs])
    return match_pos, dist, out, rings
