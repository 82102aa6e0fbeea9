"""MAC's match rule, in one place: a ring query ``q~_p`` matches ``q~_m`` iff
``||q~_m - q~_p|| < sqrt(2 d) (1 - tau)`` (SPEC §1.2; the radius under an isotropic
unit-variance null, paper §3.2). Used by the config, the reference, the Triton kernels, the AOT
images and the TensorRT plugins."""
from __future__ import annotations

import math

__all__ = ["match_threshold"]


def match_threshold(head_dim: int, tau: float) -> float:
    """The L2 acceptance radius ``sqrt(2 d) (1 - tau)`` for head dimension ``d``."""
    return math.sqrt(2.0 * head_dim) * (1.0 - tau)
