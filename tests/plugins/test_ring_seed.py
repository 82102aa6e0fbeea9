"""The ring-seeding reference (``macattn.plugins.ring_seed.reference.seed_rows_reference``) writes the rows that
``methods.mac.seeding.seed_rings_``'s traceable path writes (``seeded_ring_rows``, then four ``index_copy_``) bit
for bit, from the same summaries, across prompts shorter than, as long as and longer than the window (``L mod K``
not 0), bands with empty far parts, an int slot and several slots; the rows of other slots stay as they were; bad
inputs are named (CPU). The launcher: ``test_ring_seed_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from macattn.methods.mac.seeding import seed_rings_, tail_summaries
from macattn.plugins.ring_seed import seed_rows_for
from macattn.plugins.ring_seed.reference import seed_rows_reference

S, Hq, Hkv, d = 5, 4, 2, 8
POISON_POS = -7


def _rings(K, q_dtype):
    """Rings of ``S`` slots (``MacState``'s dtypes, ``qring`` in ``q_dtype``), every element poisoned."""
    return [torch.full((S, Hq, K, d), float("nan"), dtype=q_dtype), torch.full((S, Hq, K, d), float("nan")),
            torch.full((S, Hq, K), float("nan")), torch.full((S, K), POISON_POS, dtype=torch.int64)]


def _prompt(B, L, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, q_pre = (torch.randn(B, Hq, L, d, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, L, d, generator=g, dtype=dtype) for _ in range(2))
    return q, q_pre, k, v


@pytest.mark.parametrize("L,K", [(1, 8), (5, 8), (7, 8), (8, 8), (16, 8), (19, 8), (30, 7)])
@pytest.mark.parametrize("band", [0, 3, 12])
@pytest.mark.parametrize("dtype,q_dtype", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                           (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slots", [2, [3, 0]], ids=["int", "two_rows"])
def test_reference_writes_the_seeded_ring_rows(L, K, band, dtype, q_dtype, slots):
    B = 1 if isinstance(slots, int) else len(slots)
    q, q_pre, k, v = _prompt(B, L, dtype, seed=L * 100 + K * 10 + band)
    n = min(K, L)
    summary = tail_summaries(q[:, :, L - n:], k, v, band=band, scale=0.3)
    assert bool(torch.isinf(summary.lse).any()) == (L - n < band)     # the empty far parts the case asks for
    rows = torch.tensor([slots] if B == 1 else slots)
    want, got = _rings(K, q_dtype), _rings(K, q_dtype)
    seed_rings_(want, rows, q, q_pre, k, v, band=band, scale=0.3, summary=summary)
    seed_rows_reference(*got, slots if B == 1 else rows, q_pre, summary.o, summary.lse)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    others = [s for s in range(S) if s not in rows.tolist()]
    assert not got[0][rows].isnan().any() and not got[2][rows].isnan().any() and (got[3][rows] != POISON_POS).all()
    assert got[0][others].isnan().all() and (got[3][others] == POISON_POS).all()
    # and the traceable path's own summaries (a second computation of the same entries)
    own = _rings(K, q_dtype)
    seed_rings_(own, rows, q, q_pre, k, v, band=band, scale=0.3)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(got, own):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)


def test_the_cpu_takes_the_reference():
    assert seed_rows_for("cpu") is seed_rows_reference


@pytest.mark.parametrize("change,match", [
    (dict(o=torch.zeros(1, Hq, 5, d)), "o must be"),
    (dict(lse=torch.zeros(1, Hq, 6, 1)), "lse must be"),
    (dict(slots=torch.tensor([1, 2])), "slots must be"),
    (dict(slots=torch.tensor([1], dtype=torch.int32)), "slots must be"),
    (dict(slots=S), "slots must be"),
    (dict(q_pre=torch.zeros(1, Hq + 1, 10, d)), "q_pre must be"),
    (dict(q_pre=torch.zeros(2, Hq, 10, d), o=torch.zeros(2, Hq, 6, d), lse=torch.zeros(2, Hq, 6)), "an int slot"),
    (dict(ring_pos=torch.zeros(S, 6, dtype=torch.int32)), "ring_pos must be"),
    (dict(qring=torch.zeros(S, Hq, 6, d, dtype=torch.int8)), "qring must be"),
])
def test_bad_inputs_are_named(change, match):
    K = 6
    args = dict(qring=torch.zeros(S, Hq, K, d), oring=torch.zeros(S, Hq, K, d), ring_lse=torch.zeros(S, Hq, K),
                ring_pos=torch.zeros(S, K, dtype=torch.int64), slots=1, q_pre=torch.zeros(1, Hq, 10, d),
                o=torch.zeros(1, Hq, K, d), lse=torch.zeros(1, Hq, K))
    with pytest.raises((ValueError, TypeError), match=match):
        seed_rows_reference(**{**args, **change})
