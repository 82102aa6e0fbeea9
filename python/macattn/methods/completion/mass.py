"""The completion term's calibrated mass (issue 40): fit, per layer and query head, the ``δ`` that
``CompletionGate.log_mass`` adds to ``log φ_q``.

Why: the distilled maps estimate the softmax mass of the whole mid region ``M`` (their distillation targets
it), while a decode step needs the mass of what the Top-k leaves, ``M \\ R``; a kernel surrogate flatter than
softmax under-counts the peaks the Top-k removes and over-counts the tail that stays, so the term's share of
the softmax is too large, the more so the larger the budget (``benchmarks/notes/completion_fidelity.md``).
Adding ``δ`` to ``log φ_q`` multiplies the term's numerator and denominator by ``e^δ``: its share changes, its
direction ``num / den`` does not. So a step's output for any ``δ`` follows from one step's parts
(``reference.hybrid_decode_step(return_parts=True)``), and ``δ`` is fitted on calibration steps without
re-running the model:

    out(δ) = o_E + σ(lse_C + δ - lse_E) · (o_C - o_E)

(``o_E``: softmax over the exact set, ``o_C``: the term's ``num / den``, ``lse_*`` their log-denominators,
``σ`` the logistic function). ``fit_log_mass`` takes, per head, the ``δ`` of a grid minimising the mean over
steps of ``||o_h(δ) - f_h||² / ||f||²`` (``f``: full attention, all heads of the layer; the squared form of
the recorder's per-layer error, separable over heads).
"""
from __future__ import annotations

import torch

__all__ = ["LOG_MASS_GRID", "reweighed_output", "layer_error", "fit_log_mass"]

LOG_MASS_GRID = tuple(x / 10 for x in range(-120, 41))      # δ from e^-12 to e^4, steps of 0.1


def reweighed_output(out_exact: torch.Tensor, out_comp: torch.Tensor, lse_exact: torch.Tensor,
                     lse_comp: torch.Tensor, log_mass) -> torch.Tensor:
    """``out(δ)`` of the module docstring: ``out_exact / out_comp [..., Hq, d]``, ``lse_exact / lse_comp [..., Hq]``
    (``lse_comp = -inf``: no term, ``out = out_exact``), ``log_mass`` a float or a tensor broadcast against
    ``[..., Hq]``; fp64 ``[..., Hq, d]``."""
    lm = torch.as_tensor(log_mass, dtype=torch.float64)
    w = torch.sigmoid(lse_comp.double() + lm - lse_exact.double())
    oe = out_exact.double()
    return oe + w[..., None] * (out_comp.double() - oe)


def layer_error(out: torch.Tensor, full: torch.Tensor) -> float:
    """Mean over steps of ``||out_t - full_t|| / ||full_t||`` (norms over heads and ``d``): ``out / full [T, Hq,
    d]`` (the evaluation recorder's per-layer error)."""
    diff = (out.double() - full.double()).flatten(1).norm(dim=1)
    return float((diff / full.double().flatten(1).norm(dim=1).clamp_min(1e-30)).mean())


def fit_log_mass(out_exact: torch.Tensor, out_comp: torch.Tensor, lse_exact: torch.Tensor, lse_comp: torch.Tensor,
                 full: torch.Tensor, grid=LOG_MASS_GRID) -> tuple[torch.Tensor, float]:
    """``(log_mass [Hq] fp64, layer error with it)`` of one layer over ``T`` calibration steps: the parts of
    ``reweighed_output`` (``[T, Hq, d]`` / ``[T, Hq]``) and full attention ``full [T, Hq, d]``; ``grid``: the
    candidate ``δ`` (ties to the first, so with 0 in it no worse than the uncorrected term)."""
    if full.dim() != 3 or full.shape[0] == 0 or out_exact.shape != full.shape or out_comp.shape != full.shape \
            or lse_exact.shape != full.shape[:2] or lse_comp.shape != full.shape[:2]:
        raise ValueError(f"parts must be [T >= 1, Hq, d] / [T, Hq] like full {tuple(full.shape)}, got "
                         f"{[tuple(x.shape) for x in (out_exact, out_comp, lse_exact, lse_comp)]}")
    g = torch.tensor(grid, dtype=torch.float64)
    if g.numel() == 0 or not bool(torch.isfinite(g).all()):
        raise ValueError("grid must hold at least one finite δ")
    g = torch.cat([torch.zeros(1, dtype=torch.float64), g])       # δ = 0 first: ties keep the uncorrected term
    o = reweighed_output(out_exact[None], out_comp[None], lse_exact[None], lse_comp[None], g[:, None, None])
    fn = full.double().flatten(1).norm(dim=1).clamp_min(1e-30)      # [T]
    sq = ((o - full.double()[None]) ** 2).sum(-1) / (fn ** 2)[None, :, None]   # [G, T, Hq]
    best = sq.mean(1).argmin(0)                                    # [Hq]
    log_mass = g[best]
    return log_mass, layer_error(reweighed_output(out_exact, out_comp, lse_exact, lse_comp, log_mass), full)
