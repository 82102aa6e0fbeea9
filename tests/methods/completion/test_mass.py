"""The completion term's calibrated mass (issue 40, ``methods.completion.mass``): one step's parts give the step
for any ``log_mass`` (the same as the fp64 reference with ``log φ_q + δ``), and ``fit_log_mass`` finds a known
``δ`` per head."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.completion.mass import LOG_MASS_GRID, fit_log_mass, layer_error, reweighed_output
from macattn.methods.completion.reference import build_completion_cache_batched, hybrid_decode_step


def _problem(seed=0, B=2, Hq=4, Hkv=2, T=60, d=16, F=8):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, Hq, d) * 1.5, r(B, Hkv, T, d) * 1.5, r(B, Hkv, T, d)
    lpq, lpk = r(B, Hq, F) * 0.5 - 1.0, r(B, Hkv, T, F) * 0.5 - 1.0
    n = torch.tensor([T - 5, T - 9])
    comp = build_completion_cache_batched(lpk, v, n, n_sink=3, n_tail=6)
    return (q, k, v, torch.tensor([T, T - 2]), n), lpq, lpk, comp


def test_parts_give_the_step_for_any_log_mass():
    base, lpq, lpk, comp = _problem()
    kw = dict(n_sink=3, n_tail=6, top_k=5)
    out, parts = hybrid_decode_step(*base, completion=(lpq, lpk, *comp), return_parts=True, **kw)
    args = (parts["out_exact"], parts["out_comp"], parts["lse_exact"], parts["lse_comp"])
    assert torch.allclose(reweighed_output(*args, 0.0), out, atol=1e-12)
    lm = torch.tensor([-2.0, 0.5, -7.0, 1.5], dtype=torch.float64)
    shifted = hybrid_decode_step(*base, completion=(lpq + lm[:, None], lpk, *comp), **kw)
    assert torch.allclose(reweighed_output(*args, lm), shifted, atol=1e-12)
    alone = hybrid_decode_step(*base, **kw)
    assert torch.allclose(parts["out_exact"], alone, atol=1e-12)                  # o_E: Top-k alone at the same k
    assert torch.allclose(reweighed_output(*args, -1e4), alone, atol=1e-12)       # δ -> -inf: the term off


def test_fit_log_mass_finds_a_known_shift_per_head():
    g = torch.Generator().manual_seed(1)
    T, H, d = 40, 3, 8
    oe, oc = torch.randn(T, H, d, generator=g), torch.randn(T, H, d, generator=g)
    le, lc = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g) + 2.0
    true = torch.tensor([-2.3, 0.0, 1.1], dtype=torch.float64)
    full = reweighed_output(oe, oc, le, lc, true)
    lm, err = fit_log_mass(oe, oc, le, lc, full)
    assert torch.allclose(lm, true, atol=1e-9) and err < 1e-9
    assert layer_error(reweighed_output(oe, oc, le, lc, 0.0), full) > 0.01
    lm0, err0 = fit_log_mass(oe, oc, le, lc, oe.double(), grid=(-3.0, -1.0))   # the term hurts: the grid's lowest
    assert lm0.tolist() == [-3.0] * H and err0 == pytest.approx(layer_error(reweighed_output(oe, oc, le, lc, -3.0),
                                                                             oe))
    assert min(LOG_MASS_GRID) < -10 and 0.0 in LOG_MASS_GRID


def test_fit_log_mass_checks_its_inputs():
    x, y = torch.zeros(4, 2, 3), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="parts must be"):
        fit_log_mass(x, x, y, torch.zeros(4, 3), x)
    with pytest.raises(ValueError, match="grid"):
        fit_log_mass(x, x, y, y, x + 1, grid=(float("nan"),))
