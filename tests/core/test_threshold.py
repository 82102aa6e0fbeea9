"""The match-threshold rule: the paper's radius, its null false-positive rate, the calibrated scale."""
import math

import pytest
import torch

from macattn.core.threshold import false_positive_rate, match_threshold, query_scale, tau_for_false_positive_rate


@pytest.mark.parametrize("d", [16, 64, 128])
def test_false_positive_rate_is_the_null_probability(d):
    """alpha(tau) = P(||x - y|| < radius) for x, y ~ N(0, s^2 I_d) at radius s sqrt(2d)(1 - tau), any s."""
    g = torch.Generator().manual_seed(d)
    s = float(torch.rand((), generator=g)) * 3 + 0.2
    n = 40_000
    dist = (torch.randn(n, d, generator=g, dtype=torch.float64) * s
            - torch.randn(n, d, generator=g, dtype=torch.float64) * s).norm(dim=-1)
    for q in (0.02, 0.3):   # taus whose rate is large enough to measure: radius at a distance quantile
        radius = float(dist.quantile(q))
        tau = 1 - radius / (s * math.sqrt(2 * d))
        assert false_positive_rate(d, tau) == pytest.approx(q, abs=4 * math.sqrt(q * (1 - q) / n) + 1e-3)
        assert match_threshold(d, tau, s) == pytest.approx(radius)


@pytest.mark.parametrize("d,alpha", [(64, 1e-9), (128, 1e-3), (16, 0.2)])
def test_tau_for_false_positive_rate_inverts(d, alpha):
    tau = tau_for_false_positive_rate(d, alpha)
    assert 0 <= tau < 1 and false_positive_rate(d, tau) == pytest.approx(alpha, rel=1e-6)
    assert false_positive_rate(d, min(0.999, tau + 0.01)) < alpha < false_positive_rate(d, max(0.0, tau - 0.01))


def test_rules_reject_bad_arguments():
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        false_positive_rate(0, 0.5)
    with pytest.raises(ValueError, match=r"tau must be a float in \[0, 1\)"):
        false_positive_rate(64, 1.0)
    with pytest.raises(ValueError, match=r"alpha must be a float in \(0, "):
        tau_for_false_positive_rate(64, 1.0)
    with pytest.raises(ValueError, match=r"q must be \[H, N, d\] with N >= 2"):
        query_scale(torch.zeros(2, 1, 8))


def test_query_scale_recovers_each_heads_scale_and_ignores_the_mean():
    g = torch.Generator().manual_seed(3)
    scales = torch.rand(5, generator=g, dtype=torch.float64) * 4 + 0.1
    mean = torch.randn(5, 1, 32, generator=g, dtype=torch.float64) * 10
    q = torch.randn(5, 20_000, 32, generator=g, dtype=torch.float64) * scales.view(5, 1, 1) + mean
    est = query_scale(q.float())
    assert est.dtype == torch.float64 and est.shape == (5,)
    assert torch.allclose(est, scales, rtol=0.02)
