"""A packed prefill of fresh segments seeded at once (``seeding.seed_packed_``: one ``flash_varlen`` call for every
segment's ring summaries, one indexed store per ring) on the CPU, in fp64 through ``flash_varlen_reference``: a packed
MAC layer's output and rings equal the one-segment-at-a-time path's for every edge of ``packed_cases`` (rings poisoned
first, so an entry or row left unwritten shows), and a far part one key off is caught. The same cases run on CUDA in
bf16 in ``test_seeding_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from macattn.core.ragged import PrefillSegment
from macattn.methods.mac import backend, seeding
from macattn.methods.mac.seeding import packed_seeding_applies, packed_seeds

from _fresh_split import POISON_POS, Seg, cases, packed_call, packed_cases, row_error, run_packed_and_loop

K, B = 16, 4
CASES = packed_cases(K, B)


def _close_rings(new, old, tol: float) -> None:
    """Equal within ``tol`` (fp64 stand-ins: rounding only), poison (NaN / ``POISON_POS``) exactly where the loop left it."""
    for a, b in zip(new, old):
        if a.dtype == torch.int64:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 4)])
def test_packed_seeding_equals_one_segment_at_a_time(name, Hq, Hkv, monkeypatch):
    p = packed_call(CASES[name], Hq=Hq, Hkv=Hkv, d=16, dtype=torch.float64, device="cpu", seed=len(name) + Hkv)
    assert packed_seeding_applies(p.plan.segments, K, B)
    (out, rings, calls), (old_out, old_rings) = run_packed_and_loop(monkeypatch, p, window=K, band=B, force=True)
    assert calls == 1
    assert row_error(out, old_out) < 1e-6
    _close_rings(rings, old_rings, 1e-6)
    q, _, _, pos = rings
    for i, seg in enumerate(p.plan.segments):       # a seeding segment's row written whole, another's untouched
        seeded = seg.last_positions(K) > 0
        assert bool((pos[i] != POISON_POS).all()) == seeded
        assert bool(q[i].isnan().any()) != seeded


def test_a_far_part_one_key_off_is_caught(monkeypatch):
    p = packed_call(CASES["every"], Hq=4, Hkv=2, d=16, dtype=torch.float64, device="cpu", seed=3)
    real = seeding.packed_seeds
    monkeypatch.setattr(backend, "packed_seeds",
                        lambda segs, window, band, device, min_context: real(segs, window, band - 1, device,
                                                                             min_context))
    (_, rings, calls), (_, old_rings) = run_packed_and_loop(monkeypatch, p, window=K, band=B, force=True)
    assert calls == 1
    with pytest.raises(AssertionError):
        _close_rings(rings, old_rings, 1e-6)


def test_calls_with_a_continued_or_splitting_segment_take_one_segment_at_a_time(monkeypatch):
    for name in ("exact", "mixed"):           # a fresh split (L - min(K, L) >= band), continued chunks
        segs, _ = cases(K, B)[name]
        p = packed_call(segs, Hq=4, Hkv=2, d=16, dtype=torch.float64, device="cpu", seed=1)
        assert not packed_seeding_applies(p.plan.segments, K, B)
        (out, rings, calls), (old_out, old_rings) = run_packed_and_loop(monkeypatch, p, window=K, band=B, force=True)
        assert calls == 0
        assert row_error(out, old_out) < 1e-12


def test_packed_seeds_layout():
    """Entries in token order (last ``min(K, L)`` of each seeding segment), columns ``t mod K``, rows left partly
    empty cleared, the far part's varlen layout; a call whose every token is an entry gathers nothing."""
    segs = [PrefillSegment(0, K + 2, 0, slot=3), PrefillSegment(K + 2, 2, 0, slot=0, prompt_end=5 * K),
            PrefillSegment(K + 4, 5, 0, slot=7)]
    s = packed_seeds(tuple(segs), K, B, torch.device("cpu"))
    assert s.rows.tolist() == list(range(2, K + 2)) + list(range(K + 4, K + 9))
    assert s.slots.tolist() == [3] * K + [7] * 5
    assert s.positions.tolist() == list(range(2, K + 2)) + list(range(5))
    assert s.cols.tolist() == [t % K for t in range(2, K + 2)] + list(range(5))
    assert s.cleared.tolist() == [7]
    assert s.cu_q.tolist() == [0, K, K + 5] and s.cu_k.tolist() == [0, K + 4, K + 9]
    assert s.used_k.tolist() == [K + 2 - B, 5 - B] and (s.max_q, s.max_k) == (K, K + 2 - B)
    whole = packed_seeds((PrefillSegment(0, 3, 0, slot=1), PrefillSegment(3, K, 0, slot=2)), K, B, torch.device("cpu"))
    assert whole.rows is None and whole.cleared.tolist() == [1]
    assert packed_seeds((PrefillSegment(0, 2, 0, slot=0, prompt_end=4 * K),), K, B, torch.device("cpu")) is None
