"""MAC-Attention reference decode step (docs/spec.md §1) against independent fp64 computations.

The expected values here never call ``macattn.core.summaries`` / ``macattn.methods.mac.reference`` helpers: every
summary is a plain ``torch.softmax`` / ``torch.logsumexp`` over an explicit index range,
and the whole decode loop is re-modelled by ``RefMac`` below straight from docs/spec.md §1.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import macattn.methods.mac.ops  # noqa: F401  (registers torch.ops.macattn.*)
from macattn.methods.mac.reference import (full_attention_reference, mac_attend_reference, mac_decode_step_reference,
                         mac_match_reference, rectified_summaries_reference, ring_append_reference)

F64 = torch.float64
F32 = torch.float32
NEG_INF = float("-inf")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- independent math

def as64(q, k, v, lo, hi):
    """AS_[lo, hi] of one head in fp64: q [d], k, v [T, d] -> (o [d], lse 0-dim). Empty if hi < lo."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    lo = max(lo, 0)
    if hi < lo:
        return torch.zeros(q.shape[-1], dtype=F64), torch.tensor(NEG_INF, dtype=F64)
    logits = (k[lo:hi + 1] @ q) / math.sqrt(q.shape[-1])
    return torch.softmax(logits, 0) @ v[lo:hi + 1], torch.logsumexp(logits, 0)


def merge64(a, b):
    (oa, la), (ob, lb) = a, b
    if torch.isneginf(la):
        return ob.to(F64), lb.to(F64)
    if torch.isneginf(lb):
        return oa.to(F64), la.to(F64)
    lse = torch.logaddexp(la.to(F64), lb.to(F64))
    return torch.exp(la - lse) * oa.to(F64) + torch.exp(lb - lse) * ob.to(F64), lse


