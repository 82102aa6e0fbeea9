"""MAC's match rule, in one place: a ring query ``q~_p`` matches ``q~_m`` iff
``||q~_m - q~_p|| < s sqrt(2 d) (1 - tau)`` (docs/spec.md §1.1), ``s`` the head's pre-RoPE query scale.

The paper's rule is ``s = 1``: the radius under an isotropic unit-variance null (paper §3.2), where
``q~_m - q~_p ~ N(0, 2 I_d)`` for unrelated queries. Its appendix B.1 reads ``tau`` as a false-positive
rate under that null, ``alpha(tau) = F_{chi2_d}(d (1 - tau)^2)`` (``false_positive_rate``). A trained
layer's queries are not unit-variance: with per-dimension scale ``s`` the null is ``N(0, 2 s^2 I_d)``
and the same ``alpha`` needs the radius ``s sqrt(2 d) (1 - tau)``. The *calibrated* threshold
(``MacConfig`` ``match_scale``) estimates ``s`` per layer and head on calibration prompts
(``query_scale``), so one ``tau`` is one false-positive rate in every layer and every model. The
kernels never see ``s``: MAC matches ``q~ / s`` (``macattn.methods.mac.backend.MacAttention.match_query``)
against a ring of ``q~ / s`` under the unit radius, which is the same test.

Used by the config, the reference, the Triton kernels, the AOT images and the TensorRT plugins.
"""
from __future__ import annotations

import math

import torch

__all__ = ["match_threshold", "false_positive_rate", "tau_for_false_positive_rate", "query_scale"]


def match_threshold(head_dim: int, tau: float, scale: float = 1.0) -> float:
    """The L2 acceptance radius ``scale sqrt(2 d) (1 - tau)`` for head dimension ``d`` (``scale``: the
    head's pre-RoPE query scale; 1 is the paper's unit-variance null)."""
    return scale * math.sqrt(2.0 * head_dim) * (1.0 - tau)


def _check_dim(head_dim: int) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")


def false_positive_rate(head_dim: int, tau: float) -> float:
    """``alpha = P(chi2_d < d (1 - tau)^2)``: the probability that two unrelated queries of the null
    (isotropic Gaussian of the head's scale) pass the test at ``tau`` (paper appendix B.1)."""
    _check_dim(head_dim)
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"tau must be a float in [0, 1), got {tau!r}")
    x = torch.tensor(head_dim * (1.0 - tau) ** 2 / 2.0, dtype=torch.float64)
    return float(torch.special.gammainc(torch.tensor(head_dim / 2.0, dtype=torch.float64), x))


def tau_for_false_positive_rate(head_dim: int, alpha: float) -> float:
    """The ``tau`` whose null false-positive rate is ``alpha`` (in ``(0, alpha(0))``):
    ``tau = 1 - sqrt(F^{-1}_{chi2_d}(alpha) / d)``, by bisection to 1e-12 in ``tau``."""
    _check_dim(head_dim)
    top = false_positive_rate(head_dim, 0.0)
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha < top):
        raise ValueError(f"alpha must be a float in (0, {top:.6g}) for head_dim={head_dim}, got {alpha!r}")
    lo, hi = 0.0, 1.0 - 1e-15           # false_positive_rate falls from top (tau=0) to 0 (tau -> 1)
    while hi - lo > 1e-12:
        mid = 0.5 * (lo + hi)
        if false_positive_rate(head_dim, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def query_scale(q: torch.Tensor) -> torch.Tensor:
    """Per-head scale of the null of pre-RoPE queries ``q [H, N, d]`` (any float dtype, ``N >= 2``):
    ``s_h = sqrt(E ||q - mean_h||^2 / d)`` (fp64 ``[H]``), so two independent queries of head ``h``
    differ by ``2 s_h^2 d`` in mean square, as ``N(0, 2 s_h^2 I_d)`` does. The mean is removed: a
    direction every query shares moves no distance."""
    if q.dim() != 3 or q.shape[1] < 2:
        raise ValueError(f"q must be [H, N, d] with N >= 2, got {tuple(q.shape)}")
    q = q.double()
    c = q - q.mean(dim=1, keepdim=True)
    return (c.square().sum(-1).mean(1) / q.shape[-1]).sqrt()
