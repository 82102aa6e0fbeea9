"""Attention summaries (docs/spec.md §0): summarize, merge, removal, empty sets.

Every expected value is computed independently with ``torch.softmax`` /
``torch.logsumexp`` over the index set, in fp64.
"""
import math

import pytest
import torch

from macattn.core.summaries import (AttentionSummary, empty_summary, merge_summaries, remove_summary,
                               summarize)

F64 = torch.float64
NEG_INF = float("-inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(g, lead=(3, 2), T=48, d=8, logit_scale=1.0, dtype=F64):
    """Random logits ``[*lead, T]`` (already scaled) and values ``[*lead, T, d]``."""
    q = torch.randn(*lead, d, generator=g, dtype=dtype)
    k = torch.randn(*lead, T, d, generator=g, dtype=dtype)
    v = torch.randn(*lead, T, d, generator=g, dtype=dtype)
    logits = torch.einsum("...d,...td->...t", q, k) * (logit_scale / math.sqrt(d))
    return logits, v


def _softmax_over(logits, v, mask):
    """Independent (o, lse) of the masked set: torch.softmax / torch.logsumexp, fp64."""
    masked = logits.to(F64).masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(masked, dim=-1)
    p = torch.softmax(masked, dim=-1)
    o = torch.einsum("...t,...td->...d", p, v.to(F64))
    return o, lse


def _random_partition(g, lead, T, n_parts):
    """A random index set per row (at least n_parts members), split into n_parts disjoint,
    non-empty random subsets. Returns (union mask, [part masks])."""
    rows = int(torch.tensor(lead).prod())
    union = torch.zeros(rows, T, dtype=torch.bool)
    parts = [torch.zeros(rows, T, dtype=torch.bool) for _ in range(n_parts)]
    for r in range(rows):
        size = int(torch.randint(n_parts, T + 1, (1,), generator=g))
        idx = torch.randperm(T, generator=g)[:size]
        union[r, idx] = True
        # every part gets one member first, the rest go to random parts
        owner = torch.cat([torch.arange(n_parts), torch.randint(0, n_parts, (size - n_parts,), generator=g)])
        owner = owner[torch.randperm(size, generator=g)]
        for j in range(n_parts):
            parts[j][r, idx[owner == j]] = True
    return union.view(*lead, T), [p.view(*lead, T) for p in parts]


def _close(a, b, tol):
    assert a.shape == b.shape
    both_inf = torch.isneginf(a) & torch.isneginf(b) if a.is_floating_point() else None
    if both_inf is not None and both_inf.any():
        a = torch.where(both_inf, torch.zeros_like(a), a)
        b = torch.where(both_inf, torch.zeros_like(b), b)
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= tol, f"max abs error {err:.3e} > {tol:.1e}"


# --------------------------------------------------------------------------- summarize

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("logit_scale", [1.0, 60.0])
def test_summarize_equals_softmax_over_masked_set(seed, logit_scale):
    g = _gen(100 + seed)
    logits, v = _problem(g, logit_scale=logit_scale)
    mask = torch.rand(logits.shape, generator=g, dtype=F64) < 0.6
    mask[..., 0] = True  # non-empty rows
    s = summarize(logits, v, mask)
    o, lse = _softmax_over(logits, v, mask)
    assert s.o.dtype == F64 and s.lse.dtype == F64
    _close(s.lse, lse, 1e-12)
    _close(s.o, o, 1e-12)
    # mask=None means the whole range
    s_all = summarize(logits, v)
    o_all, lse_all = _softmax_over(logits, v, torch.ones_like(mask))
    _close(s_all.lse, lse_all, 1e-12)
    _close(s_all.o, o_all, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_summarize_fully_masked_row_is_empty(dtype):
    g = _gen(7)
    logits, v = _problem(g, lead=(4,), dtype=dtype)
    mask = torch.rand(logits.shape, generator=g) < 0.5
    mask[..., 0] = True
    mask[1] = False                      # one fully masked row
    mask[3] = False                      # and another
    s = summarize(logits, v, mask)
    assert not torch.isnan(s.o).any() and not torch.isnan(s.lse).any()
    assert torch.isneginf(s.lse[1]) and torch.isneginf(s.lse[3])
    assert torch.equal(s.o[1], torch.zeros_like(s.o[1])) and torch.equal(s.o[3], torch.zeros_like(s.o[3]))
    assert s.is_empty.tolist() == [False, True, False, True]
    assert torch.isfinite(s.lse[0]) and torch.isfinite(s.lse[2])
    o, lse = _softmax_over(logits, v, mask)
    tol = 1e-12 if dtype == F64 else 1e-5
    _close(s.o[[0, 2]].to(F64), o[[0, 2]], tol)
    _close(s.lse[[0, 2]].to(F64), lse[[0, 2]], tol)


def test_summarize_accumulates_at_least_fp32():
    g = _gen(8)
    logits, v = _problem(g, lead=(2,), dtype=torch.float32)
    s = summarize(logits.bfloat16(), v.bfloat16())
    assert s.o.dtype == torch.float32 and s.lse.dtype == torch.float32
    s64 = summarize(logits, v.to(F64))
    assert s64.o.dtype == F64


def test_summary_shape_mismatch_raises():
    with pytest.raises(ValueError, match="leading dims"):
        AttentionSummary(torch.zeros(2, 3, 4), torch.zeros(2, 4))


# --------------------------------------------------------------------------- merge

@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n_parts", [2, 3, 4])
def test_merge_of_disjoint_parts_equals_softmax_over_union(seed, n_parts):
    g = _gen(1000 * n_parts + seed)
    logits, v = _problem(g, lead=(3, 2), T=40, logit_scale=4.0)
    union, parts = _random_partition(g, (3, 2), 40, n_parts)
    summaries = [summarize(logits, v, m) for m in parts]
    o_ref, lse_ref = _softmax_over(logits, v, union)

    # left fold in a random order
    order = torch.randperm(n_parts, generator=g).tolist()
    acc = summaries[order[0]]
    for j in order[1:]:
        acc = merge_summaries(acc, summaries[j])
    _close(acc.lse, lse_ref, 1e-12)
    _close(acc.o, o_ref, 1e-12)

    # right fold in the original order (different association)
    acc_r = summaries[-1]
    for s in reversed(summaries[:-1]):
        acc_r = merge_summaries(s, acc_r)
    _close(acc_r.lse, lse_ref, 1e-12)
    _close(acc_r.o, o_ref, 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_merge_is_associative_and_commutative(seed):
    g = _gen(2000 + seed)
    logits, v = _problem(g, lead=(5,), T=30, logit_scale=8.0)
    _, (ma, mb, mc) = _random_partition(g, (5,), 30, 3)
    a, b, c = (summarize(logits, v, m) for m in (ma, mb, mc))
    ab, ba = merge_summaries(a, b), merge_summaries(b, a)
    _close(ab.lse, ba.lse, 1e-12)
    _close(ab.o, ba.o, 1e-12)
    left = merge_summaries(ab, c)
    right = merge_summaries(a, merge_summaries(b, c))
    _close(left.lse, right.lse, 1e-12)
    _close(left.o, right.o, 1e-12)
    # and (a ⊕ c) ⊕ b too
    other = merge_summaries(merge_summaries(a, c), b)
    _close(other.lse, left.lse, 1e-12)
    _close(other.o, left.o, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_empty_summary_is_merge_identity(dtype):
    g = _gen(31)
    logits, v = _problem(g, lead=(3, 4), dtype=dtype)
    a = summarize(logits, v)
    e = empty_summary((3, 4), a.o.shape[-1], dtype=dtype)
    assert torch.isneginf(e.lse).all() and not e.o.any()
    for merged in (merge_summaries(e, a), merge_summaries(a, e)):
        assert not torch.isnan(merged.o).any()
        assert torch.equal(merged.lse, a.lse)
        assert torch.equal(merged.o, a.o)


def test_empty_merge_empty_is_empty_without_nan():
    for dtype in (torch.float32, F64):
        e = empty_summary((2, 3), 5, dtype=dtype)
        ee = merge_summaries(e, e)
        assert torch.isneginf(ee.lse).all()
        assert not torch.isnan(ee.o).any() and not ee.o.any()


def test_merge_mixed_rows_empty_and_nonempty():
    """A batch where some rows of either operand are empty (as on MAC misses)."""
    g = _gen(32)
    logits, v = _problem(g, lead=(4,), T=20)
    ma = torch.rand(logits.shape, generator=g) < 0.5
    mb = ~ma
    ma[0] = False          # row 0: a empty
    mb[1] = False          # row 1: b empty
    ma[2] = False
    mb[2] = False          # row 2: both empty
    ma[3, 0], mb[3, 0] = True, False
    mb[3, 1], ma[3, 1] = True, False
    a, b = summarize(logits, v, ma), summarize(logits, v, mb)
    m = merge_summaries(a, b)
    assert not torch.isnan(m.o).any() and not torch.isnan(m.lse).any()
    o_ref, lse_ref = _softmax_over(logits, v, ma | mb)
    _close(m.lse, lse_ref, 1e-12)
    assert not m.o[2].any()
    _close(m.o, torch.nan_to_num(o_ref, nan=0.0), 1e-12)


def test_merge_promotes_to_fp64_when_either_operand_is_fp64():
    g = _gen(33)
    logits, v = _problem(g, lead=(2,))
    a = summarize(logits.float(), v.float())
    b = summarize(logits, v, torch.zeros_like(logits, dtype=torch.bool))
    assert merge_summaries(a, b).o.dtype == F64


# --------------------------------------------------------------------------- removal

@pytest.mark.parametrize("seed", range(4))
def test_remove_summary_well_conditioned(seed):
    g = _gen(3000 + seed)
    logits, v = _problem(g, lead=(3, 2), T=40, logit_scale=2.0)
    whole_mask, (part_mask, rest_mask) = _random_partition(g, (3, 2), 40, 2)
    # make J hold at most ~90% of I's mass so the case is well conditioned
    whole, part = summarize(logits, v, whole_mask), summarize(logits, v, part_mask)
    frac = torch.exp(part.lse - whole.lse)
    assert float(frac.max()) < 0.999
    rest, ok = remove_summary(whole, part)
    assert ok.all()
    o_ref, lse_ref = _softmax_over(logits, v, rest_mask)
    _close(rest.lse, lse_ref, 1e-10)
    _close(rest.o, o_ref, 1e-10)


def test_remove_summary_ill_conditioned_is_flagged_and_finite():
    g = _gen(41)
    T, d = 24, 8
    logits = torch.randn(4, T, generator=g, dtype=F64)
    v = torch.randn(4, T, d, generator=g, dtype=F64)
    whole_mask = torch.ones(4, T, dtype=torch.bool)
    part_mask = whole_mask.clone()
    part_mask[:, 0] = False              # I \ J = {0}
    logits[0, 0] -= 40.0                 # row 0: J holds all but e^-40 of the mass
    logits[1, 0] -= 8.0                  # row 1: residual ~ 1e-4 < min_residual 1e-3
    part_mask[2] = True                  # row 2: J == I (residual exactly 0)
    # row 3: well conditioned (I \ J = {0} with an ordinary logit)
    logits[3, 0] += 3.0
    whole, part = summarize(logits, v, whole_mask), summarize(logits, v, part_mask)
    rest, ok = remove_summary(whole, part)
    assert ok.tolist() == [False, False, False, True]
    assert not torch.isnan(rest.o).any() and not torch.isnan(rest.lse).any()
    assert torch.isneginf(rest.lse[:3]).all() and not rest.o[:3].any()
    # the good row is the summary of {0}: lse = l_0, o = v_0
    _close(rest.lse[3], logits[3, 0], 1e-10)
    _close(rest.o[3], v[3, 0], 1e-10)


def test_remove_summary_empty_operands():
    g = _gen(42)
    logits, v = _problem(g, lead=(3,), T=16)
    whole = summarize(logits, v)
    e = empty_summary((3,), v.shape[-1], dtype=F64)
    rest, ok = remove_summary(whole, e)          # removing nothing
    assert ok.all()
    _close(rest.lse, whole.lse, 1e-12)
    _close(rest.o, whole.o, 1e-12)
    rest, ok = remove_summary(e, e)              # empty minus empty
    assert not ok.any()
    assert torch.isneginf(rest.lse).all() and not torch.isnan(rest.o).any() and not rest.o.any()


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, 2.0])
def test_remove_summary_rejects_bad_min_residual(bad):
    s = empty_summary((1,), 2, dtype=F64)
    with pytest.raises(ValueError, match="min_residual"):
        remove_summary(s, s, min_residual=bad)
