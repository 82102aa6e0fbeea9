"""The two-stage match kernels (``macattn.plugins.mac.two_stage``) against
``mac_match_two_stage_reference``: every sketch, 1-16 candidates, d = 64 / 128, windows that are
not a multiple of the scan block, several ring splits, empty and out-of-window slots, wrapped
positions, unfinished entries (``lse = -inf``), poisoned outputs. GPU; ``MACATTN_TRITON_INTERPRET=1``
runs them through Triton's interpreter on the CPU (``test_two_stage_match_interp.py`` does, in CI).

Decisions must equal the reference's except for a head where fp32 summation order may legitimately
flip one: its C-th and (C+1)-th sketch distances, its two nearest candidates' exact distances, or
its exact distance and the threshold lie within 1e-4 (relative) of each other.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from triton_env import DEVICE, GPU_MARKS  # noqa: E402  (first: sets the interpreter switch)
from macattn.core.threshold import match_threshold  # noqa: E402
from macattn.methods.mac.config import MATCH_SKETCHES  # noqa: E402
from macattn.methods.mac.match_sketch import sketch, sketch_dtype, sketch_projection_of  # noqa: E402
from macattn.methods.mac.reference import mac_match_two_stage_reference  # noqa: E402

pytestmark = GPU_MARKS
NEAR = 1e-4


def _problem(B, Hq, K, d, m, seed, sketch_kind):
    g = torch.Generator().manual_seed(seed)
    S = B + 2
    qring = torch.randn(S, Hq, K, d, generator=g).to(torch.bfloat16)
    ring_pos = torch.full((S, K), -1, dtype=torch.int64)
    for s in range(S):
        t = torch.arange(max(0, m - K - 3), m)            # a few stale (out-of-window) positions too
        t = t[torch.rand(t.numel(), generator=g) > 0.15]
        ring_pos[s, t % K] = t
    ring_lse = torch.randn(S, Hq, K, generator=g)
    ring_lse[torch.rand(S, Hq, K, generator=g) < 0.05] = float("-inf")
    slots = torch.randperm(S, generator=g)[:B]
    q = torch.randn(B, Hq, d, generator=g)
    near = torch.rand(B, Hq, generator=g) < 0.6
    near[-1, -1] = False                                   # a query far from every entry: a miss
    pick = torch.randint(0, K, (B, Hq), generator=g)
    ok = (ring_pos[slots[0]] >= max(4, m - K)) & torch.isfinite(ring_lse[slots[0], 0])
    near[0, 0], pick[0, 0] = True, int(torch.nonzero(ok)[0])   # one near a valid entry: a hit
    ent = qring[slots[:, None], torch.arange(Hq)[None, :], pick].float()
    q = torch.where(near[..., None], ent + 0.1 * torch.randn(B, Hq, d, generator=g), q).to(torch.bfloat16)
    positions = torch.full((B,), m, dtype=torch.int64)
    sring = sketch(qring, sketch_kind).to(sketch_dtype(sketch_kind))
    return q, sketch(q, sketch_kind), qring, sring, ring_lse, ring_pos, slots, positions


def _one_rounding_step(got, want, kind):
    """The kernel's query sketch vs torch's: equal up to one rounding step of the sketch dtype (its
    projection sums in another fp32 order), equal for most elements, and equal everywhere for the
    E4M3 sketch of the entry (no sum: the kernel rounds as torch does)."""
    if kind == "fp8":
        return torch.equal(got, want)
    rel, tiny = (2.0 ** -2, 2.0 ** -9) if "fp8" in kind else (2.0 ** -7, 2.0 ** -133)   # E4M3 / bf16 spacing
    return bool(((got - want).abs() <= rel * want.abs() + tiny).all()) and (got == want).float().mean() > 0.8


def _unstable(q, qs, qring, sring, ring_pos, slots, positions, C, thr):
    """[B, Hq] heads whose decision fp32 summation order may flip (module doc)."""
    K = qring.shape[2]
    rpos = ring_pos[slots]
    m = positions[:, None]
    valid = ((rpos >= 0) & (rpos < m) & (rpos >= m - K))[:, None, :]
    a = (qs.double()[:, :, None] - sring[slots].double()).square().sum(-1).masked_fill(~valid, float("inf"))
    e = (q.double()[:, :, None] - qring[slots].double()).square().sum(-1).masked_fill(~valid, float("inf"))
    sa = a.sort(-1).values
    close = lambda x, y: ((x - y).abs() <= NEAR * y.abs().clamp(min=1e-30)) & torch.isfinite(y)  # noqa: E731
    flip = close(sa[..., C - 1], sa[..., C]) if C < K else torch.zeros_like(sa[..., 0], dtype=torch.bool)
    top = a.sort(dim=-1, stable=True).indices[..., :C]
    se = torch.gather(e, 2, top).sort(-1).values
    if C > 1:
        flip |= close(se[..., 0], se[..., 1])
    return flip | close(se[..., 0].sqrt(), torch.full_like(se[..., 0], thr))


@pytest.mark.parametrize("sketch_kind", MATCH_SKETCHES)
@pytest.mark.parametrize("C", [1, 4, 16])
@pytest.mark.parametrize("B,Hq,K,d,m", [(1, 4, 100, 64, 130), (3, 8, 256, 128, 900), (2, 2, 37, 64, 37),
                                        (5, 4, 1024, 128, 5000)])
def test_two_stage_kernels_equal_the_reference(sketch_kind, C, B, Hq, K, d, m):
    from macattn.plugins.mac.match_op import TwoStageMatchLauncher

    seed = zlib.crc32(f"{sketch_kind}/{C}/{B}/{K}".encode()) % 1000      # the same draw in every process
    host = _problem(B, Hq, K, d, m, seed, sketch_kind)
    q, qs, qring, sring, lse, pos, slots, positions = (t.to(DEVICE) for t in host)
    band, tau = 4, 0.45
    launcher = TwoStageMatchLauncher()
    for bufs in launcher._scratch.values():
        for t in bufs:
            t.fill_(-7)
    proj = sketch_projection_of(sketch_kind, d, DEVICE)
    mp, dist, got_qs = launcher(q, proj, qring, sring, lse, pos, slots, positions, band, tau, C)
    got_qs = got_qs.cpu()
    assert _one_rounding_step(got_qs, host[1], sketch_kind)
    host = (host[0], got_qs) + host[2:]                   # decisions: from the kernel's own query sketch
    want_mp, want_dist = mac_match_two_stage_reference(q.cpu(), qring.cpu(), lse.cpu(), pos.cpu(), slots.cpu(),
                                                       positions.cpu(), band=band, tau=tau, sketch=sketch_kind,
                                                       candidates=C, q_sketch=got_qs)
    mp, dist = mp.cpu(), dist.cpu()
    assert mp.dtype == torch.int64 and dist.dtype == torch.float32 and not torch.isnan(dist).any()
    thr = match_threshold(d, tau)
    unstable = _unstable(*host[:4], *host[5:], C, thr)
    stable = ~unstable
    assert stable.float().mean() >= 0.5          # near-ties are rare; E4M3 sketches make a few exact ones
    assert torch.equal(mp[stable], want_mp[stable])
    fin = torch.isfinite(want_dist) & stable
    assert torch.equal(torch.isfinite(dist)[stable], torch.isfinite(want_dist)[stable])
    torch.testing.assert_close(dist[fin], want_dist[fin], rtol=1e-5, atol=1e-5)
    assert (want_mp >= 0).any() and (want_mp < 0).any()
    # every accepted match passes the exact test, unstable heads included
    hit = mp >= 0
    col = torch.where(hit, mp, 0) % K
    ent = torch.gather(qring.cpu()[slots.cpu()].float(), 2, col[..., None, None].expand(B, Hq, 1, d)).squeeze(2)
    assert ((q.cpu().float() - ent).norm(dim=-1)[hit] < thr).all()


def test_the_launcher_refuses_bad_inputs():
    from macattn.plugins.mac.match_op import TwoStageMatchLauncher

    q, qs, qring, sring, lse, pos, slots, positions = (t.to(DEVICE) for t in _problem(1, 2, 32, 64, 40, 0, "fp8"))
    run = TwoStageMatchLauncher()
    with pytest.raises(ValueError, match="sring must be E4M3 or bf16"):
        run(q, None, qring, sring.float(), lse, pos, slots, positions, 2, 0.45, 4)
    with pytest.raises(ValueError, match="without a projection the sketch is the entry in E4M3"):
        run(q, None, qring, sring.to(torch.bfloat16), lse, pos, slots, positions, 2, 0.45, 4)
    with pytest.raises(ValueError, match="proj must be a contiguous fp32"):
        run(q, torch.zeros(64, 32, device=DEVICE), qring, sring, lse, pos, slots, positions, 2, 0.45, 4)
    with pytest.raises(ValueError, match="power-of-two candidates"):
        run(q, None, qring, sring, lse, pos, slots, positions, 2, 0.45, 3)