def full64(q, k, v, m):
    """Full causal attention over keys 0..m for all heads: q [Hq, d], k, v [Hkv, T, d] -> [Hq, d] fp64,
    via scaled_dot_product_attention with explicit GQA head expansion."""
    Hq, Hkv = q.shape[0], k.shape[0]
    kk = k[:, :m + 1].to(F64).repeat_interleave(Hq // Hkv, 0)
    vv = v[:, :m + 1].to(F64).repeat_interleave(Hq // Hkv, 0)
    return F.scaled_dot_product_attention(q.to(F64).unsqueeze(1), kk, vv).squeeze(1)


def make_rings(S, Hq, K, d, dtype=F32, lse_dtype=F32):
    return (torch.zeros(S, Hq, K, d, dtype=dtype), torch.zeros(S, Hq, K, d, dtype=dtype),
            torch.full((S, Hq, K), NEG_INF, dtype=lse_dtype), torch.full((S, K), -1, dtype=torch.int64))


def clone_rings(rings):
    return tuple(r.clone() for r in rings)


class RefMac:
    """Independent model of docs/spec.md §1 for one request, all heads, fp64 math.

    ring: position -> (q_pre [Hq, d], o [Hq, d], lse [Hq]) holding the last K positions, values
    rounded through the ring dtypes the module stores them in.
    """

    def __init__(self, Hq, Hkv, d, K, band, tau, enabled=True, ring_dtype=F32, lse_dtype=F32):
        self.Hq, self.Hkv, self.d, self.K, self.band, self.tau, self.enabled = Hq, Hkv, d, K, band, tau, enabled
        self.ring_dtype, self.lse_dtype = ring_dtype, lse_dtype
        self.ring = {}

    def store(self, t, q_pre, o, lse):
        self.ring[t] = (q_pre.to(self.ring_dtype).to(F64), o.to(self.ring_dtype).to(F64),
                        lse.to(self.lse_dtype).to(F64))
        for old in [p for p in self.ring if p <= t - self.K]:
            del self.ring[old]

    def step(self, m, q, q_pre, k, v):
        """q, q_pre [Hq, d]; k, v [Hkv, T, d] (keys 0..m valid). Returns (out, match, dist, entry)."""
        r, group = self.band, self.Hq // self.Hkv
        qp = q_pre.to(self.ring_dtype).to(F64)
        thr = math.sqrt(2.0 * self.d) * (1.0 - self.tau)
        outs, eo, el, match, dists = [], [], [], [], []
        for h in range(self.Hq):
            kh, vh = k[h // group], v[h // group]
            cands = [t for t in self.ring if m - self.K <= t < m]
            best, best_d = None, math.inf
            if self.enabled and cands:
                dd = {t: float((qp[h] - self.ring[t][0][h]).norm()) for t in cands}
                t_star = min(dd, key=dd.get)
                best_d = dd[t_star]
                if best_d < thr and t_star - r >= 0 and math.isfinite(float(self.ring[t_star][2][h])):
                    best = t_star
            if best is None:
                entry = as64(q[h], kh, vh, 0, m - r)
            else:
                cached = (self.ring[best][1][h], self.ring[best][2][h])
                entry = merge64(cached, as64(q[h], kh, vh, best - r + 1, m - r))
            out = merge64(entry, as64(q[h], kh, vh, m - r + 1, m))
            outs.append(out[0]), eo.append(entry[0]), el.append(entry[1])
            match.append(-1 if best is None else best), dists.append(best_d)
        entry = (torch.stack(eo), torch.stack(el))
        self.store(m, q_pre, *entry)
        return torch.stack(outs), torch.tensor(match), torch.tensor(dists), entry


def pooled_queries(g, P, Hq, d, noise=0.05):
    """Pre-RoPE queries drawn near one of P pool vectors: same-pool pairs are close (hits at
    moderate tau), different-pool pairs far; distances are distinct (no ties)."""
    pool = torch.randn(P, Hq, d, generator=g)

    def draw():
        i = int(torch.randint(0, P, (1,), generator=g))
        return pool[i] + noise * torch.randn(Hq, d, generator=g)
    return draw


def maxerr(a, b):
    return float((a.to(F64) - b.to(F64)).abs().max())


def _lse_close(got, exp, tol):
    got, exp = got.to(F64), exp.to(F64)
    assert torch.equal(torch.isneginf(got), torch.isneginf(exp))
    fin = torch.isfinite(exp)
    assert not torch.isnan(got).any()
    if fin.any():
        assert maxerr(got[fin], exp[fin]) <= tol


# ----------------------------------------------------------------------------- (a) never hit

@pytest.mark.parametrize("mode", ["disabled", "tau_admits_nothing"])
def test_never_hit_equals_full_attention(mode):
    g = _gen(11)
    B, Hq, Hkv, d, K, band, T = 2, 4, 2, 16, 8, 3, 40
    k = torch.randn(B, Hkv, T, d, generator=g)
    v = torch.randn(B, Hkv, T, d, generator=g)
    rings = make_rings(3, Hq, K, d)
    slots = torch.tensor([2, 0])
    fixed_q_pre = torch.randn(B, Hq, d, generator=g)
    if mode == "disabled":
        enabled, tau = False, 0.0     # would hit every step (identical q_pre) if it were enabled
        shadow = clone_rings(rings)
    else:
        enabled, tau = True, 0.999999
    m = torch.tensor([10, 17])
    for step in range(12):
        q = torch.randn(B, Hq, d, generator=g)
        q_pre = fixed_q_pre if mode == "disabled" else torch.randn(B, Hq, d, generator=g)
        res = mac_decode_step_reference(q, q_pre, k, v, m, slots, *rings, band=band, tau=tau, enabled=enabled)
        assert (res.match_pos == -1).all()
        assert res.out.dtype == F32
        for b in range(B):
            mb = int(m[b])
            assert maxerr(res.out[b], full64(q[b], k[b], v[b], mb)) <= 1e-6
            # the ring entry of a miss is AS_[0, m-r] under q_m
            col = mb % K
            for h in range(Hq):
                o, lse = as64(q[b, h], k[b, h // 2], v[b, h // 2], 0, mb - band)
                assert maxerr(rings[1][slots[b], h, col], o) <= 1e-6
                assert maxerr(rings[2][slots[b], h, col], lse) <= 1e-5
            assert int(rings[3][slots[b], col]) == mb
        if mode == "disabled":
            assert torch.isinf(res.dist).all()
            on = mac_decode_step_reference(q, q_pre, k, v, m, slots, *shadow, band=band, tau=tau)
            if step > 0:
                assert (on.match_pos >= 0).all()   # the same inputs do hit when enabled
        else:
            if step > 0:
                assert torch.isfinite(res.dist).all() and (res.dist > 0).all()
        m = m + 1


# ----------------------------------------------------------------------------- (b) forced hit

def _filled_ring(g, m, Hq, Hkv, d, K, band, k, v, dtype=F32, lse_dtype=F32, q_pre_scale=3.0):
    """Rings (one slot) holding positions m-K .. m-1 with far-away pre-RoPE queries and the
    rectified summaries AS_[0, t-r] computed (fp64) under each position's own old query."""
    rings = make_rings(1, Hq, K, d, dtype, lse_dtype)
    old_q = {}
    group = Hq // Hkv
    for t in range(max(0, m - K), m):
        qt = torch.randn(Hq, d, generator=g, dtype=dtype)
        old_q[t] = qt
        col = t % K
        rings[0][0, :, col] = q_pre_scale * torch.randn(Hq, d, generator=g).to(dtype)
        for h in range(Hq):
            o, lse = as64(qt[h], k[h // group], v[h // group], 0, t - band)
            rings[1][0, h, col] = o.to(dtype)
            rings[2][0, h, col] = lse.to(lse_dtype)
        rings[3][0, col] = t
    return rings, old_q


FORCED_CASES = [
    # (band, m, p per head as offsets back from m)
    (3, 20, (5, 1)),          # ordinary; p = m - 1 (A is the single index m - r)
    (0, 20, (8, 3)),          # r = 0 (B empty); p = m - K: its slot is the one being overwritten
    (5, 13, (8, 3)),          # p = m - K with p - r = 0 (the smallest valid p)
    (6, 30, (2, 8)),
]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("band,m,offsets", FORCED_CASES)
def test_forced_hit_equals_spec_formula(band, m, offsets, dtype):
    g = _gen(100 + 7 * band + m)
    Hq, Hkv, d, K, T = 2, 1, 16, 8, m + 1
    k = torch.randn(Hkv, T, d, generator=g, dtype=dtype)
    v = torch.randn(Hkv, T, d, generator=g, dtype=dtype)
    rings, old_q = _filled_ring(g, m, Hq, Hkv, d, K, band, k, v, dtype, lse_dtype=dtype)
    q = torch.randn(Hq, d, generator=g, dtype=dtype)
    q_pre = torch.randn(Hq, d, generator=g, dtype=dtype)
    ps = [m - off for off in offsets]
    for h, p in enumerate(ps):
        rings[0][0, h, p % K] = q_pre[h]          # certain match at p (distance 0)
    before = clone_rings(rings)

    # expected, straight from docs/spec.md §1 with the cached summary taken under the OLD query q_p
    exp_out, exp_entry = [], []
    for h, p in enumerate(ps):
        cached = as64(old_q[p][h], k[0], v[0], 0, p - band)
        assert torch.isfinite(cached[1])
        exp_out.append(merge64(cached, as64(q[h], k[0], v[0], p - band + 1, m)))
        exp_entry.append(merge64(cached, as64(q[h], k[0], v[0], p - band + 1, m - band)))

    # KV [0, p - r] must never matter: poison it (finite, huge) after the expectation is fixed
    lo = min(ps) - band
    k_used, v_used = k.clone(), v.clone()
    k_used[:, :lo + 1] = 1e3 * torch.randn(Hkv, lo + 1, d, generator=g, dtype=dtype)
    v_used[:, :lo + 1] = 1e3 * torch.randn(Hkv, lo + 1, d, generator=g, dtype=dtype)

    res = mac_decode_step_reference(q[None], q_pre[None], k_used[None], v_used[None], torch.tensor([m]),
                                    torch.tensor([0]), *rings, band=band, tau=0.0)
    tol = 1e-12 if dtype == F64 else 2e-6
    assert res.match_pos[0].tolist() == ps
    assert res.dist[0].tolist() == [0.0] * Hq
    col = m % K
    for h in range(Hq):
        assert maxerr(res.out[0, h], exp_out[h][0]) <= tol
        assert maxerr(rings[1][0, h, col], exp_entry[h][0]) <= tol
        assert maxerr(rings[2][0, h, col], exp_entry[h][1]) <= tol
        # reuse under the old query is not full attention: the test can tell them apart
        assert maxerr(exp_out[h][0], full64(q[h:h + 1], k, v, m)[0]) > 1e-3
    assert torch.equal(rings[0][0, :, col], q_pre)
    assert int(rings[3][0, col]) == m
    # nothing but slot m mod K changed
    keep = [c for c in range(K) if c != col]
    for new, old in zip(rings, before):
        assert torch.equal(new[..., keep] if new.dim() == 2 else new[:, :, keep],
                           old[..., keep] if old.dim() == 2 else old[:, :, keep])


# ----------------------------------------------------------------------------- (c) exact reuse

@pytest.mark.parametrize("band,offset", [(0, 1), (2, 4), (4, 8), (7, 5)])
def test_reuse_under_current_query_is_exact(band, offset):
    """If the cached AS_[0, p-r] was taken under the current query, reuse equals full attention."""
    g = _gen(300 + band)
    Hq, Hkv, d, K, m = 4, 2, 16, 8, 25
    k = torch.randn(Hkv, m + 1, d, generator=g)
    v = torch.randn(Hkv, m + 1, d, generator=g)
    rings, _ = _filled_ring(g, m, Hq, Hkv, d, K, band, k, v)
    q = torch.randn(Hq, d, generator=g)
    q_pre = torch.randn(Hq, d, generator=g)
    p = m - offset
    for h in range(Hq):
        o, lse = as64(q[h], k[h // 2], v[h // 2], 0, p - band)
        rings[0][0, h, p % K], rings[1][0, h, p % K], rings[2][0, h, p % K] = q_pre[h], o.float(), lse.float()
    res = mac_decode_step_reference(q[None], q_pre[None], k[None], v[None], torch.tensor([m]),
                                    torch.tensor([0]), *rings, band=band, tau=0.0)
    assert (res.match_pos == p).all()
    assert maxerr(res.out[0], full64(q, k, v, m)) <= 1e-6
    for h in range(Hq):
        o, lse = as64(q[h], k[h // 2], v[h // 2], 0, m - band)
        assert maxerr(rings[1][0, h, m % K], o) <= 1e-6
        assert maxerr(rings[2][0, h, m % K], lse) <= 1e-5


def test_band_at_least_m_always_misses_by_validity():
    g = _gen(301)
    Hq, Hkv, d, K, band = 2, 1, 16, 8, 12
    T = band + 2
    k = torch.randn(1, Hkv, T, d, generator=g)
    v = torch.randn(1, Hkv, T, d, generator=g)
    rings = make_rings(1, Hq, K, d)
    base = torch.randn(1, Hq, d, generator=g)
    step_dir = 0.01 * torch.randn(1, Hq, d, generator=g)
    q_pre = lambda m: base + m * step_dir              # noqa: E731  nearest is always p = m - 1, far below thr
    q = torch.randn(1, Hq, d, generator=g)             # identical every step
    for m in range(0, band + 1):                       # m <= band: p < m <= r, so p - r < 0
        res = mac_decode_step_reference(q, q_pre(m), k, v, torch.tensor([m]), torch.tensor([0]), *rings,
                                        band=band, tau=0.0)
        assert (res.match_pos == -1).all()
        if m > 0:
            assert (res.dist < 0.1).all()
        assert maxerr(res.out[0], full64(q[0], k[0], v[0], m)) <= 1e-6
    # m = band + 1: p = band is valid now (its entry AS_[0, 0] is finite) and, the query being
    # the same, reuse is exact
    m = band + 1
    res = mac_decode_step_reference(q, q_pre(m), k, v, torch.tensor([m]), torch.tensor([0]), *rings,
                                    band=band, tau=0.0)
    assert (res.match_pos == band).all()
    assert maxerr(res.out[0], full64(q[0], k[0], v[0], m)) <= 1e-6


# ----------------------------------------------------------------------------- (d) wrap-around

def test_ring_wraparound_matches_independent_model():
    g = _gen(400)
    Hq, Hkv, d, K, band, tau, steps = 2, 1, 16, 8, 2, 0.45, 30
    k = torch.randn(1, Hkv, steps, d, generator=g)
    v = torch.randn(1, Hkv, steps, d, generator=g)
    rings = make_rings(2, Hq, K, d)
    slot = torch.tensor([1])
    ref = RefMac(Hq, Hkv, d, K, band, tau)
    draw = pooled_queries(g, 3, Hq, d)
    hits = 0
    for m in range(steps):
        q = torch.randn(1, Hq, d, generator=g)
        q_pre = draw()[None]
        res = mac_decode_step_reference(q, q_pre, k, v, torch.tensor([m]), slot, *rings, band=band, tau=tau)
        out, match, dist, entry = ref.step(m, q[0], q_pre[0], k[0], v[0])
        assert res.match_pos[0].tolist() == match.tolist()
        mp = res.match_pos[0]
        assert ((mp == -1) | ((mp >= m - K) & (mp <= m - 1) & (mp - band >= 0))).all()
        hits += int((mp >= 0).sum())
        fin = torch.isfinite(dist)
        assert torch.equal(torch.isfinite(res.dist[0]), fin)
        if fin.any():
            assert maxerr(res.dist[0][fin], dist[fin]) <= 1e-4
        assert maxerr(res.out[0], out) <= 2e-6
        # ring_pos holds exactly the last K positions, position t in slot t mod K
        pos = rings[3][1]
        live = list(range(max(0, m - K + 1), m + 1))
        assert sorted(int(t) for t in pos if t >= 0) == live
        assert all(int(pos[t % K]) == t for t in live)
        assert (rings[3][0] == -1).all()             # the other slot is untouched
        for t in live:
            assert maxerr(rings[1][1, :, t % K], ref.ring[t][1]) <= 2e-6
            _lse_close(rings[2][1, :, t % K], ref.ring[t][2], 2e-6)
    assert hits >= 10, hits


def test_match_ignores_positions_outside_window_and_invalid_entries():
    g = _gen(401)
    Hq, d, K, band, m = 4, 16, 8, 2, 20
    rings = make_rings(1, Hq, K, d)
    q_pre = torch.randn(1, Hq, d, generator=g)
    for c in range(K):                                   # everything else far away
        rings[0][0, :, c] = 5 * torch.randn(Hq, d, generator=g)
        rings[2][0, :, c] = 1.0
    # slot layout (positions): exact copies of q_pre planted at positions that must not match
    bad = {0: m - K - 1,          # too old
           1: m,                  # the current position (not < m)
           2: m + 3,              # a future position (stale entry)
           3: -1}                 # empty slot
    for h, t in bad.items():
        c = (m - 1 - h) % K
        rings[0][0, h, c] = q_pre[0, h]
        rings[3][0, c] = t
    for c in range(K):
        if c not in [(m - 1 - h) % K for h in bad]:
            rings[3][0, c] = m - K + ((c - (m - K)) % K)   # ordinary in-window positions
    mp, dist = mac_match_reference(q_pre, *[rings[i] for i in (0, 2, 3)], torch.tensor([0]),
                                   torch.tensor([m]), band=band, tau=0.0)
    assert (mp == -1).all(), mp
    assert (dist > 1.0).all()
    # the same planted queries at in-window positions do hit
    for h in bad:
        rings[3][0, (m - 1 - h) % K] = m - 1 - h
    mp, dist = mac_match_reference(q_pre, *[rings[i] for i in (0, 2, 3)], torch.tensor([0]),
                                   torch.tensor([m]), band=band, tau=0.0)
    assert mp[0].tolist() == [m - 1 - h for h in range(Hq)]
    # an entry with lse = -inf is not a valid summary: miss
    rings[2][0, 0, (m - 1) % K] = NEG_INF
    mp, _ = mac_match_reference(q_pre, *[rings[i] for i in (0, 2, 3)], torch.tensor([0]),
                                torch.tensor([m]), band=band, tau=0.0)
    assert int(mp[0, 0]) == -1 and mp[0, 1:].tolist() == [m - 2, m - 3, m - 4]


def test_match_requires_p_minus_r_nonnegative_even_with_finite_lse():
    """Validity is p - r >= 0 itself, not only a finite lse (e.g. entries seeded under another band)."""
    g = _gen(402)
    Hq, d, K, band, m = 2, 16, 8, 3, 5
    rings = make_rings(1, Hq, K, d)
    for t in range(m):
        rings[0][0, :, t] = 5 * torch.randn(Hq, d, generator=g)
        rings[2][0, :, t] = 0.5                      # finite for every position, even t - r < 0
        rings[3][0, t] = t
    q_pre = torch.randn(1, Hq, d, generator=g)
    rings[0][0, 0, 2] = q_pre[0, 0]                  # head 0: exact copy at p = 2 (p - r = -1)
    rings[0][0, 1, 3] = q_pre[0, 1]                  # head 1: exact copy at p = 3 (p - r = 0)
    mp, dist = mac_match_reference(q_pre, rings[0], rings[2], rings[3], torch.tensor([0]), torch.tensor([m]),
                                   band=band, tau=0.0)
    assert mp[0].tolist() == [-1, 3]
    assert dist[0].tolist() == [0.0, 0.0]


def test_threshold_is_strict_and_scales_with_tau():
    Hq, d, K, m = 1, 8, 4, 10
    rings = make_rings(1, Hq, K, d)
    q_pre = torch.zeros(1, Hq, d)
    q_pre[0, 0, 0] = 1.0
    rings[0][0, 0, (m - 1) % K] = 0.0
    rings[0][0, 0, (m - 1) % K, 0] = 1.0 - 2.0       # distance exactly 2.0
    rings[2][0, 0, (m - 1) % K] = 0.0
    rings[3][0, (m - 1) % K] = m - 1
    thr_tau = lambda thr: 1.0 - thr / math.sqrt(2 * d)   # noqa: E731  tau with radius thr
    args = ([rings[i] for i in (0, 2, 3)], torch.tensor([0]), torch.tensor([m]))
    for thr, want in [(2.5, m - 1), (2.0, -1), (1.5, -1)]:
        mp, dist = mac_match_reference(q_pre, *args[0], *args[1:], band=0, tau=thr_tau(thr))
        assert float(dist) == 2.0 and int(mp) == want


# ----------------------------------------------------------------------------- (e) m - r < 0

def test_entry_is_empty_when_m_minus_r_negative():
    g = _gen(500)
    Hq, Hkv, d, K, band = 2, 1, 16, 8, 5
    T = 30
    k = torch.randn(2, Hkv, T, d, generator=g)
    v = torch.randn(2, Hkv, T, d, generator=g)
    rings = make_rings(2, Hq, K, d)
    slots = torch.tensor([0, 1])
    # request 0 starts at 0 (m - r < 0 for 5 steps), request 1 at 20 (always >= 0)
    for step in range(7):
        m = torch.tensor([step, 20 + step])
        q = torch.randn(2, Hq, d, generator=g)
        q_pre = torch.randn(2, Hq, d, generator=g)
        res = mac_decode_step_reference(q, q_pre, k, v, m, slots, *rings, band=band, tau=0.999999)
        assert (res.match_pos == -1).all()
        assert not torch.isnan(res.out).any()
        for b in range(2):
            assert maxerr(res.out[b], full64(q[b], k[b], v[b], int(m[b]))) <= 1e-6
        lse0 = rings[2][0, :, step % K]
        o0 = rings[1][0, :, step % K]
        if step - band < 0:
            assert torch.isneginf(lse0).all() and not o0.any()
        else:
            assert torch.isfinite(lse0).all()
        assert torch.isfinite(rings[2][1, :, (20 + step) % K]).all()
        assert not torch.isnan(rings[1]).any() and not torch.isnan(rings[2]).any()


# ----------------------------------------------------------------------------- (f) GQA

@pytest.mark.parametrize("Hq,Hkv", [(4, 1), (4, 4), (8, 2)])
def test_gqa_heads_hit_different_positions(Hq, Hkv):
    g = _gen(600 + Hq * 10 + Hkv)
    d, K, band, m, tau = 16, 8, 3, 21, 0.5
    group = Hq // Hkv
    k = torch.randn(Hkv, m + 1, d, generator=g)
    v = torch.randn(Hkv, m + 1, d, generator=g)
    rings, old_q = _filled_ring(g, m, Hq, Hkv, d, K, band, k, v)
    q = torch.randn(Hq, d, generator=g)
    q_pre = torch.randn(Hq, d, generator=g)
    # head h plants a near copy at a head-specific p; the last head plants nothing (miss)
    ps = [m - 1 - (h % K) if h < Hq - 1 else -1 for h in range(Hq)]
    for h, p in enumerate(ps):
        if p >= 0:
            rings[0][0, h, p % K] = q_pre[h] + 0.01 * torch.randn(d, generator=g)
    res = mac_decode_step_reference(q[None], q_pre[None], k[None], v[None], torch.tensor([m]),
                                    torch.tensor([0]), *rings, band=band, tau=tau)
    assert res.match_pos[0].tolist() == ps
    # heads of one KV group really took different p
    assert len(set(ps[:group])) == group if group > 1 else True
    for h, p in enumerate(ps):
        kh, vh = k[h // group], v[h // group]
        if p >= 0:
            cached = as64(old_q[p][h], kh, vh, 0, p - band)
            out = merge64(cached, as64(q[h], kh, vh, p - band + 1, m))
            entry = merge64(cached, as64(q[h], kh, vh, p - band + 1, m - band))
        else:
            out = as64(q[h], kh, vh, 0, m)
            entry = as64(q[h], kh, vh, 0, m - band)
        assert maxerr(res.out[0, h], out[0]) <= 2e-6
        assert maxerr(rings[1][0, h, m % K], entry[0]) <= 2e-6
        assert maxerr(rings[2][0, h, m % K], entry[1]) <= 2e-6


# ----------------------------------------------------------------------------- (g) batching

def _seed_slot(rings, slot, q_prompt, q_pre_prompt, k, v, band):
    """Write the last min(K, L) prompt positions' rectified summaries (fp64, computed here) into slot."""
    K = rings[0].shape[2]
    Hq, L = q_prompt.shape[:2]
    group = Hq // k.shape[0]
    for t in range(max(0, L - K), L):
        c = t % K
        rings[0][slot, :, c] = q_pre_prompt[:, t]
        for h in range(Hq):
            o, lse = as64(q_prompt[h, t], k[h // group], v[h // group], 0, t - band)
            rings[1][slot, h, c], rings[2][slot, h, c] = o.float(), lse.float()
        rings[3][slot, c] = t


def test_batched_requests_equal_each_decoded_alone():
    g = _gen(700)
    Hq, Hkv, d, K, band, tau, steps = 4, 2, 16, 8, 3, 0.45, 8
    lengths = [9, 16, 23]
    slots = [2, 0, 1]
    T = max(lengths) + steps + 5
    B = len(lengths)
    draw = pooled_queries(g, 2, Hq, d)
    k = torch.randn(B, Hkv, T, d, generator=g)          # garbage past each request's length
    v = torch.randn(B, Hkv, T, d, generator=g)
    q_all = torch.randn(B, Hq, T, d, generator=g)
    q_pre_all = torch.stack([torch.stack([draw() for _ in range(T)], 1) for _ in range(B)])  # [B, Hq, T, d]
    batched = make_rings(4, Hq, K, d)
    alone = [make_rings(1, Hq, K, d) for _ in range(B)]
    for b, L in enumerate(lengths):
        _seed_slot(batched, slots[b], q_all[b], q_pre_all[b], k[b], v[b], band)
        _seed_slot(alone[b], 0, q_all[b], q_pre_all[b], k[b], v[b], band)
    hits = 0
    for s in range(steps):
        m = torch.tensor([L + s for L in lengths])
        idx = m.view(B, 1, 1, 1).expand(B, Hq, 1, d)
        q = q_all.gather(2, idx).squeeze(2)
        q_pre = q_pre_all.gather(2, idx).squeeze(2)
        res = mac_decode_step_reference(q, q_pre, k, v, m, torch.tensor(slots), *batched, band=band, tau=tau)
        hits += int(res.hit.sum())
        for b in range(B):
            mb = int(m[b])
            kb, vb = k[b:b + 1, :, :mb + 1], v[b:b + 1, :, :mb + 1]        # trimmed: no padding at all
            one = mac_decode_step_reference(q[b:b + 1], q_pre[b:b + 1], kb, vb, m[b:b + 1], torch.tensor([0]),
                                            *alone[b], band=band, tau=tau)
            assert torch.equal(one.match_pos[0], res.match_pos[b])
            assert maxerr(one.out[0], res.out[b]) <= 1e-6
            for got, ref in zip(batched, alone[b]):
                if got.dtype == torch.int64:
                    assert torch.equal(got[slots[b]], ref[0])
                else:
                    fin = torch.isfinite(ref[0])
                    assert torch.equal(fin, torch.isfinite(got[slots[b]]))
                    assert maxerr(got[slots[b]][fin], ref[0][fin]) <= 1e-6
    assert hits > 0
    assert (batched[3][3] == -1).all() and torch.isneginf(batched[2][3]).all() and not batched[0][3].any()


# ----------------------------------------------------------------------------- (h) torch.library ops

def test_library_ops_equal_reference_and_mutate_rings():
    g = _gen(800)
    B, Hq, Hkv, d, K, band, tau = 2, 4, 2, 16, 8, 2, 0.45
    T = 32
    k = torch.randn(B, Hkv, T, d, generator=g)
    v = torch.randn(B, Hkv, T, d, generator=g)
    ops_rings = make_rings(3, Hq, K, d)
    ref_rings = make_rings(3, Hq, K, d)
    slots = torch.tensor([1, 2])
    scale = 1.0 / math.sqrt(d)
    draw = pooled_queries(g, 2, Hq, d)
    hits = 0
    for s in range(16):
        m = torch.tensor([5 + s, 12 + s])
        q = torch.randn(B, Hq, d, generator=g)
        q_pre = torch.stack([draw(), draw()])
        before = clone_rings(ops_rings)
        mp, dist = torch.ops.macattn.mac_match(q_pre, ops_rings[0], ops_rings[2], ops_rings[3], slots, m, band, tau)
        mp_ref, dist_ref = mac_match_reference(q_pre, ref_rings[0], ref_rings[2], ref_rings[3], slots, m,
                                               band=band, tau=tau)
        assert torch.equal(mp, mp_ref) and torch.equal(dist, dist_ref)
        for a, b in zip(ops_rings, before):
            assert torch.equal(a, b)                         # match does not mutate
        out = torch.ops.macattn.mac_attend(q, q_pre, k, v, m, mp, slots, *ops_rings, band, scale)
        res = mac_decode_step_reference(q, q_pre, k, v, m, slots, *ref_rings, band=band, tau=tau)
        assert torch.equal(res.match_pos, mp)
        assert out.dtype == q.dtype and out.shape == (B, Hq, d)
        assert maxerr(out, res.out) <= 1e-7
        for a, b in zip(ops_rings, ref_rings):
            assert torch.equal(a, b)
        # the op wrote slot m mod K of each request's row
        for b in range(B):
            assert int(ops_rings[3][slots[b], int(m[b]) % K]) == int(m[b])
            assert torch.equal(ops_rings[0][slots[b], :, int(m[b]) % K], q_pre[b])
        assert not torch.equal(ops_rings[3], before[3])
        hits += int((mp >= 0).sum())
    assert hits > 0
    assert (ops_rings[3][0] == -1).all()


def test_library_ops_pass_opcheck():
    g = _gen(801)
    B, Hq, Hkv, d, K, band = 1, 2, 1, 8, 4, 1
    T = 12
    k = torch.randn(B, Hkv, T, d, generator=g)
    v = torch.randn(B, Hkv, T, d, generator=g)
    rings = make_rings(1, Hq, K, d)
    q_prompt = torch.randn(Hq, T, d, generator=g)
    _seed_slot(rings, 0, q_prompt[:, :8], q_prompt[:, :8], k[0], v[0], band)   # prompt 0..7
    m = torch.tensor([8])
    q_pre = rings[0][:, :, 7 % K].clone()                 # hit at p = 7
    q = torch.randn(B, Hq, d, generator=g)
    slots = torch.tensor([0])
    mp, _ = torch.ops.macattn.mac_match(q_pre, rings[0], rings[2], rings[3], slots, m, band, 0.0)
    assert (mp == 7).all()
    torch.library.opcheck(torch.ops.macattn.mac_match.default,
                          (q_pre, rings[0], rings[2], rings[3], slots, m, band, 0.0))
    torch.library.opcheck(torch.ops.macattn.mac_attend.default,
                          (q, q_pre, k, v, m, mp, slots, *rings, band, 1.0 / math.sqrt(d)))


# ----------------------------------------------------------------------------- (i) seeding summaries

@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (F32, 2e-6)])
@pytest.mark.parametrize("band,first", [(5, 0), (3, 9), (0, 4)])
def test_rectified_summaries_equal_direct_computation(dtype, tol, band, first):
    g = _gen(900 + band + first)
    B, Hq, Hkv, d, L = 2, 4, 2, 16, 20
    q = torch.randn(B, Hq, L, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, L, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, L, d, generator=g, dtype=dtype)
    qpos = torch.arange(first, L)
    n = qpos.numel()
    got = rectified_summaries_reference(q[:, :, first:], k, v, qpos, band=band)
    assert got.o.shape == (B, Hq, n, d) and got.lse.shape == (B, Hq, n)
    chunked = rectified_summaries_reference(q[:, :, first:], k, v, qpos, band=band, chunk=3)
    assert maxerr(chunked.o, got.o) <= tol
    _lse_close(chunked.lse, got.lse, tol)
    for b in range(B):
        for h in range(Hq):
            for i, t in enumerate(qpos.tolist()):
                o, lse = as64(q[b, h, t], k[b, h // 2], v[b, h // 2], 0, t - band)
                if t - band < 0:
                    assert torch.isneginf(got.lse[b, h, i]) and not got.o[b, h, i].any()
                else:
                    assert abs(float(got.lse[b, h, i]) - float(lse)) <= tol
                    assert maxerr(got.o[b, h, i], o) <= tol


def test_full_attention_reference_and_shape_checks():
    g = _gen(950)
    B, Hq, Hkv, d, T = 2, 4, 2, 16, 10
    q = torch.randn(B, Hq, d, generator=g)
    k = torch.randn(B, Hkv, T, d, generator=g)
    v = torch.randn(B, Hkv, T, d, generator=g)
    m = torch.tensor([3, 9])
    out = full_attention_reference(q, k, v, m)
    for b in range(B):
        assert maxerr(out[b], full64(q[b], k[b], v[b], int(m[b]))) <= 1e-6
    with pytest.raises(ValueError, match="positions"):
        full_attention_reference(q, k, v, torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        full_attention_reference(q[:, :3], k, v, m)
    rings = make_rings(2, Hq, 4, d)
    with pytest.raises(ValueError, match="positions"):
        mac_attend_reference(q, k, v, torch.tensor([3]), torch.full((B, Hq), -1), rings[1], rings[2],
                             torch.tensor([0, 1]), band=1)
    # ring_append writes exactly slot m mod K of the given rows
    entry_o = torch.randn(B, Hq, d, generator=g)
    entry = type(mac_attend_reference(q, k, v, m, torch.full((B, Hq), -1), rings[1], rings[2],
                                      torch.tensor([0, 1]), band=1)[1])(entry_o, torch.ones(B, Hq))
    ring_append_reference(*rings, torch.tensor([1, 0]), m, q, entry)
    assert rings[3].tolist() == [[-1, 9, -1, -1], [-1, -1, -1, 3]]
    assert torch.equal(rings[1][1, :, 3], entry_o[0]) and torch.equal(rings[1][0, :, 1], entry_o[1])
